"""Reads llama.cpp GGUF files as Hugging Face Llama checkpoints.

A GGUF holds quantized weights under llama.cpp names, with the q/k rows
permuted for llama.cpp's interleaved rotary. This module dequantizes to
float32, renames to Hugging Face keys, undoes the permutation and rebuilds a
`config.json`, so the rest of eagle_jax sees an ordinary HF checkpoint.

Before gguf's reader sees a file, every count, string length and tensor extent in its header
is checked against the file's size (`gguf_layout`).
"""

import json
import pathlib
import re
import struct

import gguf
import ml_dtypes
import numpy as np
import tqdm

from eagle_jax.io import gguf_layout
from eagle_jax.io import gguf_tokenizer
from eagle_jax.io import hf_files
from eagle_jax.io import staging

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_PATTERN = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
# llama.cpp stores llama3 rope scaling as this per-frequency factor tensor.
_ROPE_FREQS = "rope_freqs.weight"


def read_gguf(path, progress=True):
    """Reads a llama-architecture GGUF as a Hugging Face Llama checkpoint.

    Args:
        path: Path of the `.gguf` file.
        progress: Show a progress bar while dequantizing.

    Returns:
        (config, tensors): an HF Llama `config.json` dict and HF-named float32
        arrays in HF layout ([out, in] for linear weights).

    Raises:
        CheckpointError: If the file is not a llama GGUF, holds a tensor with
            no HF counterpart, or lacks a required tensor or metadata key.
    """
    return _convert(_open(path), progress)


def gguf_to_hf_dir(gguf_path, out_dir, dtype="float32", progress=True):
    """Converts a GGUF into a Hugging Face checkpoint directory.

    Writes `config.json`, `generation_config.json`, `model.safetensors` and
    the tokenizer files (with the GGUF's chat template). Everything is written
    to a sibling temporary directory first and renamed into place, so an
    interrupted conversion leaves nothing half-written.

    Args:
        gguf_path: Path of the `.gguf` file.
        out_dir: Directory to create; must not exist or be empty.
        dtype: "float32" or "bfloat16", the dtype of the saved weights.
        progress: Show a progress bar while dequantizing.

    Returns:
        The output directory as a `pathlib.Path`.
    """
    gguf_path, out_dir = pathlib.Path(gguf_path), pathlib.Path(out_dir)
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise FileExistsError(f"{out_dir} already exists and is not an empty directory")
    reader = _open(gguf_path)
    config, tensors = _convert(reader, progress)
    config["torch_dtype"] = dtype
    if dtype == "bfloat16":
        tensors = {name: array.astype(ml_dtypes.bfloat16) for name, array in tensors.items()}
    with staging.staged_directory(out_dir) as staged:
        # "format": "pt" lets transformers' from_pretrained read the file too.
        hf_files.save_tensors(tensors, staged / "model.safetensors", metadata={"format": "pt"})
        _write_json(staged / "config.json", config)
        generation = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")
                      if key in config}
        _write_json(staged / "generation_config.json", generation)
        _save_tokenizer(reader, staged, config["max_position_embeddings"])
    return out_dir


def _open(path):
    """Opens a GGUF file, turning parse failures into CheckpointError."""
    try:
        gguf_layout.check(pathlib.Path(path))
        return gguf.GGUFReader(path)
    except (OSError, ValueError, KeyError, IndexError, struct.error) as error:
        if isinstance(error, hf_files.CheckpointError):
            raise
        raise hf_files.CheckpointError(f"{path}: not a readable GGUF file ({error})") from None


def _field(reader, key, default=None):
    """Returns a metadata value, or `default` when the key is absent."""
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _integer(reader, key, default=None):
    """Returns a scalar integer metadata value; required when no default."""
    value = _field(reader, key, default)
    # A per-layer array (e.g. varying head counts) has no Llama equivalent.
    if type(value) is not int:
        raise hf_files.CheckpointError(
            f"{reader.data.filename}: metadata {key!r} is {value!r}, not an integer")
    return value


def _size(reader, key, default=None):
    """Returns a positive integer metadata value; required when no default."""
    value = _integer(reader, key, default)
    if value <= 0:
        raise hf_files.CheckpointError(f"{reader.data.filename}: metadata {key!r} is {value}, not a positive size")
    return value


def _check_layer_count(reader, num_layers):
    """Tensors must cover blocks 0..num_layers-1 exactly; checked from names, before any data is read."""
    found = {int(match.group(1)) for tensor in reader.tensors if (match := _LAYER_PATTERN.fullmatch(tensor.name))}
    if found != set(range(num_layers)):
        held = f"blocks {min(found)}..{max(found)}" if found else "no blocks"
        raise hf_files.CheckpointError(f"{reader.data.filename}: metadata llama.block_count is {num_layers}, "
                                       f"but the file holds tensors for {held}")


def _float32(reader, key, default=None):
    """Returns a float metadata value, shortest float32 form (1e-05, not 9.99999974e-06)."""
    value = _field(reader, key, default)
    if not isinstance(value, (int, float)):
        raise hf_files.CheckpointError(f"{reader.data.filename}: metadata {key!r} is {value!r}, not a number")
    return float(str(np.float32(value)))


