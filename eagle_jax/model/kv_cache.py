"""The key/value cache: an immutable, statically shaped pytree passed through jit and donated."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from eagle_jax.kernels import compact_cache


@struct.dataclass
class KVCache:
    """Per-layer key and value buffers plus the committed length of each row.

    One array per layer (rather than one stacked array) so that each layer's update aliases
    its own donated buffer. Slots at or past `lengths[b]` hold stale or rejected entries that
    the next write overwrites; attention masks by position, so they are never read.

    Attributes:
        keys: per layer [B, S, K, H].
        values: per layer [B, S, K, H].
        lengths: [B] int32 committed tokens per row (the next write position).
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    lengths: jax.Array

    @property
    def max_length(self) -> int:
        return self.keys[0].shape[1]

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    @classmethod
    def create(cls, num_layers: int, batch_size: int, max_length: int, num_kv_heads: int, head_dim: int,
               dtype=jnp.float32) -> "KVCache":
        shape = (batch_size, max_length, num_kv_heads, head_dim)
        zeros = lambda: tuple(jnp.zeros(shape, dtype) for _ in range(num_layers))
        return cls(keys=zeros(), values=zeros(), lengths=jnp.zeros((batch_size,), jnp.int32))


def compact(cache: KVCache, start: jax.Array, sources: jax.Array, implementation: str = "xla") -> KVCache:
    """Moves, in every layer, the entry at slot start + sources[b, m] to slot start + m.

    After a tree verify the accepted path's keys and values sit at scattered node slots; the
    path must occupy consecutive slots from the committed length on, as if decoded one by one.
    All sources are read before anything is written, so overlapping moves are safe.

    Args:
        start: [B] int32 the committed length of each row.
        sources: [B, M] int32 offsets from `start` of the entries to keep, in their new order.
        implementation: "xla" (a gather and a write per buffer) or "pallas" (one kernel for all
            of them, `kernels.compact_cache`).
    """
    moved = compact_cache.compact(cache.keys + cache.values, start, sources, implementation=implementation)
    layers = len(cache.keys)
    return cache.replace(keys=moved[:layers], values=moved[layers:])
