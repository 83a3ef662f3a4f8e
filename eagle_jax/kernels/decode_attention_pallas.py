"""The Pallas (Triton) kernels behind `decode_attention.attend(..., implementation="pallas")`.

One kernel does rotary, the cache write and grouped attention of a row's few new tokens, writing
the caches in place (`input_output_aliases`); with the cache split, a second kernel merges the
parts. `interpret=True` runs them in Pallas interpret mode, so CPU tests run the kernel code.

Kernel layout: a grid of (rows B, kv heads K x token blocks Q). A program owns T' of a row's T
tokens for the G = N / K query heads sharing its kv head: a block of M = T' G query rows, padded
to a power of two >= 16 (Triton's dot), as are the head dim and the T new keys (masked edges).
`Tiling.query_rows` = R bounds M before padding: Q = ceil(T / floor(R / G)) programs share the
row's tokens (T' = ceil(T / Q) each), each reading the (row, kv head)'s older slots itself. Without the bound a
chain verify of k = 5 (T = 6, G = 3: M = 18) pads to 32 rows, and the kernel took 26.5 us a layer
at 16 rows against 14.7 for k = 4's 15 rows padded to 16 (H200 step traces, docs/benchmarks.md).
With R = 16 (two blocks of 9 rows) the kernel alone runs 11.3 us at 16 rows against 14.2 padded,
and a k = 5 step at 64 rows spends 483 us in it against 779 (H200 step traces of 2026-12-02,
commit 3318908, `benchmarks/profile_step.py --parts step_trace`).
It
  1. rotates its queries in float32; Triton cannot slice registers, so the rotate-half partner
     of each element is loaded from memory with a permuted column index;
  2. streams the older slots [0, min(start, attend_length)) in `block_s` chunks through an
     online softmax (flash decoding: running max and sum in float32), start = positions[b, 0];
  3. rotates all T new keys, folds them in from registers, causally, and (token block 0 alone)
     stores them and the new values into its (row, kv head) of the caches.
Positions are contiguous from start and a position is its slot, so every query sees every
older slot and new key t' is visible to query t iff t' <= t. A tree's verify (`new_visible`)
keeps the layout, its T nodes written to slots start.. in node order, and only changes step 3's
mask: node t sees node t' iff t' is t or one of its ancestors (rotary reads the nodes' own
positions, start + depth; the root's is start). Taking the new keys from
registers and the older ones from below start means no load touches a slot any program
writes: no barrier, and no ordering of reads after writes to aliased memory, is needed. The
loop also ends at the row's own length, so a row never reads the slots past it.

Split over the cache (`Tiling.splits` = P > 1, flash decoding's split-K): at batch 1 the grid
above is K = 3 programs on a GPU of 132 SMs, each walking the whole filled cache alone. The
split kernel's grid is (B, K Q, P): program p folds chunks [p C / P, (p + 1) C / P) of the row's
C = cdiv(min(start, attend_length), block_s) older chunks (contiguous, chunk-aligned, sized by
the row's own length at run time), and only p == 0, whose range floor division makes the
shortest, also does step 3. Each writes its float32 online-softmax state as a partial,
unnormalised (a range with no chunks leaves the neutral state: max MASK_VALUE, sum 0):

  outputs [B, K Q, P, M', H'], maxima and sums [B, K Q, P, M'] (M', H': M and H padded)

and a second kernel, grid (B, K Q), merges the P partials of its (row, kv head, token block) by
log-sum-exp into attended. The no-overlap rule above holds across parts and token blocks too:
all of them read below start, and only p == 0 of token block 0 writes, at start and past it.
"""

from __future__ import annotations

import functools
import math
import typing

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from eagle_jax.model import attention_ops

if typing.TYPE_CHECKING:  # for annotations only: decode_attention imports this module
    from eagle_jax.kernels import decode_attention


def _block(size: int) -> int:
    """The Triton block holding `size` elements: a power of two, >= 16 for dot."""
    return max(16, pl.next_power_of_2(size))


def _load(ref, index: tuple, mask: jax.Array) -> jax.Array:
    """ref[index] gathered (index: broadcastable int arrays, one per dimension), zeros where not mask."""
    return plgpu.load(ref.at[index], mask=mask, other=0)


