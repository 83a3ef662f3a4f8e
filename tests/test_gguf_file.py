"""Tests for eagle_jax.gguf_file (and the default model locator) on tiny GGUFs."""

import json
import math
import os

import gguf
import numpy as np
import pytest

from eagle_jax import default_model, gguf_file, hf_files

Q = gguf.GGMLQuantizationType
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 64, 2, 4, 2, 128, 96
HEAD_DIM = HIDDEN // HEADS
# One type per weight, so every supported encoding is exercised; rows are
# multiples of 32 as the block quantizers need.
WEIGHT_TYPES = {
    "token_embd": Q.Q8_0, "output": Q.F32, "attn_q": Q.F32, "attn_k": Q.Q4_0, "attn_v": Q.Q4_1,
    "attn_output": Q.Q5_0, "ffn_gate": Q.BF16, "ffn_up": Q.F16, "ffn_down": Q.Q5_1,
}
# Worst-case error as a fraction of max |w|: 4-bit ~1/16, 5-bit ~1/32, 8-bit ~1/256.
TOLERANCE = {Q.F32: 0, Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 1e-2, Q.Q4_0: 0.1, Q.Q4_1: 0.1,
             Q.Q5_0: 0.05, Q.Q5_1: 0.05}
GGUF_TO_HF = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def llama_cpp_permute(weight, num_heads):
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    return (weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def llama_cpp_rope_factors(head_dim, base, factor, low, high, old_context):
    """convert_hf_to_gguf.py's llama3 rope_freqs loop, verbatim in numpy."""
    factors = []
    for frequency in 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelength = 2 * math.pi / frequency
        if wavelength < old_context / high:
            factors.append(1)
        elif wavelength > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def hf_reference():
    """Random HF-layout tensors and their GGUF name and type."""
    rng = np.random.default_rng(0)
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
              "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN),
              "attn_norm": (HIDDEN,), "ffn_norm": (HIDDEN,)}
    reference = {"model.embed_tokens.weight": ("token_embd.weight", (VOCAB, HIDDEN)),
                 "model.norm.weight": ("output_norm.weight", (HIDDEN,)),
                 "lm_head.weight": ("output.weight", (VOCAB, HIDDEN))}
    for layer in range(LAYERS):
        for short, shape in shapes.items():
            reference[f"model.layers.{layer}.{GGUF_TO_HF[short]}.weight"] = (f"blk.{layer}.{short}.weight", shape)
    return {hf: (name, rng.standard_normal(shape).astype(np.float32)) for hf, (name, shape) in reference.items()}


