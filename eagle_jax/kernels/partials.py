"""A split attention's partial results and their log-sum-exp merge (flash decoding's second half).

Split over the cache (`decode_attention.Tiling.splits` = P > 1), the attention kernel leaves
each part's float32 online-softmax state unnormalised, laid out as attended is, part first:

  outputs [P, B, T, N, H], maxima and sums [P, B, T, N]

so that rows (b, t) flatten to the [P, M, N, H] and [P, M, N] whose one-head tiles a matmul
reads in its loop over input features: the o_proj kernel that follows (`fused_linear.merged_linear_residual`) merges its
tiles as it loads them, and no kernel of its own stands between attention and o_proj. `combine`
is that merge alone, for the calls whose o_proj is not fused. Both go through `merged_tile`,
so they round alike: each merged value is out / sum, cast to the computation's dtype.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

# Rows of one head a `combine` program merges.
_COMBINE_ROWS = 16


class Partials(NamedTuple):
    """P parts' float32 online-softmax states of attended [B, T, N, H]: unnormalised outputs
    [P, B, T, N, H], running maxima and sums [P, B, T, N]. A part that folded no slot holds the
    neutral state (max MASK_VALUE, sum 0, output 0)."""

    outputs: jax.Array
    maxima: jax.Array
    sums: jax.Array


def merge(state: tuple, partial: tuple) -> tuple:
    """The online-softmax state (max, sum, out) of two disjoint sets of slots from theirs, by
    log-sum-exp; max and sum broadcast against out. A neutral partial changes nothing: its weight
    is exp(MASK_VALUE - max) = 0, or 1 times a zero sum when both are neutral, so no NaN."""
    (maximum, total, out), (other_maximum, other_total, other_out) = state, partial
    new_maximum = jnp.maximum(maximum, other_maximum)
    correction, other_correction = jnp.exp(maximum - new_maximum), jnp.exp(other_maximum - new_maximum)
    return (new_maximum, total * correction + other_total * other_correction,
            out * correction + other_out * other_correction)


def merge_reference(partials: Partials, dtype) -> jax.Array:
    """attended [B, T, N, H] in dtype from the partials, in plain jnp (parts merged in order)."""
    state_of = lambda p: (partials.maxima[p][..., None], partials.sums[p][..., None], partials.outputs[p])
    state = state_of(0)
    for part in range(1, partials.outputs.shape[0]):
        state = merge(state, state_of(part))
    _, total, out = state
    return (out / total).astype(dtype)


def flat(partials: Partials) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(outputs [P, M, N, H], maxima [P, M, N], sums [P, M, N]) with M = B T: the refs
    `merged_tile` reads (reshapes of contiguous arrays, no copies)."""
    parts, batch, length, num_heads, head_dim = partials.outputs.shape
    rows = batch * length
    return (partials.outputs.reshape(parts, rows, num_heads, head_dim),
            partials.maxima.reshape(parts, rows, num_heads), partials.sums.reshape(parts, rows, num_heads))


def merged_tile(outputs_ref, maxima_ref, sums_ref, row, head, block_rows: int, dtype) -> jax.Array:
    """Inside a Pallas kernel: attended rows [row, row + block_rows) of one head, [block_rows, H']
    in dtype (H' = H padded to a power of two), merged from `flat`'s refs. One head a tile, so each
    row's max and sum are one value (a tile spanning heads would gather them per element: on the
    H200 such tiles overflowed shared memory once Triton pipelined them). Outside the arrays it
    reads zeros (a sum of 1 there keeps out / sum finite for the dot that may follow)."""
    head_dim = outputs_ref.shape[3]
    rows, columns = row + jnp.arange(block_rows), jnp.arange(pl.next_power_of_2(head_dim))
    real = rows < outputs_ref.shape[1]
    inside = real[:, None] & (columns < head_dim)[None, :]

    def part(index: int) -> tuple:
        index = jnp.int32(index)
        statistic = lambda ref, other: plgpu.load(ref.at[index, rows, head], mask=real, other=other)[:, None]
        out = plgpu.load(outputs_ref.at[index, rows[:, None], head, columns[None, :]], mask=inside, other=0.0)
        return statistic(maxima_ref, 0.0), statistic(sums_ref, 1.0), out

    state = part(0)
    for index in range(1, outputs_ref.shape[0]):  # P is small and static: unrolled
        state = merge(state, part(index))
    _, total, out = state
    return (out / total).astype(dtype)


def combine(partials: Partials, dtype, *, implementation: str = "pallas", interpret: bool | None = None) -> jax.Array:
    """attended [B, T, N, H] in dtype: the parts merged by one kernel (implementation "pallas"),
    or by `merge_reference` ("xla")."""
    if implementation == "xla":
        return merge_reference(partials, dtype)
    _, batch, length, num_heads, head_dim = partials.outputs.shape
    outputs, maxima, sums = flat(partials)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    rows = outputs.shape[1]
    attended = pl.pallas_call(
        _combine_kernel,
        out_shape=jax.ShapeDtypeStruct(outputs.shape[1:], dtype),
        grid=(pl.cdiv(rows, _COMBINE_ROWS), num_heads),
        compiler_params=plgpu.CompilerParams(),  # Triton's defaults: without them a GPU gets Mosaic GPU
        interpret=interpret,
        name="decode_attention_combine",
    )(outputs, maxima, sums)
    return attended.reshape(batch, length, num_heads, head_dim)


def _combine_kernel(outputs_ref, maxima_ref, sums_ref, out_ref):
    row, head = pl.program_id(0) * _COMBINE_ROWS, pl.program_id(1)
    merged = merged_tile(outputs_ref, maxima_ref, sums_ref, row, head, _COMBINE_ROWS, out_ref.dtype)
    rows, columns = row + jnp.arange(_COMBINE_ROWS), jnp.arange(merged.shape[1])
    inside = (rows < out_ref.shape[0])[:, None] & (columns < out_ref.shape[2])[None, :]
    plgpu.store(out_ref.at[rows[:, None], head, columns[None, :]], merged, mask=inside)
