"""EAGLE heads in the layouts their authors publish, written here by hand (never by eagle_jax's exporter).

A naming error made on both sides of `export_head` / `load_head` passes a round trip; these
fixtures pin the names, dtypes, shapes and config fields to the published checkpoints instead:

* EAGLE-1, as yuhuili/EAGLE-LLaMA3-Instruct-8B (SafeAILab `eagle/model/cnets1.py`, its config as
  `eagle/train/EAGLE-LLaMA3-Instruct-8B`): `pytorch_model.bin` in float16; `fc.weight` [H, 2H] with
  no bias and `"bias": false`; layer 0 has no input_layernorm; `embed_tokens.weight`, a frozen copy
  of the target's (SafeAILab loaded the head with strict=True, so the file carries it).
* EAGLE-1 with SafeAILab's default fc bias: a config without `bias` means True (`ea_model.py`),
  and `fc.bias` [H] is saved (the Vicuna heads; vLLM PR #8790).
* EAGLE-3, as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (SafeAILab `eagle/model/cnets.py`; vLLM
  `llama_eagle3.py` load_weights; SGLang `llama_eagle3.py`; config as SpecForge
  `configs/llama3-8B-eagle3.json`): `midlayer.*` with q/k/v over 2H inputs, `fc.weight` [H, 3H] (no
  bias), `norm.weight`, `lm_head.weight` [Vd, H], `d2t` [Vd] int64 offsets (target = draft + d2t),
  `t2d` [V] bool; no embed_tokens (frozen, so not saved); `architectures: ["LlamaForCausalLMEagle3"]`.
* EAGLE-3 as SpecForge exports it (`specforge/export/to_hf.py`): safetensors in bfloat16 with
  `embed_tokens.weight`, `target_hidden_size`, and `eagle_config.eagle_aux_hidden_state_layer_ids`
  counting layer *outputs* (SGLang adds 1; vLLM's top-level field counts layer inputs).
"""

import json
import re
import warnings

import numpy as np
import pytest
import torch
from flax import nnx

from convert import __main__ as convert_cli
from eagle_jax.io import checkpoint
from eagle_jax.model import eagle
from eagle_jax.io import hf_files
from eagle_jax.io import models

DRAFT_VOCAB = 24
NUM_LAYERS = 8  # EAGLE-3's default capture points (2, L//2, L-3) = (2, 4, 5) are then distinct
ROUNDING = {"float16": torch.float16, "bfloat16": torch.bfloat16}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def target_and_dir(hf_llama):
    _, directory, target = hf_llama(seed=31, num_layers=NUM_LAYERS)
    return target, directory


@pytest.fixture(scope="module")
def target(target_and_dir):
    return target_and_dir[0]


def _rounded(array, dtype: str) -> np.ndarray:
    """float32 values exactly representable in the checkpoint's dtype, so loaded values compare exactly."""
    return torch.from_numpy(np.array(array, np.float32)).to(ROUNDING[dtype]).float().numpy()


def _layer_config(target, architecture: str, dtype: str) -> dict:
    cfg = target.config
    return {"architectures": [architecture], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
            "hidden_size": cfg.hidden_size, "initializer_range": 0.02, "intermediate_size": cfg.intermediate_size,
            "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "num_hidden_layers": 1, "pad_token_id": 0, "rms_norm_eps": 1e-05,
            "tie_word_embeddings": False, "torch_dtype": dtype, "transformers_version": "4.28.1", "use_cache": True,
            "vocab_size": cfg.vocab_size}


def _layer_tensors(target, prefix: str, input_size: int, rng, dtype: str) -> dict:
    """One decoder layer's weights, distinct random values per tensor, [out, in] as torch Linear."""
    cfg = target.config
    hidden, heads, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"self_attn.q_proj": (heads, input_size), "self_attn.k_proj": (kv, input_size),
              "self_attn.v_proj": (kv, input_size), "self_attn.o_proj": (hidden, heads),
              "mlp.gate_proj": (cfg.intermediate_size, hidden), "mlp.up_proj": (cfg.intermediate_size, hidden),
              "mlp.down_proj": (hidden, cfg.intermediate_size)}
    tensors = {f"{prefix}.{name}.weight": _rounded(rng.standard_normal(shape) / np.sqrt(shape[1]), dtype)
               for name, shape in shapes.items()}
    tensors[f"{prefix}.post_attention_layernorm.weight"] = _rounded(1 + 0.1 * rng.standard_normal(hidden), dtype)
    return tensors


