"""Attention math shared by `layers` and the decode kernel's XLA reference (`kernels.decode_attention`).

Pure functions of arrays: per-row cache writes, grouped softmax attention and a tree's cache
visibility (rotary embeddings are `rotary`'s). Einsum letters as in `layers`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

# A large finite negative instead of -inf: a fully masked row (a padded query) then gives a
# uniform softmax instead of NaNs that would poison the cache through later layers.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


def write_rows(cache: jax.Array, new: jax.Array, starts: jax.Array) -> jax.Array:
    """Writes `new` [B, T, ...] into `cache` [B, S, ...] at a per-row start index [B]."""

    def write_one(row_cache, row_new, start):
        return jax.lax.dynamic_update_slice_in_dim(row_cache, row_new, start, axis=0)

    return jax.vmap(write_one)(cache, new.astype(cache.dtype), starts)


def grouped_attention(q: jax.Array, keys: jax.Array, values: jax.Array, visible: jax.Array) -> jax.Array:
    """Softmax attention with grouped kv heads.

    Args:
        q: [B, T, N, H] queries; keys, values: [B, S, K, H]; visible: [B, T, S] bool.
    Returns:
        [B, T, N, H] attended values.
    """
    batch, length, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    q = q.reshape(batch, length, num_kv_heads, num_heads // num_kv_heads, head_dim)  # [B, T, K, G, H]
    scores = jnp.einsum("btkgh,bskh->bkgts", q, keys.astype(q.dtype), preferred_element_type=jnp.float32)
    scores = jnp.where(visible[:, None, None], scores / math.sqrt(head_dim), MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, values.astype(q.dtype))
    return out.reshape(batch, length, num_heads, head_dim)


def visible_slots(base: jax.Array, relative: jax.Array, num_slots: int) -> jax.Array:
    """Cache visibility [B, T, S] of T queries: every slot before `base` [B] (the committed context)
    and, among the W slots from `base` on, those `relative` [B, T, W] marks (a tree query's ancestors)."""
    batch, queries, width = relative.shape
    offset = jnp.arange(num_slots, dtype=jnp.int32)[None, :] - base[:, None]  # [B, S]
    index = jnp.broadcast_to(jnp.clip(offset, 0, width - 1)[:, None, :], (batch, queries, num_slots))
    in_tree = ((offset >= 0) & (offset < width))[:, None, :] & jnp.take_along_axis(relative, index, axis=2)
    return (offset < 0)[:, None, :] | in_tree
