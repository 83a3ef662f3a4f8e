"""Shared fixtures: tiny Llama configs, tiny HF torch models saved to disk, random targets and heads.

Everything is small enough to compile and run on two CPU cores in seconds. Factories are
fixtures returning functions so that test modules need no imports from this file.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle_jax import checkpoint
from eagle_jax import config as config_lib
from eagle_jax import eagle
from eagle_jax import llama
from eagle_jax import models

# The llama3 scaling of Llama 3.1 shrunk to a tiny context: with head_dim 8 and theta 1e4 the
# wavelengths (6, 63, 628, 6283) fall in all three bands (kept, interpolated, slowed down).
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def hf_config_dict(*, vocab_size=101, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                   intermediate_size=64, tied=False, rope_scaling=None, max_position_embeddings=512,
                   **extra) -> dict:
    """An HF `config.json` dictionary for a tiny Llama (keyword names as transformers.LlamaConfig)."""
    config = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim, max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
        hidden_act="silu",
    )
    if rope_scaling is not None:
        config["rope_scaling"] = dict(rope_scaling)
    config.update(extra)
    return config


@pytest.fixture(scope="session")
def tiny_hf_config():
    """Factory: `tiny_hf_config(**overrides)` -> HF config dict."""
    return hf_config_dict


@pytest.fixture(scope="session")
def tiny_config():
    """Factory: `tiny_config(**overrides)` -> eagle_jax LlamaConfig."""
    return lambda **overrides: config_lib.LlamaConfig.from_hf_config(hf_config_dict(**overrides))


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory):
    """Factory: `hf_llama(seed=0, **config overrides)` -> (torch LlamaForCausalLM, saved dir, Flax Llama).

    The torch model is float32 and in eval mode; the directory is written with
    `save_pretrained(safe_serialization=True)` and the Flax model loaded from it by `models.load_target`.
    """
    import torch
    import transformers

    def make(seed: int = 0, initializer_range: float = 0.2, **overrides):
        config = hf_config_dict(**overrides)
        config.pop("architectures")
        config.pop("model_type")
        hf_config = transformers.LlamaConfig(initializer_range=initializer_range, **config)
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(hf_config).float().eval()
        directory = tmp_path_factory.mktemp("hf-llama")
        model.save_pretrained(directory, safe_serialization=True)
        target, _ = models.load_target(directory)
        return model, directory, target

    return make


@pytest.fixture(scope="session")
def random_target(tiny_config):
    """Factory: `random_target(seed=0, **config overrides)` -> Flax Llama with random weights."""

    def make(seed: int = 0, **overrides):
        return llama.Llama(tiny_config(**overrides), rngs=nnx.Rngs(seed))

    return make


def head_config(target_cfg: config_lib.LlamaConfig, method: str, *, fc_bias: bool = False,
                draft_vocab_size: int = 0, feature_layers: tuple[int, ...] = ()) -> eagle.EagleConfig:
    """An EAGLE head config fitting `target_cfg` (its layer is the target's with one layer)."""
    layer = config_lib.LlamaConfig(**{**target_cfg.__dict__, "num_layers": 1})
    if method == "eagle3":
        return eagle.EagleConfig(method="eagle3", layer=layer, draft_vocab_size=draft_vocab_size,
                                 target_hidden_size=target_cfg.hidden_size,
                                 feature_layers=feature_layers or tuple(range(min(3, target_cfg.num_layers))))
    return eagle.EagleConfig(method="eagle", layer=layer, fc_bias=fc_bias)


def vocab_map(vocab_size: int, draft_vocab_size: int, seed: int = 0) -> np.ndarray:
    """A nontrivial EAGLE-3 d2t: draft id i -> a distinct target id, stored as the offset target - i."""
    targets = np.sort(np.random.default_rng(seed).permutation(vocab_size)[:draft_vocab_size])
    return (targets - np.arange(draft_vocab_size)).astype(np.int32)


@pytest.fixture(scope="session")
def random_head():
    """Factory: `random_head(target_cfg, method, seed=0, fc_bias=False, draft_vocab_size=0, feature_layers=())`.

    EAGLE-3 heads get a random d2t from `vocab_map` (draft ids -> distinct, shuffled-in target ids)
    and random norm weights, so every parameter matters.
    """

    def make(target_cfg, method: str, seed: int = 0, **kwargs):
        cfg = head_config(target_cfg, method, **kwargs)
        head = eagle.make_head(cfg, rngs=nnx.Rngs(seed))
        rng = np.random.default_rng(seed)
        if method == "eagle3":
            head.d2t.value = jnp.asarray(vocab_map(target_cfg.vocab_size, cfg.draft_vocab_size, seed))
        for path, leaf in checkpoint.flat_state(nnx.state(head, nnx.Param)).items():
            if path.endswith("/bias") or (path.endswith("/weight") and "norm" in path):
                _set(head, path, 1.0 * (path.endswith("/weight")) + 0.1 * rng.standard_normal(leaf.shape))
        return head

    return make


def _set(module: nnx.Module, path: str, value) -> None:
    """Assigns a parameter by its '/'-joined NNX path."""
    *parents, name = path.split("/")
    for part in parents:
        module = module[int(part)] if part.isdigit() else getattr(module, part)
    getattr(module, name).value = jnp.asarray(value, jnp.float32)


@pytest.fixture(scope="session")
def set_param():
    """`set_param(module, "self_attn/o_proj/kernel", array)`."""
    return _set
