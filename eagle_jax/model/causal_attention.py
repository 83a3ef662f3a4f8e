"""Cache-free causal self-attention: what training runs where inference reads a KV cache.

The train step computes the target's features and the head's unrolled draft steps over whole
sequences at once (`train.objective`), with no cache to write. Each query of draft step j also
sees its own keys of the steps before j (the training-time test's "diagonal", `extra_keys`),
which no causal mask expresses. "xla" is the reference; "cudnn" is fused flash attention for
GPU training in half precision. Einsum letters as in `layers`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from eagle_jax.model import attention_ops


def causal_attention(q: jax.Array, keys: jax.Array, values: jax.Array, implementation: str = "xla",
                     extra_keys: tuple[jax.Array, ...] = (), extra_values: tuple[jax.Array, ...] = ()) -> jax.Array:
    """Causal self-attention of T queries over their own T keys, plus optional per-query extras.

    Args:
        q: [B, T, N, H]; keys, values: [B, T, K, H] (query t sees keys 0..t).
        implementation: "xla" (`grouped_attention`, the reference) or "cudnn" (fused flash
            attention; GPU, bf16/fp16 only).
        extra_keys, extra_values: J arrays [B, T, K, H]: query t also sees extra_keys[j][:, t]
            (the training-time test's "diagonal": a query's own earlier draft steps).
    Returns:
        [B, T, N, H] attended values.
    """
    batch, length = q.shape[:2]
    causal = jnp.tril(jnp.ones((length, length), bool))
    if implementation == "xla":
        if not extra_keys:
            return attention_ops.grouped_attention(q, keys, values, jnp.broadcast_to(causal, (batch, length, length)))
        return _grouped_attention_with_extras(q, keys, values, causal, extra_keys, extra_values)
    if implementation != "cudnn":
        raise ValueError(f"unknown attention implementation {implementation!r} (xla, cudnn)")
    if not extra_keys:  # causal, so no real query sees the pad
        out = jax.nn.dot_product_attention(_even_length(q), _even_length(keys), _even_length(values), is_causal=True,
                                           implementation="cudnn")
        return out[:, :length]
    return _masked_attention_with_extras(q, keys, values, extra_keys, extra_values, "cudnn")


def _masked_attention_with_extras(q, keys, values, extra_keys, extra_values, implementation: str):
    """One `jax.nn.dot_product_attention` call over [keys; extra_0; ...] with a static block mask.

    The mask is causal in the first block and the diagonal in each extra block.
    """
    length = q.shape[1]
    q, keys, values = _even_length(q), _even_length(keys), _even_length(values)
    extra_keys, extra_values = tuple(map(_even_length, extra_keys)), tuple(map(_even_length, extra_values))
    padded = q.shape[1]
    causal = jnp.tril(jnp.ones((padded, padded), bool))
    eye = jnp.eye(padded, dtype=bool)
    mask = jnp.concatenate([causal] + [eye] * len(extra_keys), axis=1)[None, None]  # [1, 1, T, (1+J)T]
    all_keys = jnp.concatenate((keys,) + extra_keys, axis=1)
    all_values = jnp.concatenate((values,) + extra_values, axis=1)
    out = jax.nn.dot_product_attention(q, all_keys, all_values, mask=mask, implementation=implementation)
    return out[:, :length]


def _even_length(x: jax.Array) -> jax.Array:
    """x [B, T, ...] padded by one position at the end of T if T is odd (its output is dropped).

    cuDNN's fused attention trains only on even lengths; the head sees T - 1 = 639 positions.
    """
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, x.shape[1] % 2)
    return jnp.pad(x, pad)


def _grouped_attention_with_extras(q, keys, values, causal, extra_keys, extra_values):
    """XLA reference of `causal_attention` with extras: one softmax over the causal keys and the extras."""
    batch, length, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    q = q.reshape(batch, length, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scale = 1.0 / math.sqrt(head_dim)
    scores0 = jnp.einsum("btkgh,bskh->bkgts", q, keys, preferred_element_type=jnp.float32) * scale
    scores0 = jnp.where(causal[None, None, None], scores0, attention_ops.MASK_VALUE)
    extra_k = jnp.stack(extra_keys, axis=-2)  # [B, T, K, J, H]
    extra_v = jnp.stack(extra_values, axis=-2)
    scores_e = jnp.einsum("btkgh,btkjh->bkgtj", q, extra_k, preferred_element_type=jnp.float32) * scale
    probs = jax.nn.softmax(jnp.concatenate([scores0, scores_e], axis=-1), axis=-1).astype(q.dtype)
    probs0, probs_e = probs[..., :length], probs[..., length:]
    out = jnp.einsum("bkgts,bskh->btkgh", probs0, values) + jnp.einsum("bkgtj,btkjh->btkgh", probs_e, extra_v)
    return out.reshape(batch, length, num_heads, head_dim)
