"""Decode attention in one kernel: rotary, KV cache write and grouped attention of a few new tokens.

Between qkv_proj and o_proj a cached decode call (plain decoding, or a chain's verify: T <= 16
tokens a row) runs ~8 XLA kernels a layer: rotary on q and k, the two cache writes, scores,
mask, softmax max and sum, probs @ values. `attend` is all of them:

  qkv [B, T, (N + 2K) H] (qkv_proj's output), caches [B, S, K, H]
      -> attended [B, T, N, H], the caches with the T new keys and values written at positions[:, 0]

`implementation="xla"` is the reference: what `layers.Attention.split_heads` and `.attend`
compute without a `SlotMask`. `"pallas"` is one Triton kernel (GPU; two with a split, below)
that writes the caches in place (`input_output_aliases`); `interpret=None` runs it in Pallas interpret mode unless the
default backend is a GPU, so CPU tests run the kernel code.

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

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from eagle_jax.model import attention_ops

IMPLEMENTATIONS = ("xla", "pallas")
# The most tokens a row sends to the kernel: decode steps, chain verifies, and tree verifies of up
# to 31 drafted nodes and their root (SGLang's --speculative-num-draft-tokens 16 or 31).
MAX_TOKENS = 32


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static block size and Triton launch settings of the Pallas kernel.

    The defaults are `for_rows`'s choice past 8 rows; they were the fastest of the H200 sweep in
    docs/results/kernels_h200.json (rows of 2026-11-30, 1,024-slot cache, 512 filled): 9.79 us at 1
    row and 10.46 at 4, against 11.94 and 12.40 for the former 64 / 4 / 2 and 15-20 us with 2
    warps. That sweep read a cache left in L2 by the call before; in a decode step every layer's
    weights pass between two calls of one layer's kernel. On an H200 on 2026-12-02 (code of
    commit 0f25797, `benchmarks/kernels_bench.py --evict-mb 0,256` and step traces) the
    defaults took 10.6 us alone at k = 6's verify (7 tokens), 11.3 with L2 evicted and 15.9 a
    layer inside a step; at a 17-node tree's, 13.6, 22.3 and 30.8. Only the trees' gap is mostly
    L2's. In the step traces of commit 7b8de89 (H200, 2026-12-02) `FEW_ROWS` took 6.8 us a layer
    at k = 6 (5.1 for the kernel, 1.7 for the split's merge) and 11.8 at the tree.

    Attributes:
        block_s: cache slots per chunk of the online softmax (Triton's dot needs >= 16).
        num_warps: Triton warps per program.
        num_stages: Triton software-pipelining depth of the chunk loop (cache loads in flight).
        splits: programs sharing one (row, kv head)'s older slots, merged by a second kernel;
            1 is the single kernel (the default past 8 rows; up to 8 rows split in
            4: `for_rows`).
        query_rows: the most query rows (tokens x G heads, before padding) one program holds;
            a row's tokens beyond it are shared out over several programs (token blocks).
            None: one program holds all of a (row, kv head)'s T G rows. 16, Triton's smallest
            dot block: at SmolLM2's G = 3 a chain's verify of k >= 5 runs as ceil((k + 1) / 5)
            blocks of 16 rows, not one of 32 or 64.
    """

    block_s: int = 128
    num_warps: int = 4
    num_stages: int = 3
    splits: int = 1
    query_rows: int | None = 16

    def __post_init__(self):
        if self.block_s < 16 or self.block_s & (self.block_s - 1):
            raise ValueError(f"block_s must be a power of two >= 16 (Triton's dot), got {self.block_s}")
        if self.splits < 1:
            raise ValueError(f"splits must be >= 1, got {self.splits}")
        if self.query_rows is not None and self.query_rows < 1:
            raise ValueError(f"query_rows must be >= 1 or None, got {self.query_rows}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1):
            raise ValueError(f"num_warps must be a power of two, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")

    @classmethod
    def for_rows(cls, rows: int) -> Tiling:
        """The tiling `attend` runs for a batch of `rows` rows when it is given none.

        Up to 8 rows: 256-slot chunks, 8 warps, the cache split in 4 (`FEW_ROWS`). With L2
        evicted between calls (256 MB written first, `kernels_bench.py --evict-mb`), the H200
        sweeps of 2026-12-02 (commits 56eae0b and 7b8de89; 1,024-slot cache, block_s 128 or
        256 x 4 or 8 warps x 1 or 4 splits) measured it fastest at 1, 4 and 8 rows, one token or
        a verify's: 6.42 us for one token at 1 row against the class defaults' 10.74, 6.54
        against 11.30 for a k = 6 verify, 9.41 against 22.30 for a 17-node tree; 7.65 against
        11.72 at 4 rows, 7.89 against 11.85 at 8. Eight warps keep more cache loads in flight,
        and the split turns 3 programs a row (one a kv head) into 12. End to end (MT-Bench
        80 x 256, EAGLE-3, `benchmarks/eagle.py`, commit 7b8de89): 2,525 and 2,621 tokens/s at
        batch 1, k = 6, against 2,164 for the defaults; plain decoding 1,170 against 942;
        continuous, k = 4, 320 prompts: 6,904 at 4 rows against 5,749 and 6,150, 12,074 at 8
        against 12,037 and 12,076.
        Past 8 rows the class defaults: at 64 rows they were fastest alone (16.3 us against
        27.9 for `FEW_ROWS`); at 16 rows 256/8/3/1 led alone (10.5 against 12.5) but ran 19,730
        tokens/s end to end against the defaults' 21,508.
        """
        return FEW_ROWS if rows <= 8 else cls()

    @classmethod
    def parse(cls, text: str) -> Tiling:
        """"block_s/num_warps/num_stages/splits[/query_rows]" (kernels_bench's column; query_rows
        "none" for no bound) as a Tiling, for command lines."""
        fields = text.split("/")
        if not 4 <= len(fields) <= 5:
            raise ValueError(f"a tiling is block_s/num_warps/num_stages/splits[/query_rows], got {text!r}")
        try:
            numbers = [None if f.lower() == "none" and i == 4 else int(f) for i, f in enumerate(fields)]
        except ValueError:
            raise ValueError(f"a tiling's fields are integers (query_rows may be none), got {text!r}") from None
        return cls(*numbers)

    def __str__(self) -> str:
        return "/".join(str(getattr(self, f.name)).lower() for f in dataclasses.fields(self))

    def token_blocks(self, length: int, group: int) -> tuple[int, int]:
        """(tokens a program holds T', programs Q sharing a row's `length` tokens) for `group`
        query heads a kv head: the fewest blocks within query_rows, evened out (none is empty)."""
        if self.query_rows is None:
            return length, 1
        blocks = -(-length // max(1, self.query_rows // group))
        return -(-length // blocks), blocks


FEW_ROWS = Tiling(block_s=256, num_warps=8, splits=4)  # `Tiling.for_rows` up to 8 rows


def attend(qkv: jax.Array, positions: jax.Array, keys: jax.Array, values: jax.Array, *, num_heads: int,
           num_kv_heads: int, head_dim: int, inv_freq: np.ndarray, attend_length: int | None = None,
           implementation: str = "xla", interpret: bool | None = None, tiling: Tiling | None = None,
           new_visible: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Rotary on q and k, the new keys and values written into the cache, then causal (or tree) attention.

    Args:
        qkv: [B, T, (N + 2K) H] `qkv_proj` output: N query heads, then K key heads, then K value heads.
        positions: [B, T] int32 positions, contiguous per row; position p lives in cache slot p
            and sees slots <= p. With new_visible, any positions (rotary's) whose first is the
            row's write slot: token t is written to slot positions[:, 0] + t.
        keys, values: [B, S, K, H] the layer's cache. positions[:, 0] + T <= S: the writes are
            not clamped into the cache as `lax.dynamic_update_slice` clamps them.
        num_heads, num_kv_heads, head_dim: N, K and H.
        inv_freq: [H/2] rotary inverse frequencies (`layers.rope_inverse_frequencies`).
        attend_length: read only cache slots [0, attend_length) (None: all S); every visible
            slot must lie below it.
        implementation: "xla" (reference) or "pallas".
        interpret: run the Pallas kernel in interpret mode; None: unless the backend is a GPU.
        tiling: the Pallas kernel's block size, launch settings and split over the cache;
            None: `Tiling.for_rows(B)`.
        new_visible: [B, T, T] bool, which new tokens each one sees (a tree's ancestors, itself
            included), in place of causal order; every older slot stays visible to every token.
    Returns:
        (attended [B, T, N, H] in qkv's dtype, updated keys, updated values).
    """
    batch, length, width = qkv.shape
    cache_length = keys.shape[1]
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {implementation!r} ({', '.join(IMPLEMENTATIONS)})")
    if width != (num_heads + 2 * num_kv_heads) * head_dim or num_heads % num_kv_heads:
        raise ValueError(f"qkv width {width} does not hold {num_heads} + 2 x {num_kv_heads} heads of {head_dim}")
    if keys.shape != (batch, cache_length, num_kv_heads, head_dim) or values.shape != keys.shape:
        raise ValueError(f"caches {keys.shape}, {values.shape} do not fit qkv {qkv.shape}")
    read = cache_length if attend_length is None else attend_length
    if not 0 < read <= cache_length:
        raise ValueError(f"attend_length must be in 1..{cache_length}, got {attend_length}")
    heads = qkv.reshape(batch, length, num_heads + 2 * num_kv_heads, head_dim)  # a bitcast: no copy
    if new_visible is not None and new_visible.shape != (batch, length, length):
        raise ValueError(f"new_visible must be [B, T, T] = {(batch, length, length)}, got {new_visible.shape}")
    if implementation == "xla":
        return _reference(heads, positions, keys, values, num_heads, inv_freq, read, new_visible)
    if length > MAX_TOKENS:
        raise ValueError(f"the Pallas kernel takes at most {MAX_TOKENS} tokens a row, got {length}")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    tiling = Tiling.for_rows(batch) if tiling is None else tiling
    results = _attention_call(heads, positions, keys, values, num_heads, inv_freq, read, tiling, interpret,
                              new_visible)
    if tiling.splits == 1:
        return results
    outputs, keys, values, maxima, sums = results
    attended = _combine_call(outputs, maxima, sums, (batch, length), num_heads, num_kv_heads, head_dim, qkv.dtype,
                             interpret, tiling)
    return attended, keys, values


def _reference(heads, positions, keys, values, num_heads: int, inv_freq: np.ndarray, read: int, new_visible=None):
    """The XLA path of `attend` from heads [B, T, N + 2K, H]: `layers.Attention.split_heads` and
    `.attend` (with new_visible: under a tree's SlotMask), in the same `attention_ops` functions."""
    num_kv_heads = keys.shape[2]
    rotate = lambda x: attention_ops.apply_rotary(x, positions, inv_freq)
    q, k = rotate(heads[:, :, :num_heads]), rotate(heads[:, :, num_heads:num_heads + num_kv_heads])
    start = positions[:, 0]
    keys = attention_ops.write_rows(keys, k, start)
    values = attention_ops.write_rows(values, heads[:, :, num_heads + num_kv_heads:], start)
    if new_visible is None:
        visible = jnp.arange(read, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]  # [B, T, read]
    else:
        visible = attention_ops.visible_slots(start, new_visible, read)
    return attention_ops.grouped_attention(q, keys[:, :read], values[:, :read], visible), keys, values


# ---- the Pallas kernel ---------------------------------------------------------------------

def _block(size: int) -> int:
    """The Triton block holding `size` elements: a power of two, >= 16 for dot."""
    return max(16, pl.next_power_of_2(size))


def _load(ref, index: tuple, mask: jax.Array) -> jax.Array:
    """ref[index] gathered (index: broadcastable int arrays, one per dimension), zeros where not mask."""
    return plgpu.load(ref.at[index], mask=mask, other=0)


def _rotated(heads_ref, frequencies_ref, row, tokens, head, positions, mask) -> jax.Array:
    """Rotate-half rotary of heads[row, tokens, head] [M, H'] at positions [M], in float32.

    `attention_ops.apply_rotary` with its concatenations done by indexing: element h pairs with
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


def _attention_call(heads, positions, keys, values, num_heads: int, inv_freq: np.ndarray, read: int, tiling: Tiling,
                    interpret: bool, new_visible=None):
    """The attention kernel: (attended, keys, values) with splits 1, else (outputs, keys, values,
    maxima, sums) with the float32 partials laid out as the module docstring says."""
    batch, length, _, head_dim = heads.shape
    num_kv_heads = keys.shape[2]
    per_block, blocks = tiling.token_blocks(length, num_heads // num_kv_heads)
    frequencies = jnp.asarray(np.concatenate([inv_freq, inv_freq]), jnp.float32)  # [H]: h turns at inv_freq[h % H/2]
    caches = (jax.ShapeDtypeStruct(keys.shape, keys.dtype), jax.ShapeDtypeStruct(values.shape, values.dtype))
    if tiling.splits == 1:
        grid = (batch, num_kv_heads * blocks)
        out_shape = (jax.ShapeDtypeStruct((batch, length, num_heads, head_dim), heads.dtype), *caches)
    else:
        grid = (batch, num_kv_heads * blocks, tiling.splits)
        statistics = (*grid, _block(per_block * num_heads // num_kv_heads))  # [B, K Q, P, M']
        out_shape = (jax.ShapeDtypeStruct((*statistics, _block(head_dim)), jnp.float32), *caches,
                     jax.ShapeDtypeStruct(statistics, jnp.float32), jax.ShapeDtypeStruct(statistics, jnp.float32))
    tree = () if new_visible is None else (new_visible.astype(jnp.int32),)  # Triton loads no bools
    return pl.pallas_call(
        functools.partial(_kernel, num_heads=num_heads, read=read, tiling=tiling, per_block=per_block,
                          blocks=blocks, tree=bool(tree)),
        out_shape=out_shape,
        grid=grid,
        input_output_aliases={3: 1, 4: 2},  # the caches, updated in place
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        interpret=interpret,
        name="decode_attention",
    )(positions.astype(jnp.int32), frequencies, heads, keys, values, *tree)


def _combine_call(outputs, maxima, sums, batch_length: tuple, num_heads: int, num_kv_heads: int, head_dim: int, dtype,
                  interpret: bool, tiling: Tiling):
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
            tiling: Tiling, per_block: int, blocks: int, tree: bool):
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
