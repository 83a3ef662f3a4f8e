"""EAGLE heads in their public HF layouts: export, load, and the errors for heads that do not fit."""

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle_jax.model import eagle
from eagle_jax.io import hf_files
from eagle_jax.io import models

DRAFT_VOCAB = 40


@pytest.fixture(scope="module")
def target(random_target):
    return random_target(seed=5, num_layers=3)


@pytest.fixture(scope="module")
def heads(target, random_head):
    return {
        "eagle": random_head(target.config, "eagle", seed=1),
        "eagle-bias": random_head(target.config, "eagle", seed=2, fc_bias=True),
        "eagle3": random_head(target.config, "eagle3", seed=3, draft_vocab_size=DRAFT_VOCAB),
    }


def _draft_forward(head_def, head_params, target_def, target_params, tokens, source):
    head, target = nnx.merge(head_def, head_params), nnx.merge(target_def, target_params)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    cache = eagle.init_cache(head.config, tokens.shape[0], 16, jnp.float32)
    features, logits, _ = head(tokens, head.project(source), positions, cache, target)
    return features, logits, head.to_target_ids(jnp.arange(logits.shape[-1], dtype=jnp.int32))


_draft_forward = jax.jit(_draft_forward, static_argnums=(0, 2))  # graph definitions are static


def draft_outputs(head, target):
    """(features, draft logits, draft->target ids) for fixed random tokens and target features."""
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, target.config.vocab_size, (2, 6)), jnp.int32)
    width = len(head.config.feature_layers) * target.config.hidden_size if head.config.method == "eagle3" else \
        target.config.hidden_size
    source = jnp.asarray(rng.standard_normal((2, 6, width)), jnp.float32)
    return [np.asarray(x) for x in _draft_forward(*nnx.split(head), *nnx.split(target), tokens, source)]


