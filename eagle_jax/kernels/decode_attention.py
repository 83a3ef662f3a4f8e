"""Decode attention in one kernel: rotary, KV cache write and grouped attention of a few new tokens.

Between qkv_proj and o_proj a cached decode call (plain decoding, or a chain's verify: T <= 16
tokens a row) runs ~8 XLA kernels a layer: rotary on q and k, the two cache writes, scores,
mask, softmax max and sum, probs @ values. `attend` is all of them:

  qkv [B, T, (N + 2K) H] (qkv_proj's output), caches [B, S, K, H]
      -> attended [B, T, N, H], the caches with the T new keys and values written at positions[:, 0]

`implementation="xla"` is the reference: what `layers.Attention.split_heads` and `.attend`
compute without a `SlotMask`. `"pallas"` is one Triton kernel (GPU; two with the cache split, `Tiling.splits`)
that writes the caches in place (`input_output_aliases`); `interpret=None` runs it in Pallas
interpret mode unless the default backend is a GPU, so CPU tests run the kernel code.

The kernels, their grid and why no program reads what another writes are
`decode_attention_pallas`'s; this module holds what callers use: `attend`, its XLA reference and
the kernels' `Tiling`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.kernels import decode_attention_pallas
from eagle_jax.model import attention_ops
from eagle_jax.model import rotary

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
        inv_freq: [H/2] rotary inverse frequencies (`rotary.rope_inverse_frequencies`).
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
    results = decode_attention_pallas.attention_call(heads, positions, keys, values, num_heads, inv_freq, read, tiling,
                                                     interpret, new_visible)
    if tiling.splits == 1:
        return results
    outputs, keys, values, maxima, sums = results
    attended = decode_attention_pallas.combine_call(outputs, maxima, sums, (batch, length), num_heads, num_kv_heads,
                                                    head_dim, qkv.dtype, interpret, tiling)
    return attended, keys, values


def _reference(heads, positions, keys, values, num_heads: int, inv_freq: np.ndarray, read: int, new_visible=None):
    """The XLA path of `attend` from heads [B, T, N + 2K, H]: `layers.Attention.split_heads` and
    `.attend` (with new_visible: under a tree's SlotMask), in the same `rotary` and `attention_ops`
    functions."""
    num_kv_heads = keys.shape[2]
    rotate = lambda x: rotary.apply_rotary(x, positions, inv_freq)
    q, k = rotate(heads[:, :, :num_heads]), rotate(heads[:, :, num_heads:num_heads + num_kv_heads])
    start = positions[:, 0]
    keys = attention_ops.write_rows(keys, k, start)
    values = attention_ops.write_rows(values, heads[:, :, num_heads + num_kv_heads:], start)
    if new_visible is None:
        visible = jnp.arange(read, dtype=jnp.int32)[None, None, :] <= positions[:, :, None]  # [B, T, read]
    else:
        visible = attention_ops.visible_slots(start, new_visible, read)
    return attention_ops.grouped_attention(q, keys[:, :read], values[:, :read], visible), keys, values
