"""The one-kernel tree compaction (`kernels.compact_cache`) against its XLA reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from eagle_jax.model import kv_cache as kv_cache_lib
from eagle_jax.kernels import compact_cache

# Two rows with different committed lengths; each path's offsets rise (pool order), and entries
# move onto slots that other entries of the same path are read from.
START = np.array([5, 11], np.int32)
SOURCES = np.array([[0, 1, 3, 6, 7, 9], [0, 2, 3, 4, 8, 12]], np.int32)


def buffers(count: int, head_dim: int, dtype, seed: int = 0) -> tuple[jax.Array, ...]:
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((2, 32, 3, head_dim)), dtype) for _ in range(count))


@pytest.mark.parametrize("head_dim, dtype", [(64, jnp.bfloat16), (48, jnp.float32)])
def test_pallas_moves_what_xla_moves(head_dim, dtype):
    start, sources = jnp.asarray(START), jnp.asarray(SOURCES)
    before = buffers(4, head_dim, dtype)
    expected = compact_cache.compact(before, start, sources, implementation="xla")
    moved = compact_cache.compact(before, start, sources, implementation="pallas")
    for got, want, old in zip(moved, expected, before):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        # The reference itself: the path at start.., every other slot untouched.
        for row in range(2):
            slots = START[row] + SOURCES[row]
            np.testing.assert_array_equal(np.asarray(want[row, START[row]:START[row] + 6]), np.asarray(old[row, slots]))
            untouched = np.ones(32, bool)
            untouched[START[row]:START[row] + 6] = False
            np.testing.assert_array_equal(np.asarray(want[row, untouched]), np.asarray(old[row, untouched]))


def test_the_cache_compacts_keys_and_values_of_every_layer():
    keys, values = buffers(3, 64, jnp.float32, seed=1), buffers(3, 64, jnp.float32, seed=2)
    cache = kv_cache_lib.KVCache(keys=keys, values=values, lengths=jnp.asarray(START))
    for implementation in compact_cache.IMPLEMENTATIONS:
        moved = kv_cache_lib.compact(cache, jnp.asarray(START), jnp.asarray(SOURCES), implementation)
        for got, old in zip(moved.keys + moved.values, keys + values):
            np.testing.assert_array_equal(np.asarray(got[1, 11:17]), np.asarray(old[1, 11 + SOURCES[1]]))


def test_every_layer_moves_in_one_triton_call():
    """SmolLM2's 30 layers of keys and values: one kernel, lowered under Triton's rules."""
    shapes = tuple(jax.ShapeDtypeStruct((1, 1024, 3, 64), jnp.bfloat16) for _ in range(60))
    start, sources = jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((1, 6), jnp.int32)
    lowered = export.export(
        jax.jit(lambda b, s, p: compact_cache.compact(b, s, p, implementation="pallas", interpret=False)),
        platforms=["cuda"], disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(shapes, start, sources)
    assert lowered.mlir_module().count("__gpu$xla.gpu.triton") == 1


def test_every_store_waits_for_all_loads_of_its_buffer():
    """The race an H200 check found (entries lost at 7 and 32 path entries): a warp storing
    an entry onto a slot another warp has yet to read. Interpret mode runs in order and cannot show
    it, so this checks the kernel the GPU gets: in each buffer, load, barrier, then store."""
    count = 3
    traced = jax.make_jaxpr(lambda b: compact_cache.compact(
        b, jnp.asarray(START), jnp.asarray(SOURCES), implementation="pallas", interpret=False))(buffers(count, 64, jnp.float32))
    kernel = next(e for e in traced.jaxpr.eqns if e.primitive.name == "pallas_call").params["jaxpr"]
    memory = [e.primitive.name for e in kernel.eqns if e.primitive.name in ("masked_load", "debug_barrier_p", "masked_swap")]
    assert memory == ["masked_load"] + ["masked_load", "debug_barrier_p", "masked_swap"] * count  # the sources first


def test_unknown_implementation_is_refused():
    with pytest.raises(ValueError, match="implementation must be one of"):
        compact_cache.compact(buffers(1, 64, jnp.float32), jnp.asarray(START), jnp.asarray(SOURCES),
                              implementation="cuda")
