"""Fixtures of the training tests: a tiny target and rows distilled from it to train on."""

import jax
import numpy as np
import pytest
from flax import nnx

from eagle_jax.model import llama
from eagle_jax.serve import config as engine_config
from eagle_jax.serve import engine
from eagle_jax.train import distill


@pytest.fixture(scope="package")
def target_and_data(tiny_config):
    """(target of 61 tokens, its distilled dataset of 48 prompts, 6 of those prompts to evaluate on)."""
    cfg = tiny_config(vocab_size=61, hidden_size=32, num_layers=4, intermediate_size=64, eos_token_id=None)
    target = llama.Llama(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 61, size=rng.integers(3, 10)).astype(np.int32) for _ in range(48)]
    generator = engine.Engine(target, config=engine_config.EngineConfig(batch_size=16, max_length=64))
    dataset = distill.distill(generator, prompts, max_new_tokens=24, sequence_length=36, pad_id=0, progress=False)
    return target, dataset, prompts[:6]


@pytest.fixture(scope="package")
def jax_leaves():
    """Factory: `jax_leaves(tree)` -> the leaves of a pytree as numpy arrays, in tree order."""
    return lambda tree: [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]
