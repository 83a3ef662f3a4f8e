"""The persistent decode kernel against the model's own cached decode step (Pallas interpret mode, CPU)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.kernels import persistent_layers
from eagle_jax.model import kv_cache as kv_cache_lib
from eagle_jax.model import rotary

SLOTS = 64


def filled_cache(target, position: int, seed: int) -> kv_cache_lib.KVCache:
    """A one-row cache whose slots below `position` hold random keys and values (the rest zero)."""
    cfg = target.config
    rng = np.random.default_rng(seed)
    shape = (1, SLOTS, cfg.num_kv_heads, cfg.head_dim)
    visible = (np.arange(SLOTS) < position)[None, :, None, None]
    layer = lambda: jnp.asarray(np.where(visible, rng.standard_normal(shape), 0.0), jnp.float32)
    return kv_cache_lib.KVCache(keys=tuple(layer() for _ in range(cfg.num_layers)),
                                values=tuple(layer() for _ in range(cfg.num_layers)),
                                lengths=jnp.full((1,), position, jnp.int32))


def run_kernel(target, token: int, position: int, cache: kv_cache_lib.KVCache, **settings):
    cfg = target.config
    x = target.embed_tokens(jnp.array([[token]], jnp.int32))[0, 0]
    return persistent_layers.decode_layers(
        x, jnp.int32(position), persistent_layers.stack_layers(target),
        jnp.stack(cache.keys)[:, 0], jnp.stack(cache.values)[:, 0], num_heads=cfg.num_heads, eps=cfg.rms_norm_eps,
        inv_freq=rotary.rope_inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), interpret=True,
        **settings)


# Slot 0 (no older slot), inside the first part, its last slot, the first of the next, the last slot.
@pytest.mark.parametrize("position", [0, 5, 15, 16, SLOTS - 1])
def test_matches_the_models_decode_step(random_target, position):
    target = random_target(seed=3, num_layers=3)
    cache = filled_cache(target, position, seed=position)
    token = 17
    hidden, model_cache, _ = target(jnp.array([[token]], jnp.int32), jnp.array([[position]], jnp.int32), cache)
    x, keys, values = run_kernel(target, token, position, cache, part_slots=16, rows=8)
    np.testing.assert_allclose(target.norm(x), hidden[0, 0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(keys, jnp.stack(model_cache.keys)[:, 0], rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(values, jnp.stack(model_cache.values)[:, 0], rtol=2e-5, atol=2e-5)


def test_work_items_cover_every_feature_whatever_their_size(random_target):
    """Items of 4 or 16 features (a partial item at the edges) and one part for the whole cache
    give the same step as the defaults."""
    target = random_target(seed=4)
    position = 20
    cache = filled_cache(target, position, seed=1)
    reference = run_kernel(target, 5, position, cache)
    for settings in (dict(rows=4, part_slots=16), dict(rows=16, part_slots=64)):
        for got, want in zip(run_kernel(target, 5, position, cache, **settings), reference):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_loading_ahead_of_the_barriers_changes_nothing(random_target):
    """With one item a stage (the one program interpret mode runs), every stage loads its weights,
    and attention its older slots, before the barrier ahead of it: the same step as without."""
    target = random_target(seed=5, num_kv_heads=1, num_heads=2, head_dim=16)
    position = 30
    cache = filled_cache(target, position, seed=2)
    one_item = dict(rows=64, part_slots=SLOTS)
    ahead = run_kernel(target, 9, position, cache, prefetch=True, **one_item)
    for got, want in zip(ahead, run_kernel(target, 9, position, cache, prefetch=False, **one_item)):
        np.testing.assert_array_equal(got, want)
    hidden, _, _ = target(jnp.array([[9]], jnp.int32), jnp.array([[position]], jnp.int32), cache)
    np.testing.assert_allclose(target.norm(ahead[0]), hidden[0, 0], rtol=2e-5, atol=2e-5)


def test_refuses_biased_layers(random_target):
    with pytest.raises(ValueError, match="biases"):
        persistent_layers.stack_layers(random_target(attention_bias=True))


def test_skipping_stages_leaves_out_their_work(random_target):
    """The timing ablation: with every stage skipped the residual stream stays the embedding and the
    cache is untouched; skipping the MLP's two stages leaves attention's update alone; and polling
    the barriers with atomics changes nothing (one program never polls)."""
    target = random_target(seed=6, num_layers=2)
    position = 12
    cache = filled_cache(target, position, seed=3)
    embedding = target.embed_tokens(jnp.array([[4]], jnp.int32))[0, 0]
    x, keys, values = run_kernel(target, 4, position, cache, skip=persistent_layers.STAGES)
    np.testing.assert_array_equal(x, embedding)
    np.testing.assert_array_equal(keys, jnp.stack(cache.keys)[:, 0])
    np.testing.assert_array_equal(values, jnp.stack(cache.values)[:, 0])
    full = run_kernel(target, 4, position, cache)
    attention_only = run_kernel(target, 4, position, cache, skip=("gate_up", "down"))
    assert not np.allclose(attention_only[0], full[0]) and not np.allclose(attention_only[0], embedding)
    np.testing.assert_array_equal(attention_only[1][0], full[1][0])  # layer 0's cache write precedes its MLP
    for got, want in zip(run_kernel(target, 4, position, cache, spin="atomic"), full):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("settings, message", [(dict(programs=2), "programs must be in 1..1"),
                                               (dict(rows=12), "rows must be a power of two"),
                                               (dict(part_slots=8), "part_slots must be a power of two >= 16"),
                                               (dict(skip=("mlp",)), "skip takes stages of")])
def test_refuses_a_grid_that_cannot_all_be_resident_and_ragged_blocks(random_target, settings, message):
    """Interpret mode runs one program at a time: two would wait for each other at the first barrier."""
    target = random_target()
    with pytest.raises(ValueError, match=message):
        run_kernel(target, 1, 3, filled_cache(target, 3, seed=0), **settings)


@pytest.mark.parametrize("rows, prefetch, spin, skip", [(None, True, "volatile", ()), (16, True, "atomic", ()),
                                                       (8, False, "volatile", ()), (None, True, "atomic", ("qkv",)),
                                                       (None, True, "volatile", persistent_layers.STAGES)])
def test_lowers_to_triton_for_a_gpu(rows, prefetch, spin, skip):
    """Lowered for CUDA at SmolLM2's shapes (two layers), off a GPU: what interpret mode never
    meets, Pallas's Triton lowering (its refusals of an op or a load's setting), runs here."""
    layers, hidden, heads, kv_heads, head_dim, inter, slots = 2, 576, 9, 3, 64, 1536, 2048
    array = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
    weights = persistent_layers.StackedLayers(
        array(layers, hidden), array(layers, (heads + 2 * kv_heads) * head_dim, hidden),
        array(layers, hidden, heads * head_dim), array(layers, hidden), array(layers, inter, hidden),
        array(layers, inter, hidden), array(layers, hidden, inter))
    work = persistent_layers.work_rows(132, (heads + 2 * kv_heads) * head_dim, hidden, inter, rows)
    call = functools.partial(persistent_layers._decode_layers, num_heads=heads, eps=1e-5, programs=132,
                             part_slots=256, work=work, num_warps=4, prefetch=prefetch, spin=spin, skip=skip,
                             interpret=False)
    cache = array(layers, slots, kv_heads, head_dim)
    lowered = jax.jit(call).trace(array(1, dtype=jnp.int32), array(head_dim, dtype=jnp.float32), array(hidden),
                                  *weights, cache, cache).lower(lowering_platforms=("cuda",))
    assert "__gpu$xla.gpu.triton" in lowered.as_text()


def test_work_items_leave_each_program_at_most_one_item_by_default():
    """SmolLM2's projections (qkv 960, hidden 576, MLP 1536 features) on an H100's 132 programs,
    and on the one program of interpret mode; a given size holds for every stage."""
    rows = persistent_layers.work_rows
    assert rows(132, 960, 576, 1536) == persistent_layers.Work(qkv=8, o=8, gate_up=16, down=8)
    assert rows(1, 64, 32, 64) == persistent_layers.Work(qkv=64, o=32, gate_up=64, down=32)
    assert rows(132, 960, 576, 1536, rows=4) == persistent_layers.Work(4, 4, 4, 4)