def eagle1_checkpoint(target, *, bias: bool = False, seed: int = 0) -> tuple[dict, dict]:
    """(config, tensors) of an EAGLE-1 head: EAGLE-LLaMA3-Instruct-8B's layout, or the fc-bias default."""
    rng, hidden = np.random.default_rng(seed), target.config.hidden_size
    config = _layer_config(target, "LlamaForCausalLM", "float16")
    tensors = {"embed_tokens.weight": _rounded(target.embed_tokens.embedding[...], "float16"),
               "fc.weight": _rounded(rng.standard_normal((hidden, 2 * hidden)) / np.sqrt(2 * hidden), "float16"),
               **_layer_tensors(target, "layers.0", hidden, rng, "float16")}
    if bias:  # SafeAILab's default: no "bias" in the config means an fc bias
        tensors["fc.bias"] = _rounded(0.1 * rng.standard_normal(hidden), "float16")
    else:
        config.update(rope_theta=500000.0, bias=False)
    return config, tensors


def eagle3_checkpoint(target, *, specforge: bool = False, seed: int = 0) -> tuple[dict, dict]:
    """(config, tensors) of an EAGLE-3 head: EAGLE3-LLaMA3.1-Instruct-8B's layout, or SpecForge's export."""
    rng, cfg = np.random.default_rng(seed), target.config
    hidden, dtype = cfg.hidden_size, "bfloat16" if specforge else "float16"
    config = dict(_layer_config(target, "LlamaForCausalLMEagle3", dtype), draft_vocab_size=DRAFT_VOCAB)
    chosen = np.sort(rng.permutation(cfg.vocab_size)[:DRAFT_VOCAB])  # the draft vocabulary, ascending
    t2d = np.zeros(cfg.vocab_size, bool)
    t2d[chosen] = True
    tensors = {"d2t": (chosen - np.arange(DRAFT_VOCAB)).astype(np.int64), "t2d": t2d,
               "fc.weight": _rounded(rng.standard_normal((hidden, 3 * hidden)) / np.sqrt(3 * hidden), dtype),
               "midlayer.hidden_norm.weight": _rounded(1 + 0.1 * rng.standard_normal(hidden), dtype),
               "midlayer.input_layernorm.weight": _rounded(1 + 0.1 * rng.standard_normal(hidden), dtype),
               **_layer_tensors(target, "midlayer", 2 * hidden, rng, dtype),
               "norm.weight": _rounded(1 + 0.1 * rng.standard_normal(hidden), dtype),
               "lm_head.weight": _rounded(rng.standard_normal((DRAFT_VOCAB, hidden)) / np.sqrt(hidden), dtype)}
    if specforge:
        tensors["embed_tokens.weight"] = _rounded(target.embed_tokens.embedding[...], dtype)
        # Layer outputs 0, 2 and 5 are the inputs of layers 1, 3 and 6: not the default (2, 4, 5).
        config.update(target_hidden_size=hidden, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 2, 5]})
    return config, tensors


def write_checkpoint(directory, config: dict, tensors: dict, torch_bin: bool = True):
    """Saves as the authors did: torch.save of the state dict (yuhuili) or safetensors (SpecForge)."""
    directory.mkdir(parents=True, exist_ok=True)
    dtype = ROUNDING[config["torch_dtype"]]
    state = {name: torch.from_numpy(np.ascontiguousarray(array)) for name, array in tensors.items()}
    state = {name: tensor.to(dtype) if tensor.is_floating_point() else tensor for name, tensor in state.items()}
    if torch_bin:
        torch.save(state, directory / "pytorch_model.bin")
    else:
        import safetensors.torch

        safetensors.torch.save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


PUBLISHED = {
    "eagle-llama3": lambda target: eagle1_checkpoint(target),
    "eagle-bias": lambda target: eagle1_checkpoint(target, bias=True, seed=1),
    "eagle3-llama3.1": lambda target: eagle3_checkpoint(target, seed=2),
    "eagle3-specforge": lambda target: eagle3_checkpoint(target, specforge=True, seed=3),
}