def _rotated(heads_ref, frequencies_ref, row, tokens, head, positions, mask) -> jax.Array:
    """Rotate-half rotary of heads[row, tokens, head] [M, H'] at positions [M], in float32.

    `rotary.apply_rotary` with its concatenations done by indexing: element h pairs with
    h + H/2 (negated) in the first half and with h - H/2 in the second.
    """
    size = heads_ref.shape[-1]  # H
    columns = jnp.arange(_block(size))
    first_half = columns < size // 2
    partner = jnp.where(first_half, columns + size // 2, columns - size // 2)
    mask = mask[:, None] & (columns < size)[None, :]
    x = _load(heads_ref, (row, tokens[:, None], head[:, None], columns[None, :]), mask).astype(jnp.float32)
    rotated = _load(heads_ref, (row, tokens[:, None], head[:, None], partner[None, :]), mask).astype(jnp.float32)
    rotated = jnp.where(first_half[None, :], -rotated, rotated)
    frequencies = _load(frequencies_ref, (columns,), columns < size)
    angles = positions.astype(jnp.float32)[:, None] * frequencies[None, :]  # [M, H']
    return x * jnp.cos(angles) + rotated * jnp.sin(angles)


def _scores(q: jax.Array, keys: jax.Array, visible: jax.Array, head_dim: int) -> jax.Array:
    """[M, C] float32 scores of q [M, H'] against keys [C, H'] over sqrt(H), MASK_VALUE where not visible."""
    scores = lax.dot_general(q, keys, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return jnp.where(visible, scores / math.sqrt(head_dim), attention_ops.MASK_VALUE)


def _fold(state: tuple, scores: jax.Array, values: jax.Array) -> tuple:
    """One online-softmax step: state (max [M], sum [M], unnormalised output [M, H']) after scores
    [M, C] and their values [C, H']. Masked scores are finite, so no step makes a NaN."""
    maximum, total, out = state
    new_maximum = jnp.maximum(maximum, jnp.max(scores, axis=1))
    correction = jnp.exp(maximum - new_maximum)
    probs = jnp.exp(scores - new_maximum[:, None])
    out = out * correction[:, None] + jnp.dot(probs.astype(values.dtype), values, preferred_element_type=jnp.float32)
    return new_maximum, total * correction + jnp.sum(probs, axis=1), out


def _query_rows(length: int, group: int, kv_head, per_block: int, token_block) -> tuple:
    """Block rows of a (row, kv head, token block): block row r is token token_block T' + r // G
    (T' = per_block) of query head kv_head G + r % G. Returns (rows, tokens, query heads, real:
    not padding), each [M']."""
    rows = jnp.arange(_block(per_block * group))
    tokens = token_block * per_block + rows // group
    return rows, tokens, kv_head * group + rows % group, (rows // group < per_block) & (tokens < length)


def _store_attended(out_ref, row, tokens, query_heads, real, state: tuple) -> None:
    """The normalised output of a final online-softmax state into out_ref [B, T, N, H]."""
    _, total, out = state
    columns = jnp.arange(out.shape[1])
    mask = real[:, None] & (columns < out_ref.shape[3])[None, :]
    plgpu.store(out_ref.at[row, tokens[:, None], query_heads[:, None], columns[None, :]],
                (out / total[:, None]).astype(out_ref.dtype), mask=mask)


def _merge(state: tuple, partial: tuple) -> tuple:
    """The online-softmax state of two disjoint sets of slots from theirs (log-sum-exp). A neutral
    partial (MASK_VALUE, 0, 0) changes nothing: its weight is exp(MASK_VALUE - max) = 0, or 1
    times a zero sum when both are neutral, so no step makes a NaN."""
    (maximum, total, out), (other_maximum, other_total, other_out) = state, partial
    new_maximum = jnp.maximum(maximum, other_maximum)
    correction, other_correction = jnp.exp(maximum - new_maximum), jnp.exp(other_maximum - new_maximum)
    return (new_maximum, total * correction + other_total * other_correction,
            out * correction[:, None] + other_out * other_correction[:, None])


def attention_call(heads, positions, keys, values, num_heads: int, inv_freq: np.ndarray, read: int,
                   tiling: decode_attention.Tiling, interpret: bool, new_visible=None):
    """The attention kernel on heads [B, T, N + 2K, H] (qkv_proj's output, viewed by head):
    (attended, keys, values) with splits 1, else (outputs, keys, values, maxima, sums) with the
    float32 partials laid out as the module docstring says, for `combine_call` to merge."""
    frequencies = jnp.asarray(np.concatenate([inv_freq, inv_freq]), jnp.float32)  # [H]: h turns at inv_freq[h % H/2]
    tree = () if new_visible is None else (new_visible.astype(jnp.int32),)  # Triton loads no bools
    return _attention_call(positions.astype(jnp.int32), frequencies, heads, keys, values, *tree, num_heads=num_heads,
                           read=read, tiling=tiling, interpret=interpret)


# Jitted with the settings static, as `fused_linear._pallas_call` is and for its reason: the calls
# of one shape and setting are traced once and lowered to Triton once per program, not once a layer.
@functools.partial(jax.jit, static_argnames=("num_heads", "read", "tiling", "interpret"))
def _attention_call(positions, frequencies, heads, keys, values, *tree, num_heads: int, read: int,
                    tiling: decode_attention.Tiling, interpret: bool):
    batch, length, _, head_dim = heads.shape
    num_kv_heads = keys.shape[2]
    per_block, blocks = tiling.token_blocks(length, num_heads // num_kv_heads)
    caches = (jax.ShapeDtypeStruct(keys.shape, keys.dtype), jax.ShapeDtypeStruct(values.shape, values.dtype))
    if tiling.splits == 1:
        grid = (batch, num_kv_heads * blocks)
        out_shape = (jax.ShapeDtypeStruct((batch, length, num_heads, head_dim), heads.dtype), *caches)
    else:
        grid = (batch, num_kv_heads * blocks, tiling.splits)
        statistics = (*grid, _block(per_block * num_heads // num_kv_heads))  # [B, K Q, P, M']
        out_shape = (jax.ShapeDtypeStruct((*statistics, _block(head_dim)), jnp.float32), *caches,
                     jax.ShapeDtypeStruct(statistics, jnp.float32), jax.ShapeDtypeStruct(statistics, jnp.float32))
    return pl.pallas_call(
        functools.partial(_kernel, num_heads=num_heads, read=read, tiling=tiling, per_block=per_block,
                          blocks=blocks, tree=bool(tree)),
        out_shape=out_shape,
        grid=grid,
        input_output_aliases={3: 1, 4: 2},  # the caches, updated in place
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        interpret=interpret,
        name="decode_attention",
    )(positions, frequencies, heads, keys, values, *tree)


@functools.partial(jax.jit, static_argnames=("batch_length", "num_heads", "num_kv_heads", "head_dim", "dtype",
                                             "interpret", "tiling"))
def combine_call(outputs, maxima, sums, batch_length: tuple, num_heads: int, num_kv_heads: int, head_dim: int, dtype,
                 interpret: bool, tiling: decode_attention.Tiling):
    """attended [B, T, N, H] (batch_length: (B, T)) from the split kernel's partials: one program
    per (row, kv head, token block)."""
    group = num_heads // num_kv_heads
    per_block, blocks = tiling.token_blocks(batch_length[1], group)
    return pl.pallas_call(
        functools.partial(_combine_kernel, group=group, per_block=per_block, blocks=blocks),
        out_shape=jax.ShapeDtypeStruct((*batch_length, num_heads, head_dim), dtype),
        grid=outputs.shape[:2],
        compiler_params=plgpu.CompilerParams(),  # Triton's defaults: without them a GPU gets Mosaic GPU
        interpret=interpret,
        name="decode_attention_combine",
    )(outputs, maxima, sums)


def _kernel(positions_ref, frequencies_ref, heads_ref, keys_ref, values_ref, *refs, num_heads: int, read: int,
            tiling: decode_attention.Tiling, per_block: int, blocks: int, tree: bool):
    """One (row, kv head, token block[, part]): heads_ref [B, T, N + 2K, H]; caches [B, S, K, H];
    with `tree`, new_visible [B, T, T] int32 first in refs; then out_ref [B, T, N, H], or with
    splits > 1 the partial outputs, and the caches out, then the statistics (maxima, sums)."""
    new_visible_ref, refs = (refs[0], refs[1:]) if tree else (None, refs)
    out_ref, keys_out_ref, values_out_ref, *statistics_refs = refs
    row, kv_head, token_block = pl.program_id(0), pl.program_id(1) // blocks, pl.program_id(1) % blocks
    length = heads_ref.shape[1]
    cache_length, num_kv_heads, head_dim = keys_ref.shape[1:]
    group, dtype = num_heads // num_kv_heads, heads_ref.dtype
    columns = jnp.arange(_block(head_dim))
    in_head = (columns < head_dim)[None, :]

    rows, tokens, query_heads, real = _query_rows(length, group, kv_head, per_block, token_block)
    query_positions = _load(positions_ref, (row, tokens), real)
    q = _rotated(heads_ref, frequencies_ref, row, tokens, query_heads, query_positions, real).astype(dtype)
    start = positions_ref[row, jnp.int32(0)]

    # The older slots, all visible to every query: [0, start), and of those only the ones read.
    older = jnp.minimum(start, read)

    def chunk(index, state):
        chunk_slots = index * tiling.block_s + jnp.arange(tiling.block_s)
        keep = chunk_slots < older
        chunk_index, mask = (row, chunk_slots[:, None], kv_head, columns[None, :]), keep[:, None] & in_head
        chunk_keys = _load(keys_ref, chunk_index, mask).astype(dtype)
        chunk_values = _load(values_ref, chunk_index, mask).astype(dtype)
        return _fold(state, _scores(q, chunk_keys, keep[None, :], head_dim), chunk_values)

    def new_tokens(state):
        """The new keys and values folded in, rounded as the reference reads them back; token block 0
        also writes them into the cache (every block needs them all, as its queries' causal past)."""
        new = jnp.arange(_block(length))
        is_new = new < length
        key_head = jnp.broadcast_to(num_heads + kv_head, new.shape)
        keys = _rotated(heads_ref, frequencies_ref, row, new, key_head, _load(positions_ref, (row, new), is_new),
                        is_new)
        values = _load(heads_ref, (row, new[:, None], key_head[:, None] + num_kv_heads, columns[None, :]),
                       is_new[:, None] & in_head)
        slots = start + new
        cache_index = (row, slots[:, None], kv_head, columns[None, :])
        written = (is_new & (slots < cache_length) & (token_block == 0))[:, None] & in_head
        plgpu.store(keys_out_ref.at[cache_index], keys.astype(dtype).astype(keys_out_ref.dtype), mask=written)
        plgpu.store(values_out_ref.at[cache_index], values.astype(values_out_ref.dtype), mask=written)
        keys = keys.astype(dtype).astype(keys_out_ref.dtype).astype(dtype)
        values = values.astype(values_out_ref.dtype).astype(dtype)
        if tree:  # the query's ancestors among the new tokens, itself included
            among = _load(new_visible_ref, (row, tokens[:, None], new[None, :]), real[:, None] & is_new[None, :]) != 0
        else:  # causal: positions are slots
            among = slots[None, :] <= query_positions[:, None]
        visible = among & (is_new & (slots < read))[None, :]
        return _fold(state, _scores(q, keys, visible, head_dim), values)

    # Every chunk of a range holds a slot below `older`, so its max is finite after the first:
    # masked slots weigh exp(MASK_VALUE - max) = 0. A range of no chunks keeps the neutral state.
    state = (jnp.full(rows.shape, attention_ops.MASK_VALUE, jnp.float32), jnp.zeros(rows.shape, jnp.float32),
             jnp.zeros((rows.size, columns.size), jnp.float32))
    chunks = pl.cdiv(older, tiling.block_s)
    if tiling.splits == 1:
        state = new_tokens(lax.fori_loop(0, chunks, chunk, state))
        _store_attended(out_ref, row, tokens, query_heads, real, state)
        return
    part = pl.program_id(2)
    # Floor division spreads the chunks evenly with the remainders last: part 0's range is the
    # shortest, so it takes the new tokens (and the cache write) too.
    first, last = lax.div(part * chunks, tiling.splits), lax.div((part + 1) * chunks, tiling.splits)
    state = lax.fori_loop(first, last, chunk, state)
    maximum, total, out = lax.cond(part == 0, new_tokens, lambda state: state, state)
    maxima_ref, sums_ref = statistics_refs
    program = pl.program_id(1)  # kv head x token blocks
    plgpu.store(maxima_ref.at[row, program, part, rows], maximum)
    plgpu.store(sums_ref.at[row, program, part, rows], total)
    plgpu.store(out_ref.at[row, program, part, rows[:, None], columns[None, :]], out)


def _combine_kernel(outputs_ref, maxima_ref, sums_ref, out_ref, *, group: int, per_block: int, blocks: int):
    """One (row, kv head, token block): its P partials (outputs [B, K Q, P, M', H'], maxima and
    sums [B, K Q, P, M']) merged into out_ref [B, T, N, H]."""
    row, program = pl.program_id(0), pl.program_id(1)
    splits, block_rows, block_columns = outputs_ref.shape[2:]
    rows, columns = jnp.arange(block_rows), jnp.arange(block_columns)

    def partial(part: int) -> tuple:
        part = jnp.int32(part)
        return (plgpu.load(maxima_ref.at[row, program, part, rows]), plgpu.load(sums_ref.at[row, program, part, rows]),
                plgpu.load(outputs_ref.at[row, program, part, rows[:, None], columns[None, :]]))

    state = partial(0)
    for part in range(1, splits):  # P is small and static: unrolled
        state = _merge(state, partial(part))
    _, tokens, query_heads, real = _query_rows(out_ref.shape[1], group, program // blocks, per_block, program % blocks)
    _store_attended(out_ref, row, tokens, query_heads, real, state)
