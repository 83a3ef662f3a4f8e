"""Loading targets and EAGLE heads from any supported source, and saving the converted format.

Target sources: an HF Llama directory, a llama `.gguf`, the converted format, or a Hugging
Face hub id (`org/name`, downloaded through huggingface_hub). Heads: the public EAGLE-1 and
EAGLE-3 HF layouts (safetensors or pytorch_model.bin), from a path or a hub id.

Every config.json is checked against its checkpoint's tensor names and shapes (read from
headers) before a model is built, and every error names the directory it is about.

The converted format is a directory holding the HF `config.json`, the tokenizer files, and
`params.safetensors` whose keys are Flax parameter paths (`layers/0/self_attn/qkv_proj/kernel`,
kernels [in, out], q/k/v and gate/up fused); loading it needs no name table.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.io import checkpoint
from eagle_jax.io import default_model
from eagle_jax.io import hf_files
from eagle_jax.io import hub
from eagle_jax.io import int8_weights
from eagle_jax.io import staging
from eagle_jax.model import config as config_lib
from eagle_jax.model import eagle
from eagle_jax.model import int8_linear
from eagle_jax.model import layers
from eagle_jax.model import llama

PARAMS_FILE = "params.safetensors"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
INT8_LM_HEAD_DTYPES = ("bfloat16",)  # where a head stored with an int8 lm_head runs it as int8
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                    "chat_template.jinja", "tokenizer.model", "vocab.json", "merges.txt")


def resolve_target_dir(path: str | Path | None) -> Path:
    """A directory with config.json and tokenizer for any target source (a GGUF is converted once).

    Raises:
        FileNotFoundError: `path` does not exist and is not a hub id.
        hf_files.CheckpointError: a hub id that cannot be fetched, or a path that is no model.
    """
    if path is None:
        return default_model.default_model_dir()
    path = _local_or_hub(path, "model")
    if path.suffix == ".gguf":
        return default_model.converted_gguf_dir(path)
    if not (path / "config.json").is_file():
        raise hf_files.CheckpointError(f"{path}: not a .gguf file nor a directory with config.json")
    return path


def resolve_head_dir(path: str | Path) -> Path:
    """A head's directory (or weight file) from a path or a hub id (see `resolve_target_dir`)."""
    return _local_or_hub(path, "draft head")


def _local_or_hub(path: str | Path, what: str) -> Path:
    local = Path(path).expanduser()
    if local.exists():
        return local
    if hub.looks_like_repo_id(str(path)):
        return hub.snapshot(str(path), what)
    raise FileNotFoundError(f"{'draft' if what == 'draft head' else what} path {local} does not exist")


def target_factory(cfg: config_lib.LlamaConfig, dtype):
    return lambda: llama.Llama(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)


def random_target(config_json: str | Path, dtype: str = "float32") -> llama.Llama:
    """A target shaped by an HF config.json, with random weights: for timing, which weights do not change."""
    cfg = checkpoint.llama_config(json.loads(Path(config_json).read_text()), str(config_json))
    return target_factory(cfg, DTYPES[dtype])()


def target_or_random(path: str | Path | None, random_config: str | Path | None,
                     dtype: str = "float32") -> tuple[llama.Llama, Path | None]:
    """The target at `path`, or random weights of `random_config`'s shapes when it is given (no tokenizer then).

    Benchmarks take either: step times do not depend on the weights.
    """
    if random_config:
        return random_target(random_config, dtype), None
    return load_target(path, dtype)


def load_target(path: str | Path | None = None, dtype: str = "float32") -> tuple[llama.Llama, Path]:
    """Loads a target model.

    Returns:
        (model, directory holding its tokenizer files).

    Raises:
        hf_files.CheckpointError: the config or weights are malformed, unsafe or do not fit,
            naming the directory.
    """
    directory = resolve_target_dir(path)
    try:
        cfg = checkpoint.llama_config(hf_files.load_config(directory), "config.json")
        converted = (directory / PARAMS_FILE).is_file()
        weights = directory / PARAMS_FILE if converted else directory
        _check_target_layout(hf_files.tensor_shapes(weights), cfg, converted)
        abstract = checkpoint.abstract_model(target_factory(cfg, DTYPES[dtype]))
        if converted:
            return checkpoint.build_model(abstract, hf_files.load_tensors(weights), DTYPES[dtype]), directory
        params = checkpoint.map_tensors(hf_files.load_tensors(directory), checkpoint.LLAMA_RULES,
                                        checkpoint.param_shapes(abstract),
                                        ignored=checkpoint.LLAMA_IGNORED, optional=(r"lm_head\.weight",))
        return checkpoint.build_model(abstract, params, DTYPES[dtype], check=False), directory  # map_tensors checked
    except hf_files.CheckpointError as error:
        raise _naming(error, directory) from None