@pytest.fixture
def published(target, tmp_path):
    """Factory: `published(kind, edit=None)` -> (directory, config, tensors) after `edit(config, tensors)`."""

    def make(kind: str, edit=None):
        config, tensors = PUBLISHED[kind](target)
        if edit is not None:
            edit(config, tensors)
        return write_checkpoint(tmp_path / kind, config, tensors, torch_bin="specforge" not in kind), config, tensors

    return make


def load_quietly(directory, target):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the saved embed_tokens equal the target's
        return models.load_head(directory, target)


# ---- where each published tensor lands ---------------------------------------------------------

def expected_params(tensors: dict, prefix: str, flax_prefix: str) -> dict:
    """Flax path -> value, from the published names: kernels [in, out]; q|k|v and gate|up fused in that order."""
    weight = lambda name: tensors[f"{prefix}.{name}.weight"].T
    layer = {"self_attn/qkv_proj/kernel": np.concatenate([weight("self_attn.q_proj"), weight("self_attn.k_proj"),
                                                          weight("self_attn.v_proj")], axis=1),
             "self_attn/o_proj/kernel": weight("self_attn.o_proj"),
             "mlp/gate_up_proj/kernel": np.concatenate([weight("mlp.gate_proj"), weight("mlp.up_proj")], axis=1),
             "mlp/down_proj/kernel": weight("mlp.down_proj"),
             "post_attention_layernorm/weight": tensors[f"{prefix}.post_attention_layernorm.weight"]}
    expected = {flax_prefix + path: value for path, value in layer.items()}
    expected["fc/kernel"] = tensors["fc.weight"].T
    if "fc.bias" in tensors:
        expected["fc/bias"] = tensors["fc.bias"]
    if prefix == "midlayer":
        expected.update({"midlayer/input_layernorm/weight": tensors["midlayer.input_layernorm.weight"],
                         "midlayer/hidden_norm/weight": tensors["midlayer.hidden_norm.weight"],
                         "norm/weight": tensors["norm.weight"], "lm_head/kernel": tensors["lm_head.weight"].T,
                         "d2t": tensors["d2t"]})
    return expected


@pytest.mark.parametrize("kind", list(PUBLISHED))
def test_each_published_tensor_lands_at_its_flax_path(target, published, kind):
    directory, config, tensors = published(kind)
    head = load_quietly(directory, target)
    eagle3 = kind.startswith("eagle3")
    expected = expected_params(tensors, "midlayer" if eagle3 else "layers.0", "midlayer/" if eagle3 else "")
    params = checkpoint.flat_state(nnx.state(head))
    assert set(params) == set(expected)
    for path, value in expected.items():
        np.testing.assert_array_equal(np.asarray(params[path]), value, err_msg=path)
    if eagle3:
        assert head.config.draft_vocab_size == DRAFT_VOCAB and head.config.target_hidden_size == 32
        assert head.config.feature_layers == ((1, 3, 6) if kind == "eagle3-specforge" else (2, 4, 5))
        ids = np.asarray(head.to_target_ids(np.arange(DRAFT_VOCAB, dtype=np.int32)))
        np.testing.assert_array_equal(ids, np.flatnonzero(tensors["t2d"]))
    else:
        assert head.config.fc_bias == ("fc.bias" in tensors)
        assert head.config.layer.rope_theta == config.get("rope_theta", 10000.0)  # the head's own, not the target's


# ---- the published math, on the published names ---------------------------------------------------