@pytest.mark.parametrize("kind", ["eagle", "eagle-bias", "eagle3"])
@pytest.mark.parametrize("torch_bin", [False, True], ids=["safetensors", "pytorch_model.bin"])
def test_public_layout_head_loads_with_the_same_draft_logits(target, heads, save_head, tmp_path, kind, torch_bin):
    head = heads[kind]
    embeddings = np.asarray(target.embed_tokens.embedding[...]) if kind == "eagle" else None
    directory = save_head(head, tmp_path / kind, embeddings=embeddings, torch_bin=torch_bin)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # equal embed_tokens must not warn
        loaded = models.load_head(directory, target)
    assert loaded.config == head.config
    for expected, actual in zip(draft_outputs(head, target), draft_outputs(loaded, target)):
        np.testing.assert_array_equal(actual, expected)
    if kind == "eagle3":
        assert np.asarray(loaded.d2t[...]).dtype == np.int32
        assert len(set(draft_outputs(loaded, target)[2].tolist())) == DRAFT_VOCAB  # distinct target ids


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_export_round_trip_keeps_llama3_rope_scaling(random_target, random_head, tmp_path, method):
    """Heads for Llama 3.1 targets carry its rope scaling; an exported head must keep it."""
    scaled = random_target(seed=6, num_layers=3, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    head = random_head(scaled.config, method, draft_vocab_size=DRAFT_VOCAB if method == "eagle3" else 0)
    assert head.config.layer.rope_scaling is not None
    loaded = models.load_head(models.export_head(head, scaled.config, tmp_path / method, dtype="float32"), scaled)
    assert loaded.config == head.config
    np.testing.assert_array_equal(draft_outputs(loaded, scaled)[1], draft_outputs(head, scaled)[1])


def test_export_defaults_to_bfloat16(target, heads, tmp_path):
    directory = models.export_head(heads["eagle3"], target.config, tmp_path / "bf16")
    tensors = hf_files.load_tensors(directory, progress=False)
    assert tensors["fc.weight"].dtype.name == "bfloat16" and tensors["d2t"].dtype == np.int64
    assert tensors["t2d"].dtype == np.bool_ and tensors["t2d"].sum() == DRAFT_VOCAB
    loaded = models.load_head(directory, target)
    np.testing.assert_allclose(draft_outputs(loaded, target)[1], draft_outputs(heads["eagle3"], target)[1],
                               atol=0.05 * np.abs(draft_outputs(heads["eagle3"], target)[1]).max())


def test_a_different_random_head_gives_different_logits(target, heads):
    """Guards the test above: draft logits do depend on the head's weights."""
    assert not np.allclose(draft_outputs(heads["eagle"], target)[1], draft_outputs(heads["eagle-bias"], target)[1])


@pytest.fixture
def exported(heads, save_head, tmp_path):
    """Factory: (kind, edit(tensors, config)) -> directory of an exported head, edited."""

    def make(kind, edit):
        directory = save_head(heads[kind], tmp_path / kind)
        tensors = {name: np.array(array) for name, array in hf_files.load_tensors(directory).items()}
        config = json.loads((directory / "config.json").read_text())
        edit(tensors, config)
        hf_files.save_tensors(tensors, directory / "model.safetensors")
        (directory / "config.json").write_text(json.dumps(config))
        return directory

    return make


def test_head_for_a_different_hidden_size_names_both_sides(target, random_target, random_head, save_head, tmp_path):
    wide = random_target(seed=0, num_layers=3, hidden_size=48, head_dim=12)
    directory = save_head(random_head(wide.config, "eagle"), tmp_path / "wide")
    with pytest.raises(hf_files.CheckpointError, match="head hidden_size=48, target hidden_size=32"):
        models.load_head(directory, target)


def _d2t_too_long(tensors, config):
    tensors["d2t"] = np.concatenate([tensors["d2t"], [0]])


def _d2t_outside_vocab(tensors, config):
    tensors["d2t"][-1] = 101 - (DRAFT_VOCAB - 1)  # draft id 39 -> target id 101 == vocab_size


def _unknown_key(tensors, config):
    tensors["midlayer.extra.weight"] = np.zeros(3, np.float32)


def _missing_key(tensors, config):
    del tensors["midlayer.mlp.up_proj.weight"]


def _wrong_shape(tensors, config):
    tensors["fc.weight"] = tensors["fc.weight"][:, :-1]


def _wrong_part_shape(tensors, config):
    tensors["midlayer.self_attn.k_proj.weight"] = tensors["midlayer.self_attn.k_proj.weight"][:-1]


def _no_head_tensors(tensors, config):
    tensors.pop("fc.weight")
    config["architectures"] = ["LlamaForCausalLM"]
    for name in [name for name in tensors if name.startswith("midlayer.")]:
        tensors[name.replace("midlayer.", "layers.0.")] = tensors.pop(name)


@pytest.mark.parametrize("edit, message", [
    (_d2t_too_long, rf"head d2t has shape \({DRAFT_VOCAB + 1},\), head draft_vocab_size={DRAFT_VOCAB}"),
    (_d2t_outside_vocab, r"head d2t maps draft id 39 to target id 101, outside the target vocabulary \[0, 101\)"),
    (_unknown_key, "unexpected tensor 'midlayer.extra.weight'"),
    (_missing_key, r"checkpoint lacks tensor 'midlayer.mlp.up_proj.weight' \(part 2 of 'midlayer/mlp/gate_up_proj/kernel'\)"),
    (_wrong_shape, "tensor 'fc.weight' has shape"),
    (_wrong_part_shape, r"tensors do not fit: .*'midlayer.self_attn.k_proj.weight' has shape \(64, 15\).*"
                        r"model expects \(64, 64\) at 'midlayer/self_attn/qkv_proj/kernel'"),
    (_no_head_tensors, "not an EAGLE head"),
])
def test_bad_eagle3_heads_are_errors(target, exported, edit, message):
    with pytest.raises(hf_files.CheckpointError, match=message):
        models.load_head(exported("eagle3", edit), target)


def test_unknown_key_in_an_eagle1_head(target, exported):
    directory = exported("eagle", lambda tensors, config: tensors.update({"layers.1.mlp.up_proj.weight": np.zeros(2)}))
    with pytest.raises(hf_files.CheckpointError, match="unexpected tensor 'layers.1.mlp.up_proj.weight'"):
        models.load_head(directory, target)