def _convert(reader, progress):
    """Builds (HF config, HF tensors) from an open GGUF reader."""
    filename = reader.data.filename
    architecture = _field(reader, "general.architecture")
    if architecture != "llama":
        raise hf_files.CheckpointError(f"{filename}: architecture {architecture!r} is not 'llama'")
    num_heads = _size(reader, "llama.attention.head_count")
    num_kv_heads = _size(reader, "llama.attention.head_count_kv", num_heads)
    hidden_size = _size(reader, "llama.embedding_length")
    head_dim = _size(reader, "llama.attention.key_length",
                     _size(reader, "llama.rope.dimension_count", max(hidden_size // num_heads, 1)))
    _check_layer_count(reader, _size(reader, "llama.block_count"))
    tensors, rope_freqs = {}, None
    for tensor in tqdm.tqdm(reader.tensors, desc="Dequantizing", unit="tensor", disable=not progress):
        # GGUF lists dimensions fastest-first; numpy (and HF) order is the reverse.
        shape = tuple(int(dimension) for dimension in reversed(tensor.shape))
        try:
            array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
        except (NotImplementedError, ValueError) as error:
            raise hf_files.CheckpointError(f"{filename}: cannot dequantize {tensor.name} ({error})") from None
        array = np.array(array, dtype=np.float32)  # own the memory; the reader is a memmap
        if not np.isfinite(array).all():
            raise hf_files.CheckpointError(f"{filename}: tensor {tensor.name} holds NaN or Inf values")
        if tensor.name == _ROPE_FREQS:
            rope_freqs = array
            continue
        name = _hf_name(tensor.name, filename)
        if name.endswith("q_proj.weight"):
            array = _unpermute(array, num_heads)
        elif name.endswith("k_proj.weight"):
            array = _unpermute(array, num_kv_heads)
        tensors[name] = array
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "intermediate_size": _size(reader, "llama.feed_forward_length"),
        "num_hidden_layers": _size(reader, "llama.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": _size(reader, "llama.context_length"),
        "rms_norm_eps": _float32(reader, "llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": _float32(reader, "llama.rope.freq_base", 10000.0),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "lm_head.weight" not in tensors,
    }
    _check_complete(tensors, config["num_hidden_layers"], filename)
    config["vocab_size"] = tensors["model.embed_tokens.weight"].shape[0]
    config["rope_scaling"] = _rope_scaling(reader, config, rope_freqs)
    config.update(_special_tokens(reader))
    return config, tensors


def _hf_name(gguf_name, filename):
    """Maps a llama.cpp tensor name to its Hugging Face name."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_PATTERN.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"
    raise hf_files.CheckpointError(f"{filename}: unknown tensor {gguf_name!r} for a llama model")


def _unpermute(weight, num_heads):
    """Inverts convert_hf_to_gguf.py's q/k row permutation.

    llama.cpp rotates interleaved pairs while HF rotates halves, so the
    converter reorders each head's rows with
    `w.reshape(n, 2, rows // n // 2, ...).swapaxes(1, 2)`; this is its inverse.
    """
    rows = weight.shape[0]
    return (weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _check_complete(tensors, num_layers, filename):
    expected = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{layer}.{module}.weight"
        for layer in range(num_layers) for module in _LAYER_NAMES.values()]
    for name in expected:
        if name not in tensors:
            raise hf_files.CheckpointError(f"{filename}: missing tensor for {name!r}")
    if len(tensors) != len(expected) + ("lm_head.weight" in tensors):
        raise hf_files.CheckpointError(f"{filename}: tensors for layers beyond block_count {num_layers}")


def _rope_scaling(reader, config, rope_freqs):
    """Rebuilds HF `rope_scaling` from GGUF metadata or the rope_freqs tensor."""
    filename = reader.data.filename
    scaling_type = _field(reader, "llama.rope.scaling.type", "none")
    factor = _field(reader, "llama.rope.scaling.factor")
    original = _field(reader, "llama.rope.scaling.original_context_length")
    if rope_freqs is not None:
        # convert_hf_to_gguf.py keeps only the factors; it always assumes
        # Llama 3's low/high frequency factors (1, 4) and an 8192 context.
        scaling = {"rope_type": "llama3", "factor": float(rope_freqs.max()), "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": original or 8192}
        expected = _llama3_rope_factors(config["head_dim"], config["rope_theta"], scaling)
        if expected.shape != rope_freqs.shape or not np.allclose(expected, rope_freqs, rtol=1e-4):
            raise hf_files.CheckpointError(f"{filename}: {_ROPE_FREQS} is not llama3 rope scaling")
        return scaling
    if scaling_type == "none":
        return None
    if scaling_type == "linear" and factor:
        return {"rope_type": "linear", "factor": factor}
    # YaRN and LongRoPE need parameters that GGUF metadata does not carry in full.
    raise hf_files.CheckpointError(f"{filename}: unsupported rope scaling {scaling_type!r}")


def _llama3_rope_factors(head_dim, rope_theta, scaling):
    """Per-frequency divisors of llama3 rope scaling, as llama.cpp stores them."""
    inverse_frequency = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelength = 2 * np.pi / inverse_frequency
    original = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    smooth = (original / wavelength - low) / (high - low)
    factors = 1.0 / ((1.0 - smooth) / factor + smooth)
    factors = np.where(wavelength < original / high, 1.0, factors)
    return np.where(wavelength > original / low, factor, factors).astype(np.float32)


def _special_tokens(reader):
    """bos/eos/pad ids; end-of-turn ids join eos as HF's Llama 3 configs do."""
    tokens = {}
    if (bos := _field(reader, "tokenizer.ggml.bos_token_id")) is not None:
        tokens["bos_token_id"] = bos
    eos = [_field(reader, f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(token for token in eos if token is not None))
    if eos:
        tokens["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if (pad := _field(reader, "tokenizer.ggml.padding_token_id")) is not None:
        tokens["pad_token_id"] = pad
    return tokens


def _save_tokenizer(reader, out_dir, max_length):
    """Saves the GGUF's tokenizer and chat template as HF tokenizer files (no torch needed)."""
    gguf_tokenizer.save_tokenizer(reader, out_dir, max_length)


def _write_json(path, value):
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
