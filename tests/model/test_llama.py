"""The Flax Llama target against HF transformers' LlamaForCausalLM (torch, float32)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib
from eagle_jax.io import models

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def relative_error(actual, expected) -> float:
    return float(np.abs(np.asarray(actual) - np.asarray(expected)).max() / np.abs(np.asarray(expected)).max())


def flax_logits(model, ids: np.ndarray) -> np.ndarray:
    """Full forward over [B, T] ids from an empty cache (jitted: one compile beats op-by-op)."""
    graphdef, params = nnx.split(model)

    @jax.jit
    def forward(params, tokens):
        module = nnx.merge(graphdef, params)
        batch, length = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        hidden, _, _ = module(tokens, positions, module.init_cache(batch, length))
        return module.logits(hidden)

    return np.asarray(forward(params, jnp.asarray(ids, jnp.int32)))


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.numpy()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("rope_scaling", [None, LLAMA3_SCALING], ids=["rope", "llama3-rope"])
def test_logits_match_hf(hf_llama, tied, rope_scaling):
    torch_model, _, model = hf_llama(seed=1, tied=tied, rope_scaling=rope_scaling)
    assert model.config.tie_word_embeddings == tied and (model.config.rope_scaling is None) == (rope_scaling is None)
    # 100 tokens: well past original_max_position_embeddings=64, where llama3 scaling changes angles.
    ids = np.random.default_rng(0).integers(0, 101, (2, 100))
    expected = torch_logits(torch_model, ids)
    assert relative_error(flax_logits(model, ids), expected) < 1e-4


def test_llama3_scaling_matters_at_this_length(hf_llama):
    """Guards the test above: without the scaling the same weights give clearly different logits."""
    torch_model, _, _ = hf_llama(seed=1, rope_scaling=LLAMA3_SCALING)
    _, _, unscaled = hf_llama(seed=1)
    ids = np.random.default_rng(0).integers(0, 101, (1, 100))
    assert relative_error(flax_logits(unscaled, ids), torch_logits(torch_model, ids)) > 1e-2


def test_cached_decode_equals_full_forward(hf_llama):
    _, _, model = hf_llama(seed=2, rope_scaling=LLAMA3_SCALING)
    graphdef, params = nnx.split(model)

    @jax.jit
    def forward(params, tokens, positions, cache):
        module = nnx.merge(graphdef, params)
        hidden, cache, _ = module(tokens, positions, cache)
        return module.logits(hidden), cache

    ids = np.random.default_rng(3).integers(0, 101, (2, 80))
    full, _ = forward(params, jnp.asarray(ids, jnp.int32), jnp.broadcast_to(jnp.arange(80), (2, 80)),
                      model.init_cache(2, 128))
    prefill = 70  # then one token at a time, crossing position 64 (the llama3 original context)
    cache = model.init_cache(2, 128)
    logits, cache = forward(params, jnp.asarray(ids[:, :prefill], jnp.int32),
                            jnp.broadcast_to(jnp.arange(prefill), (2, prefill)), cache)
    stepped = [logits]
    for position in range(prefill, 80):
        logits, cache = forward(params, jnp.asarray(ids[:, position:position + 1], jnp.int32),
                                jnp.full((2, 1), position, jnp.int32), cache)
        stepped.append(logits)
    assert relative_error(np.concatenate(stepped, axis=1), full) < 1e-5


def test_attending_to_the_filled_prefix_only(hf_llama):
    """attend_length reads only the first slots of the cache: while every visible slot lies below
    it, logits and the written cache equal a read of the whole cache."""
    _, _, model = hf_llama(seed=4)
    graphdef, params = nnx.split(model)

    @functools.partial(jax.jit, static_argnames="attend_length")
    def forward(params, tokens, positions, cache, attend_length=None):
        module = nnx.merge(graphdef, params)
        hidden, cache, _ = module(tokens, positions, cache, attend_length=attend_length)
        return module.logits(hidden), cache

    ids = jnp.asarray(np.random.default_rng(5).integers(0, 101, (2, 40)), jnp.int32)
    cache = model.init_cache(2, 128)
    _, cache = forward(params, ids[:, :32], jnp.broadcast_to(jnp.arange(32), (2, 32)), cache)
    step = (ids[:, 32:40], jnp.broadcast_to(jnp.arange(32, 40), (2, 8)))
    whole, whole_cache = forward(params, *step, cache)
    prefix, prefix_cache = forward(params, *step, cache, attend_length=64)
    assert relative_error(prefix, whole) < 1e-6
    for a, b in zip(jax.tree.leaves(prefix_cache), jax.tree.leaves(whole_cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    short, _ = forward(params, *step, cache, attend_length=16)  # too short: drops visible slots
    assert relative_error(short, whole) > 1e-3


def test_bfloat16_runs_and_is_close_to_float32(hf_llama):
    _, directory, model = hf_llama(seed=4)
    bf16, _ = models.load_target(directory, "bfloat16")
    assert bf16.embed_tokens.embedding[...].dtype == jnp.bfloat16
    ids = np.random.default_rng(5).integers(0, 101, (1, 32))
    low, high = flax_logits(bf16, ids), flax_logits(model, ids)
    assert low.dtype == np.float32 and np.isfinite(low).all()
    assert relative_error(low, high) < 0.1
    assert np.mean(low.argmax(-1) == high.argmax(-1)) > 0.8


def hf_greedy(torch_model, prompt, max_new_tokens) -> list[int]:
    with torch.no_grad():
        out = torch_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                   do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                   eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def greedy_model(hf_llama):
    torch_model, _, model = hf_llama(seed=6, tied=True)
    return torch_model, model


MAX_NEW = 12


def test_greedy_generation_matches_hf_batch_1(greedy_model):
    torch_model, model = greedy_model
    prompt = np.random.default_rng(7).integers(0, 101, 9).tolist()
    [result] = engine_lib.Engine(model, config=config_lib.EngineConfig(max_length=64)).generate([prompt], max_new_tokens=MAX_NEW, ignore_eos=True)
    expected = hf_greedy(torch_model, prompt, MAX_NEW)
    assert len(set(expected)) > 2  # a non-degenerate continuation
    assert result.token_ids == expected


def test_greedy_generation_matches_hf_batched_with_padding_rows(greedy_model):
    """3 prompts of different lengths, 2 rows per program: the second batch has an idle row."""
    torch_model, model = greedy_model
    rng = np.random.default_rng(8)
    prompts = [rng.integers(0, 101, length).tolist() for length in (3, 11, 7)]
    results = engine_lib.Engine(model, config=config_lib.EngineConfig(steps_per_call=5, max_length=64, batch_size=2)).generate(
        prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
    assert [r.token_ids for r in results] == [hf_greedy(torch_model, p, MAX_NEW) for p in prompts]
