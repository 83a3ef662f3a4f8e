"""A tree verify's cache compaction in every layer, in one kernel.

After an EAGLE-2 tree's verify, the accepted path's keys and values sit at scattered node slots,
and `kv_cache.compact` moves them to consecutive slots from the committed length. In XLA that is
a gather and a dynamic-update-slice per buffer: on SmolLM2, 30 layers x (keys, values) x 2 kernels,
~230 µs of a 1,700 µs tree step on an H200 (a `benchmarks/profile_step.py --tree 4,5,16` trace
recorded before 2026-12-01, commit 698a456: 143 update and 41 slice kernels a step, ~1.2 µs
each). Here one Pallas (Triton) call moves the path in all the buffers, in place
(`input_output_aliases`).

`implementation="xla"` is the reference (`kv_cache.compact`'s gather and write). `"pallas"`: a grid of
(rows B, kv heads K); a program owns one row and one kv head in every buffer. For each buffer it
loads the M path entries (M padded to a power of two, masked), waits at a barrier for all its
threads' loads, and then stores them: every read of a buffer precedes its writes, and no other
program touches that (row, kv head). Overlapping moves (a path entry moving onto a slot another
entry is read from) are therefore safe, as in the reference. The barrier is needed because the
tile is spread over several warps: a store's data dependence orders it after its own thread's
load only, and the H200 check of 2026-12-03 (`benchmarks/kernels_bench.py --check`, code of
commit b98f85f) found entries lost without it (max error 1.87 at 7 and 32 entries; exact at 1,
where nothing overlaps); with it, the same check (code of commit 66a7281) was exact at 1 to 32. The
caller keeps start + M within the cache (the engine's headroom); the kernel drops writes past
its end where the reference would clamp.
`interpret=None` runs the kernel in interpret mode unless the backend is a GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from eagle_jax.model import attention_ops

IMPLEMENTATIONS = ("xla", "pallas")


def compact(buffers: tuple[jax.Array, ...], start: jax.Array, sources: jax.Array, *, implementation: str = "xla",
            interpret: bool | None = None) -> tuple[jax.Array, ...]:
    """Moves, in every buffer [B, S, K, H], the entry at slot start + sources[b, m] to slot start + m.

    Args:
        buffers: the caches' key and value arrays, one per layer each, all of one shape.
        start: [B] int32 the committed length of each row.
        sources: [B, M] int32 offsets from `start` of the entries to keep, in their new order.
    Returns:
        the buffers, updated (donated in place by the Pallas kernel).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if implementation == "xla":
        slots = (start[:, None] + sources)[:, :, None, None]  # [B, M, 1, 1]
        return tuple(attention_ops.write_rows(b, jnp.take_along_axis(b, slots, axis=1), start) for b in buffers)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    batch, _, num_kv_heads, head_dim = buffers[0].shape
    shapes = tuple(jax.ShapeDtypeStruct(b.shape, b.dtype) for b in buffers)
    count = len(buffers)
    return pl.pallas_call(
        functools.partial(_kernel, count=count, barrier=not interpret),
        out_shape=shapes,
        grid=(batch, num_kv_heads),
        input_output_aliases={2 + i: i for i in range(count)},
        compiler_params=plgpu.CompilerParams(),  # Triton's defaults: without them a GPU gets Mosaic GPU
        interpret=interpret,
        name="compact_cache",
    )(start.astype(jnp.int32), sources.astype(jnp.int32), *buffers)


def _kernel(start_ref, sources_ref, *refs, count: int, barrier: bool):
    """One (row, kv head) of every buffer: refs are the `count` inputs, then their aliased outputs.
    `barrier` off in interpret mode, which runs a program's loads and stores in order (and has no
    rule for the barrier)."""
    row, kv_head = pl.program_id(0), pl.program_id(1)
    length, (cache_length, _, head_dim) = sources_ref.shape[1], refs[0].shape[1:]
    entries, columns = jnp.arange(pl.next_power_of_2(length)), jnp.arange(pl.next_power_of_2(head_dim))  # Triton's sizes
    real = entries < length
    start = start_ref[row]
    sources = start + plgpu.load(sources_ref.at[row, entries], mask=real, other=0)
    targets = start + entries
    read = (real & (sources < cache_length))[:, None] & (columns < head_dim)[None, :]
    written = (real & (targets < cache_length))[:, None] & (columns < head_dim)[None, :]
    for source, target in zip(refs[:count], refs[count:]):
        moved = plgpu.load(source.at[row, sources[:, None], kv_head, columns[None, :]], mask=read, other=0)
        # The tile's entries are spread over the program's threads: without a barrier, one warp
        # may store entry m onto the slot another warp has yet to load entry m' from.
        if barrier:
            plgpu.debug_barrier()
        plgpu.store(target.at[row, targets[:, None], kv_head, columns[None, :]], moved, mask=written)
