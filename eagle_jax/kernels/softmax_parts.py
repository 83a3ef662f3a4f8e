"""Attention left as the partial results of a split softmax, for the next kernel to merge.

Flash decoding splits a row's cache into P ranges, each folded by its own program into an online
softmax state: the running maximum m_p, the sum s_p of exp(score - m_p) and the unnormalised
output o_p. The attended value of a query head is their log-sum-exp merge,

    attended = sum_p exp(m_p - m) o_p / sum_p exp(m_p - m) s_p,    m = max_p m_p,

which `decode_attention.attend` leaves undone when asked (`merged=False`), so that o_proj's
kernel (`fused_linear.linear_parts`) merges the heads it reads as it loads them instead of a
kernel of its own writing them out first.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SoftmaxParts:
    """P split-softmax partials of attention over [..., N query heads, H].

    Attributes:
        outputs: [P, ..., N, H] float32 unnormalised outputs o_p.
        maxima: [P, ..., N] float32 running maxima m_p.
        sums: [P, ..., N] float32 sums s_p.
        dtype: the attended values' dtype (what the merge rounds to).
    """

    outputs: jax.Array
    maxima: jax.Array
    sums: jax.Array
    dtype: jnp.dtype = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        """The merged attention's shape, [..., N, H]."""
        return self.outputs.shape[1:]

    def merged(self) -> jax.Array:
        """The attended values [..., N, H] in dtype: the merge above, in XLA."""
        top = jnp.max(self.maxima, axis=0)
        weights = jnp.exp(self.maxima - top)  # [P, ..., N]
        total = jnp.sum(weights * self.sums, axis=0)
        return (jnp.sum(weights[..., None] * self.outputs, axis=0) / total[..., None]).astype(self.dtype)