def write_gguf(path, reference, architecture="llama", extra=None, tokenizer=False):
    """Writes `reference` as llama.cpp would: permuted q/k rows, quantized."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if tokenizer:
        tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(33, 125)] + ["he"]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
        writer.add_token_merges(["h e"])
        writer.add_chat_template(CHAT_TEMPLATE)
    for name, weight in reference.values():
        short = name.split(".")[-2]
        if short == "attn_q":
            weight = llama_cpp_permute(weight, HEADS)
        elif short == "attn_k":
            weight = llama_cpp_permute(weight, KV_HEADS)
        kind = WEIGHT_TYPES.get(short, Q.F32)
        writer.add_tensor(name, gguf.quants.quantize(weight, kind), raw_dtype=kind)
    for name, weight in (extra or {}).items():
        writer.add_tensor(name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_read_gguf_recovers_hf_tensors_and_config(tmp_path):
    reference = hf_reference()
    config, tensors = gguf_file.read_gguf(write_gguf(tmp_path / "m.gguf", reference), progress=False)
    assert set(tensors) == set(reference)
    for hf_name, (name, weight) in reference.items():
        kind = WEIGHT_TYPES.get(name.split(".")[-2], Q.F32)
        assert tensors[hf_name].shape == weight.shape and tensors[hf_name].dtype == np.float32
        error = np.abs(tensors[hf_name] - weight).max()
        assert error <= TOLERANCE[kind] * np.abs(weight).max(), (hf_name, kind.name, error)
    assert config == {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": None, "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False, "vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2,
    }


def test_missing_output_means_tied_embeddings(tmp_path):
    reference = hf_reference()
    del reference["lm_head.weight"]
    config, tensors = gguf_file.read_gguf(write_gguf(tmp_path / "m.gguf", reference), progress=False)
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in tensors


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    factors = llama_cpp_rope_factors(HEAD_DIM, 500000.0, 8.0, 1.0, 4.0, 8192)
    assert 1.0 < factors.max() and factors.min() == 1.0  # the test spans all three bands
    path = write_gguf(tmp_path / "m.gguf", hf_reference(), extra={"rope_freqs.weight": factors})
    config, tensors = gguf_file.read_gguf(path, progress=False)
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in tensors


def test_unknown_tensor_is_an_error(tmp_path):
    extra = {"blk.0.attn_q.bias": np.zeros(HIDDEN, np.float32)}
    path = write_gguf(tmp_path / "m.gguf", hf_reference(), extra=extra)
    with pytest.raises(hf_files.CheckpointError, match="blk.0.attn_q.bias"):
        gguf_file.read_gguf(path, progress=False)


def test_missing_tensor_is_an_error(tmp_path):
    reference = hf_reference()
    del reference["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(hf_files.CheckpointError, match="model.layers.1.mlp.up_proj.weight"):
        gguf_file.read_gguf(write_gguf(tmp_path / "m.gguf", reference), progress=False)


def test_other_architecture_is_an_error(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf_reference(), architecture="gpt2")
    with pytest.raises(hf_files.CheckpointError, match="gpt2"):
        gguf_file.read_gguf(path, progress=False)


def test_gguf_to_hf_dir_writes_a_complete_checkpoint(tmp_path):
    reference = hf_reference()
    path = write_gguf(tmp_path / "m.gguf", reference, tokenizer=True)
    out_dir = gguf_file.gguf_to_hf_dir(path, tmp_path / "hf", dtype="bfloat16", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["hf", "m.gguf"]  # no staging directory left behind
    config = hf_files.load_config(out_dir)
    assert config["torch_dtype"] == "bfloat16" and config["num_key_value_heads"] == KV_HEADS
    tensors = hf_files.load_tensors(out_dir, progress=False)
    assert set(tensors) == set(reference)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype.name == "bfloat16"
    generation = json.loads((out_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2}
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    with pytest.raises(FileExistsError):
        gguf_file.gguf_to_hf_dir(path, out_dir, progress=False)


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf", hf_reference())

    def interrupt(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_file, "_save_tokenizer", interrupt)
    with pytest.raises(KeyboardInterrupt):
        gguf_file.gguf_to_hf_dir(path, tmp_path / "hf", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["m.gguf"]


def test_cache_root_and_override(tmp_path, monkeypatch):
    monkeypatch.delenv("EAGLE_JAX_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.cache_root() == tmp_path / "xdg" / "eagle_jax"
    monkeypatch.setenv("EAGLE_JAX_CACHE_DIR", str(tmp_path / "cache"))
    assert default_model.cache_root() == tmp_path / "cache"
    path = write_gguf(tmp_path / "m.gguf", hf_reference(), tokenizer=True)
    monkeypatch.setenv("EAGLE_JAX_DEFAULT_GGUF", str(path))
    assert default_model.default_gguf_path() == path
    conversions = []
    convert = gguf_file.gguf_to_hf_dir
    monkeypatch.setattr(gguf_file, "gguf_to_hf_dir", lambda *a, **kw: conversions.append(a) or convert(*a, **kw))
    out_dir = default_model.default_model_dir()
    assert out_dir.parent == tmp_path / "cache" / "models" and len(conversions) == 1
    written = {name: (out_dir / name).stat().st_mtime_ns for name in os.listdir(out_dir)}
    assert default_model.default_model_dir() == out_dir
    assert len(conversions) == 1  # reused, not converted again
    assert {name: (out_dir / name).stat().st_mtime_ns for name in os.listdir(out_dir)} == written


@pytest.mark.slow
def test_default_model_converts():
    import transformers

    out_dir = default_model.default_model_dir()
    config = hf_files.load_config(out_dir)
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir)
    assert len(tokenizer) == 49152
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    tensors = hf_files.load_tensors(out_dir, progress=False)
    assert tensors["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert tensors["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536)