def _rms_norm(x, weight, eps=1e-5):
    return weight * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _attention(x, tensors, prefix, config):
    """HF Llama attention over positions 0..T-1 (rotate-half rotary, grouped kv heads, causal)."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, length = config["hidden_size"] // heads, x.shape[0]
    project = lambda name, count: (x @ tensors[f"{prefix}.self_attn.{name}.weight"].T).reshape(length, count, head_dim)
    q, k, v = project("q_proj", heads), project("k_proj", kv_heads), project("v_proj", kv_heads)
    angles = np.arange(length)[:, None] / config.get("rope_theta", 10000.0) ** (np.arange(0, head_dim, 2) / head_dim)
    cos, sin = np.cos(np.concatenate([angles] * 2, -1))[:, None], np.sin(np.concatenate([angles] * 2, -1))[:, None]
    rotate = lambda u: np.concatenate([-u[..., head_dim // 2:], u[..., :head_dim // 2]], axis=-1)
    q, k = q * cos + rotate(q) * sin, k * cos + rotate(k) * sin
    k, v = np.repeat(k, heads // kv_heads, axis=1), np.repeat(v, heads // kv_heads, axis=1)
    scores = np.einsum("tnh,snh->nts", q, k) / np.sqrt(head_dim)
    scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    attended = np.einsum("nts,snh->tnh", weights, v).reshape(length, heads * head_dim)
    return attended @ tensors[f"{prefix}.self_attn.o_proj.weight"].T


def _mlp(x, tensors, prefix):
    gate, up = (x @ tensors[f"{prefix}.mlp.{name}.weight"].T for name in ("gate_proj", "up_proj"))
    return (gate / (1 + np.exp(-gate)) * up) @ tensors[f"{prefix}.mlp.down_proj.weight"].T


def reference_eagle1(tensors, config, embedded, features, target_lm_head):
    """SafeAILab cnets1: x = fc([e; f]); h = x + Attn(x) (no input norm); out = h + MLP(norm(h))."""
    x = np.concatenate([embedded, features], axis=-1) @ tensors["fc.weight"].T + tensors.get("fc.bias", 0.0)
    h = x + _attention(x, tensors, "layers.0", config)
    out = h + _mlp(_rms_norm(h, tensors["layers.0.post_attention_layernorm.weight"]), tensors, "layers.0")
    return out, out @ target_lm_head


def reference_eagle3(tensors, config, embedded, captured):
    """SafeAILab cnets: g = fc(a_low|a_mid|a_high); z = [norm(e); norm(g)]; h = g + Attn(z); pre = h + MLP(norm(h))."""
    g = captured @ tensors["fc.weight"].T
    z = np.concatenate([_rms_norm(embedded, tensors["midlayer.input_layernorm.weight"]),
                        _rms_norm(g, tensors["midlayer.hidden_norm.weight"])], axis=-1)
    h = g + _attention(z, tensors, "midlayer", config)
    pre = h + _mlp(_rms_norm(h, tensors["midlayer.post_attention_layernorm.weight"]), tensors, "midlayer")
    return pre, _rms_norm(pre, tensors["norm.weight"]) @ tensors["lm_head.weight"].T


@pytest.mark.parametrize("kind", list(PUBLISHED))
def test_loaded_head_computes_the_published_math(target, published, kind):
    directory, config, tensors = published(kind)
    head = load_quietly(directory, target)
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, target.config.vocab_size, (1, 6)).astype(np.int32)
    width = (3 if kind.startswith("eagle3") else 1) * target.config.hidden_size
    source = rng.standard_normal((1, 6, width)).astype(np.float32)
    positions = np.arange(6, dtype=np.int32)[None]
    cache = eagle.init_cache(head.config, 1, 16, np.float32)
    features, logits, _ = head(tokens, head.project(source), positions, cache, target)
    embedded = np.asarray(target.embed_tokens.embedding[...], np.float64)[tokens[0]]
    tensors64 = {name: np.asarray(array, np.float64) for name, array in tensors.items() if array.dtype != bool}
    if kind.startswith("eagle3"):
        expected = reference_eagle3(tensors64, config, embedded, source[0].astype(np.float64))
    else:
        expected = reference_eagle1(tensors64, config, embedded, source[0].astype(np.float64),
                                    np.asarray(target.lm_head.kernel[...], np.float64))
    for actual, wanted in zip((features[0], logits[0]), expected):
        np.testing.assert_allclose(np.asarray(actual), wanted, rtol=2e-4, atol=2e-4 * np.abs(wanted).max())


def test_full_vocabulary_eagle3_head_without_d2t_and_t2d(target, published):
    """SafeAILab drops d2t and t2d when draft_vocab_size == vocab_size (`ea_model.py`): the identity map."""

    def full_vocabulary(config, tensors):
        del tensors["d2t"], tensors["t2d"]
        config["draft_vocab_size"] = target.config.vocab_size
        tensors["lm_head.weight"] = np.ones((target.config.vocab_size, target.config.hidden_size), np.float32)

    head = load_quietly(published("eagle3-llama3.1", full_vocabulary)[0], target)
    ids = np.arange(target.config.vocab_size, dtype=np.int32)
    np.testing.assert_array_equal(np.asarray(head.to_target_ids(ids)), ids)


# ---- our exporter and the conversion CLI write the published layout -------------------------------

# Fields of the published configs that no loader reads (HF and training metadata).
METADATA_FIELDS = {"initializer_range", "pad_token_id", "transformers_version", "use_cache"}
# Defaults of fields a published config may leave out: SafeAILab reads a missing "bias" as True.
DEFAULTS = {"eagle-": {"rope_theta": 10000.0, "bias": True}, "eagle3": {"rope_theta": 10000.0}}
# What export_head adds: an explicit head_dim; EAGLE-3's feature layers (vLLM's top-level spelling) and width.
EXPORT_EXTRAS = {"head_dim", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"}


@pytest.mark.parametrize("kind", ["eagle-llama3", "eagle-bias", "eagle3-llama3.1"])
def test_export_writes_the_published_keys_and_config(target, published, tmp_path, kind):
    directory, config, tensors = published(kind)
    out = models.export_head(load_quietly(directory, target), target.config, tmp_path / "exported", dtype="float32")
    written = hf_files.load_tensors(out, progress=False)
    # EAGLE-1 files also carry a frozen copy of the target's embeddings; the head uses the target's,
    # and vLLM, SGLang and SafeAILab's current loader take them from the target when absent.
    assert set(written) == set(tensors) - {"embed_tokens.weight"}
    for name, array in written.items():
        assert array.dtype == tensors[name].dtype if name in ("d2t", "t2d") else array.dtype == np.float32, name
        np.testing.assert_array_equal(array, tensors[name], err_msg=name)
    exported = json.loads((out / "config.json").read_text())
    assert set(config) - set(exported) <= METADATA_FIELDS
    # Fields the published config leaves to their defaults are written out with those defaults.
    defaults = {field: value for field, value in DEFAULTS[kind[:6]].items() if field not in config}
    assert set(exported) - set(config) <= EXPORT_EXTRAS | set(defaults)
    assert {field: exported[field] for field in defaults} == defaults
    shared = set(config) & set(exported) - {"torch_dtype", "eos_token_id"}
    assert {field: exported[field] for field in shared} == {field: config[field] for field in shared}
    assert exported["eos_token_id"] == [config["eos_token_id"]]  # a list, as Llama 3's own configs write it
    if kind.startswith("eagle3"):
        assert exported["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]


@pytest.mark.parametrize("kind", list(PUBLISHED))
def test_convert_cli_keeps_the_published_layout(target_and_dir, published, tmp_path, capsys, kind):
    target, target_dir = target_and_dir
    directory, config, tensors = published(kind)
    code = convert_cli.main([str(directory), str(tmp_path / "out"), "--target", str(target_dir)])
    assert code == 0, capsys.readouterr().err
    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == config
    source, written = hf_files.load_tensors(directory, progress=False), hf_files.load_tensors(tmp_path / "out")
    assert set(written) == set(source) == set(tensors)
    for name, array in source.items():
        assert written[name].dtype == array.dtype, name
        np.testing.assert_array_equal(written[name], array, err_msg=name)
    before = checkpoint.flat_state(nnx.state(load_quietly(directory, target)))
    after = checkpoint.flat_state(nnx.state(load_quietly(tmp_path / "out", target)))
    for path, value in before.items():
        np.testing.assert_array_equal(np.asarray(after[path]), np.asarray(value), err_msg=path)


# ---- heads that must be refused, each with an error naming what is wrong ---------------------------

def _rename(old, new):
    return lambda config, tensors: tensors.update({new: tensors.pop(old)})


def _set_config(**fields):
    return lambda config, tensors: config.update(fields)


def _set_d2t(index, value):
    return lambda config, tensors: tensors["d2t"].__setitem__(index, value)


def _flip_t2d(config, tensors):
    tensors["t2d"][np.flatnonzero(~tensors["t2d"])[0]] = True


def _duplicate_target(config, tensors):
    tensors["d2t"][1] = tensors["d2t"][0] - 1  # draft ids 0 and 1 -> the same target id


def _float_d2t(config, tensors):
    tensors["d2t"] = tensors["d2t"].astype(np.float32)


def _drop(name):
    return lambda config, tensors: tensors.pop(name)


def _drop_d2t(config, tensors):
    del tensors["d2t"], tensors["t2d"]


@pytest.mark.parametrize("kind, edit, message", [
    # Misspelled keys (which a round trip through our own exporter could never produce).
    ("eagle-llama3", _rename("layers.0.self_attn.q_proj.weight", "layers.0.self_attn.q_prj.weight"),
     "unexpected tensor 'layers.0.self_attn.q_prj.weight'"),
    ("eagle-bias", _rename("fc.bias", "fc.biases"), "unexpected tensor 'fc.biases'"),
    ("eagle3-llama3.1", _rename("midlayer.hidden_norm.weight", "midlayer.hiden_norm.weight"),
     "unexpected tensor 'midlayer.hiden_norm.weight'"),
    ("eagle3-llama3.1", _rename("lm_head.weight", "model.lm_head.weight"), "unexpected tensor 'model.lm_head.weight'"),
    ("eagle3-llama3.1", _drop("norm.weight"), r"checkpoint lacks 1 tensors, first: \['norm.weight'\]"),
    # Heads that do not fit the target.
    ("eagle-llama3", _set_config(vocab_size=100), "head vocab_size=100, target vocab_size=101"),
    ("eagle-llama3", _set_config(hidden_size=48), "head hidden_size=48, target hidden_size=32"),
    ("eagle-llama3", _set_config(num_attention_heads=2, num_key_value_heads=1), "head head_dim=16, target head_dim=8"),
    ("eagle3-llama3.1", _set_config(vocab_size=100), "head vocab_size=100, target vocab_size=101"),
    ("eagle3-llama3.1", _set_config(target_hidden_size=48), "head target_hidden_size=48, target target_hidden_size=32"),
    ("eagle3-llama3.1", _set_config(eagle_aux_hidden_state_layer_ids=[2, 4, 8]),
     r"captures the input of target layer 8, target has layers 0\.\.7"),
    ("eagle3-llama3.1", _set_config(eagle_aux_hidden_state_layer_ids=[-1, 4, 5]), "input of target layer -1"),
    ("eagle3-llama3.1", _set_config(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 7]}),
     "input of target layer 8"),  # SGLang's count: the output of layer 7 is no layer's input
    ("eagle3-llama3.1", _set_config(eagle_aux_hidden_state_layer_ids=[2, 4, 5],
                                    eagle_config={"eagle_aux_hidden_state_layer_ids": [2, 4, 5]}),
     "two sets of feature layers"),
    ("eagle3-llama3.1", _set_config(norm_before_residual=True), "norm_before_residual"),
    # Vocabulary maps that would draft the wrong tokens.
    ("eagle3-llama3.1", _set_d2t(0, -1), r"maps draft id 0 to target id -1, outside the target vocabulary \[0, 101\)"),
    ("eagle3-llama3.1", _set_d2t(-1, 101 - (DRAFT_VOCAB - 1)), f"maps draft id {DRAFT_VOCAB - 1} to target id 101"),
    ("eagle3-llama3.1", _duplicate_target, "maps two draft ids to the same target id"),
    ("eagle3-llama3.1", _flip_t2d, r"t2d disagrees with d2t: t2d\[\d+\]=True, but d2t maps no draft id to"),
    ("eagle3-llama3.1", _float_d2t, "d2t has dtype float"),
    ("eagle3-llama3.1", _set_config(draft_vocab_size=DRAFT_VOCAB - 1),
     rf"head d2t has shape \({DRAFT_VOCAB},\), head draft_vocab_size={DRAFT_VOCAB - 1}"),
    ("eagle3-llama3.1", _drop_d2t, "lacks its d2t tensor"),
])
def test_bad_heads_are_refused_naming_the_problem(target_and_dir, published, tmp_path, capsys, kind, edit, message):
    target, target_dir = target_and_dir
    directory = published(kind, edit)[0]
    with pytest.raises(hf_files.CheckpointError, match=message):
        models.load_head(directory, target)
    code = convert_cli.main([str(directory), str(tmp_path / "out"), "--target", str(target_dir)])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and re.search(message, err) and "Traceback" not in err
    assert not (tmp_path / "out").exists()