def _naming(error: hf_files.CheckpointError, directory: Path) -> hf_files.CheckpointError:
    """`error`, its message led by `directory` unless it names a path there already."""
    return error if str(directory) in str(error) else type(error)(f"{directory}: {error}")


def _check_target_layout(shapes: dict, cfg: config_lib.LlamaConfig, converted: bool) -> None:
    """The config's layer count and embedding against the checkpoint's headers, before anything is built."""
    if converted and any(name.endswith("self_attn/q_proj/kernel") for name in shapes):
        raise hf_files.CheckpointError("converted by an older eagle_jax (separate q/k/v projections); "
                                       "convert its source again with eagle-jax-convert")
    layer_pattern, embedding = (r"layers/(\d+)/", "embed_tokens/embedding") if converted else \
        (r"model\.layers\.(\d+)\.", "model.embed_tokens.weight")
    checkpoint.check_layer_count(shapes, cfg.num_layers, layer_pattern, "config.json")
    if embedding in shapes and shapes[embedding][0] != (cfg.vocab_size, cfg.hidden_size):
        raise hf_files.CheckpointError(
            f"config.json says vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}, but tensor {embedding!r} "
            f"has shape {shapes[embedding][0]}")


def save_converted(model: llama.Llama, source_dir: Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Writes the converted format: config.json, params.safetensors (Flax paths), tokenizer files.

    `out_dir` must not exist or be empty; it appears, complete, only when everything is written.
    """
    out_dir = Path(out_dir)
    params = checkpoint.model_params(model)
    params = {name: array.astype(np.dtype(DTYPES[dtype])) for name, array in params.items()}
    config = hf_files.load_config(source_dir)
    config["torch_dtype"] = dtype
    with staging.staged_directory(out_dir) as staged:
        hf_files.save_tensors(params, staged / PARAMS_FILE, metadata={"format": "eagle_jax"})
        (staged / "config.json").write_text(json.dumps(config, indent=2))
        for name in _TOKENIZER_FILES:
            if (source_dir / name).is_file():
                shutil.copy2(source_dir / name, staged / name)
    return out_dir


# ---- EAGLE heads -------------------------------------------------------------------------

EAGLE1_RULES = [
    checkpoint.Rule(r"fc\.weight", "fc/kernel", transpose=True),
    checkpoint.Rule(r"fc\.bias", "fc/bias"),
    *[dataclasses.replace(rule, target=rule.target.lstrip("/"))
      for rule in checkpoint.decoder_layer_rules(r"layers\.0", "") if "input_layernorm" not in rule.target],
]
EAGLE3_ONE_LAYER_RULES = [  # fc, norm, lm_head, d2t and the midlayer: a one-layer head whole
    checkpoint.Rule(r"fc\.weight", "fc/kernel", transpose=True),
    checkpoint.Rule(r"norm\.weight", "norm/weight"),
    checkpoint.Rule(r"lm_head\.weight", "lm_head/kernel", transpose=True),
    checkpoint.Rule(r"d2t", "d2t"),
    checkpoint.Rule(r"midlayer\.hidden_norm\.weight", "midlayer/hidden_norm/weight"),
    *checkpoint.decoder_layer_rules(r"midlayer", "midlayer"),
]


def eagle3_rules(num_layers: int) -> list[checkpoint.Rule]:
    """An EAGLE-3 head's rules: the midlayer, then plain decoder layers `layers.1..` (vLLM's
    names: it reads `midlayer.*` as `layers.0.*`), held as `layers/0..` in the head."""
    return EAGLE3_ONE_LAYER_RULES + [rule for index in range(1, num_layers)
                                     for rule in checkpoint.decoder_layer_rules(rf"layers\.{index}", f"layers/{index - 1}")]


def head_rules(cfg: eagle.EagleConfig) -> list[checkpoint.Rule]:
    return eagle3_rules(cfg.num_layers) if cfg.method == "eagle3" else EAGLE1_RULES


# EAGLE-1's layer 0 skips its input norm (saved anyway by SafeAILab); t2d is derivable from d2t;
# embed_tokens is the target's (checked separately).
HEAD_IGNORED = (r"layers\.0\.input_layernorm\.weight", r"t2d", r"embed_tokens\.weight", r".*rotary_emb\.inv_freq")


def head_config(hf_config: dict, tensor_names: set[str], target: config_lib.LlamaConfig) -> eagle.EagleConfig:
    """Detects the head kind from config and keys, and checks it fits the target."""
    architectures = " ".join(hf_config.get("architectures") or [])
    is_eagle3 = "Eagle3" in architectures or any(name.startswith("midlayer.") for name in tensor_names)
    if not is_eagle3 and "fc.weight" not in tensor_names:
        raise hf_files.CheckpointError("not an EAGLE head: no fc.weight and no midlayer.* tensors")
    layer_hf = dict(hf_config, num_hidden_layers=1)
    layer_hf.setdefault("max_position_embeddings", target.max_position_embeddings)
    layer = checkpoint.llama_config(layer_hf, "config.json")
    for field in ("draft_vocab_size", "target_hidden_size"):
        value = hf_config.get(field)
        if value is not None and (type(value) is not int or value <= 0):
            raise hf_files.CheckpointError(f"config.json: {field} is {value!r}, expected a positive integer")
    checks = [("hidden_size", layer.hidden_size, target.hidden_size), ("vocab_size", layer.vocab_size, target.vocab_size)]
    if is_eagle3:
        if hf_config.get("norm_before_residual"):
            # vLLM's variant keeps hidden_norm(g), not g, as the residual: other math, same keys.
            raise hf_files.CheckpointError("head sets norm_before_residual, an EAGLE-3 variant not implemented here")
        cfg = eagle.EagleConfig(method="eagle3", layer=layer,
                                draft_vocab_size=int(hf_config.get("draft_vocab_size") or layer.vocab_size),
                                target_hidden_size=int(hf_config.get("target_hidden_size") or target.hidden_size),
                                feature_layers=feature_layers(hf_config, target.num_layers),
                                num_layers=int(hf_config.get("num_hidden_layers") or 1))
        checks.append(("target_hidden_size", cfg.target_hidden_size, target.hidden_size))
    else:
        cfg = eagle.EagleConfig(method="eagle", layer=layer, fc_bias="fc.bias" in tensor_names or bool(hf_config.get("bias")))
        checks.append(("head_dim", layer.head_dim, target.head_dim))
    for name, head_value, target_value in checks:
        if head_value != target_value:
            raise hf_files.CheckpointError(f"head does not fit target: head {name}={head_value}, target {name}={target_value}")
    return cfg


def feature_layers(hf_config: dict, num_target_layers: int) -> tuple[int, ...]:
    """The target layers whose inputs an EAGLE-3 head reads, from its config.

    Two spellings count differently: vLLM's top-level `eagle_aux_hidden_state_layer_ids` names
    layer inputs (id j = input of layer j, as here); SGLang's and SpecForge's
    `eagle_config.eagle_aux_hidden_state_layer_ids` names layer outputs (id i = output of layer
    i = input of layer i + 1). Neither: vLLM's and SGLang's default, inputs of (2, L//2, L-3).
    """
    top = hf_config.get("eagle_aux_hidden_state_layer_ids")
    nested = (hf_config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    from_nested = tuple(int(i) + 1 for i in nested) if nested else None
    if top and from_nested and tuple(int(i) for i in top) != from_nested:
        raise hf_files.CheckpointError(
            f"head config names two sets of feature layers: eagle_aux_hidden_state_layer_ids={list(top)} (layer "
            f"inputs) and eagle_config.eagle_aux_hidden_state_layer_ids={list(nested)} (layer outputs)")
    layers_read = tuple(int(i) for i in top) if top else from_nested or eagle.default_feature_layers(num_target_layers)
    outside = [index for index in layers_read if not 0 <= index < num_target_layers]
    if outside:
        raise hf_files.CheckpointError(f"head captures the input of target layer {outside[0]}, "
                                       f"target has layers 0..{num_target_layers - 1}")
    return layers_read


def load_head(path: str | Path, target: llama.Llama, dtype: str = "float32", param_dtype: str | None = None):
    """Loads an EAGLE-1 or EAGLE-3 head in its public HF layout for `target`.

    `dtype` is the compute dtype; parameters are stored in `param_dtype` (default: the same).
    Training from a head keeps float32 parameters under bf16 compute, as `train.new_head` does.
    An EAGLE-3 lm_head stored as int8 (`int8_weights`) runs as int8 in a bfloat16 head
    (`int8_linear.Int8Linear`), and is widened otherwise.
    """
    path = resolve_head_dir(path)
    try:
        stored = hf_files.load_tensors(path)
        head = head_from_tensors(int8_weights.dequantize(stored), hf_files.load_config(path if path.is_dir() else path.parent),
                                 target, dtype, param_dtype)
    except hf_files.CheckpointError as error:
        raise _naming(error, path) from None
    return _int8_lm_head(head, stored) if dtype in INT8_LM_HEAD_DTYPES and param_dtype in (None, dtype) else head


def _int8_lm_head(head, stored: dict):
    """`head` running its lm_head as stored, when that is int8 with its scales (`int8_linear`).

    Only heads computing and holding their parameters in 16 bits (inference): there a draft reads
    half the bytes, and the logits are the stored weight's own. Float32 heads (training, parity
    checks) keep the widened weight, as `int8_weights.dequantize` gives it.
    """
    weight, scale = stored.get("lm_head.weight"), stored.get("lm_head.weight" + int8_weights.SCALE_SUFFIX)
    if head.config.method != "eagle3" or scale is None or np.asarray(weight).dtype != np.int8:
        return head
    head.lm_head = int8_linear.Int8Linear(jnp.asarray(np.asarray(weight).T),  # [in, out], nnx.Linear's layout
                                          jnp.asarray(np.asarray(scale, np.float32).reshape(-1)),
                                          head.lm_head.dtype)
    return head


def head_from_tensors(tensors: dict, config: dict, target: llama.Llama, dtype: str = "float32",
                      param_dtype: str | None = None):
    """`load_head` on tensors already read (int8-stored weights widened) and the head's config.json.

    Raises:
        hf_files.CheckpointError: the head does not fit `target`.
    """
    cfg = head_config(config, set(tensors), target.config)
    if cfg.method == "eagle3":  # before building: a config may claim any number of layers
        checkpoint.check_layer_count(tensors, cfg.num_layers, r"layers\.(\d+)\.", "config.json", offset=1)
    if "embed_tokens.weight" in tensors:
        _check_embeddings(np.asarray(tensors["embed_tokens.weight"], np.float32), target)
    if cfg.method == "eagle3":
        tensors = _check_vocab_map(tensors, cfg, target.config.vocab_size)
    stored = DTYPES[param_dtype or dtype]
    factory = lambda: eagle.make_head(cfg, rngs=nnx.Rngs(0), dtype=DTYPES[dtype], param_dtype=stored)
    abstract = checkpoint.abstract_model(factory)
    params = checkpoint.map_tensors(tensors, head_rules(cfg), checkpoint.param_shapes(abstract), ignored=HEAD_IGNORED)
    return checkpoint.build_model(abstract, params, stored, check=False)  # map_tensors checked the values


def _check_embeddings(embeddings: np.ndarray, target: llama.Llama) -> None:
    target_embeddings = np.asarray(target.embed_tokens.embedding[...], np.float32)
    if embeddings.shape != target_embeddings.shape:
        raise hf_files.CheckpointError(
            f"head does not fit target: head embed_tokens {embeddings.shape}, target embed_tokens {target_embeddings.shape}")
    scale = float(np.abs(target_embeddings).mean()) or 1.0
    if float(np.abs(embeddings - target_embeddings).mean()) > 0.1 * scale:
        warnings.warn("the head's embed_tokens differ from the target's; the target's embeddings are used")


def _check_vocab_map(tensors: dict, cfg: eagle.EagleConfig, vocab_size: int) -> dict:
    """Checks d2t (and t2d, when saved) against the vocabularies; returns the tensors with an int32 d2t."""
    if "d2t" not in tensors:
        if cfg.draft_vocab_size != vocab_size:
            raise hf_files.CheckpointError(
                f"EAGLE-3 head lacks its d2t tensor (draft_vocab_size={cfg.draft_vocab_size}, vocab_size={vocab_size})")
        # SafeAILab drops d2t and t2d when the draft vocabulary is the whole one: the identity map.
        tensors = dict(tensors, d2t=np.zeros((vocab_size,), np.int64))
    d2t = np.asarray(tensors["d2t"])
    if not np.issubdtype(d2t.dtype, np.integer):
        raise hf_files.CheckpointError(f"head d2t has dtype {d2t.dtype}, expected integer offsets")
    d2t = d2t.astype(np.int64)
    if d2t.shape != (cfg.draft_vocab_size,):
        raise hf_files.CheckpointError(f"head d2t has shape {d2t.shape}, head draft_vocab_size={cfg.draft_vocab_size}")
    mapped = np.arange(len(d2t)) + d2t
    outside = np.flatnonzero((mapped < 0) | (mapped >= vocab_size))
    if outside.size:
        draft_id = int(outside[0])
        raise hf_files.CheckpointError(f"head d2t maps draft id {draft_id} to target id {int(mapped[draft_id])}, "
                                       f"outside the target vocabulary [0, {vocab_size})")
    if len(np.unique(mapped)) != len(mapped):
        raise hf_files.CheckpointError("head d2t maps two draft ids to the same target id")
    if "t2d" in tensors:
        t2d = np.asarray(tensors["t2d"])
        if t2d.shape != (vocab_size,):
            raise hf_files.CheckpointError(f"head t2d has shape {t2d.shape}, target vocab_size={vocab_size}")
        expected = np.zeros((vocab_size,), bool)
        expected[mapped] = True
        wrong = np.flatnonzero(t2d.astype(bool) != expected)
        if wrong.size:
            raise hf_files.CheckpointError(
                f"head t2d disagrees with d2t: t2d[{int(wrong[0])}]={bool(t2d[wrong[0]])}, but d2t "
                f"{'maps a draft id to' if expected[wrong[0]] else 'maps no draft id to'} target id {int(wrong[0])}")
    return dict(tensors, d2t=d2t.astype(np.int32))


def export_head(head, target_config: config_lib.LlamaConfig, out_dir: str | Path, dtype: str = "bfloat16") -> Path:
    """Writes a head in its public HF layout (config.json + model.safetensors), the inverse of `load_head`.

    The key names and config fields follow yuhuili/EAGLE-LLaMA3.1-Instruct-8B (EAGLE-1) and
    yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (EAGLE-3), so vLLM and SGLang load the result too. One
    difference: EAGLE-1 files there also hold a frozen copy of the target's `embed_tokens.weight`;
    it is not written here, as the head uses the target's (and those loaders take it when absent).
    """
    cfg = head.config
    params = checkpoint.flat_state(nnx.state(head))
    layer = cfg.layer
    fused_sizes = {"qkv_proj": layers.qkv_sizes(layer), "gate_up_proj": layers.gate_up_sizes(layer)}
    tensors = {}
    for rule in head_rules(cfg):
        if rule.target in params:
            array = np.asarray(params[rule.target])
            if rule.part is not None:
                array = checkpoint.split_parts(array, fused_sizes[rule.target.split("/")[-2]])[rule.part]
            if np.issubdtype(array.dtype, np.floating):
                array = array.astype(np.dtype(DTYPES[dtype]))
            tensors[checkpoint.hf_name(rule, {})] = array.T if rule.transpose else array
    config = dict(
        architectures=["LlamaForCausalLMEagle3" if cfg.method == "eagle3" else "LlamaForCausalLM"],
        model_type="llama", hidden_act="silu", num_hidden_layers=cfg.num_layers, torch_dtype=dtype,
        hidden_size=layer.hidden_size, intermediate_size=layer.intermediate_size,
        num_attention_heads=layer.num_heads, num_key_value_heads=layer.num_kv_heads, head_dim=layer.head_dim,
        rms_norm_eps=layer.rms_norm_eps, rope_theta=layer.rope_theta, vocab_size=layer.vocab_size,
        max_position_embeddings=layer.max_position_embeddings, tie_word_embeddings=False,
        bos_token_id=target_config.bos_token_id, eos_token_id=list(target_config.eos_token_ids),
    )
    if layer.rope_scaling is not None:  # Llama 3.1 heads carry the target's llama3 scaling
        scaling = layer.rope_scaling
        config["rope_scaling"] = dict(rope_type="llama3", factor=scaling.factor, low_freq_factor=scaling.low_freq_factor,
                                      high_freq_factor=scaling.high_freq_factor,
                                      original_max_position_embeddings=scaling.original_max_position_embeddings)
    if cfg.method == "eagle3":
        d2t = tensors["d2t"].astype(np.int64)
        t2d = np.zeros((target_config.vocab_size,), bool)
        t2d[np.arange(len(d2t)) + d2t] = True
        tensors.update(d2t=d2t, t2d=t2d)
        config.update(draft_vocab_size=cfg.draft_vocab_size, target_hidden_size=cfg.target_hidden_size,
                      eagle_aux_hidden_state_layer_ids=list(cfg.feature_layers))
    else:
        config["bias"] = cfg.fc_bias
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_files.save_tensors(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    with staging.staged_file(out_dir / "config.json") as temporary:
        temporary.write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
