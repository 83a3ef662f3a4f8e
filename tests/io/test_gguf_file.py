"""Tests for eagle_jax.gguf_file (and the default model locator) on tiny GGUFs."""

import json
import math
import os

import gguf
import numpy as np
import pytest

from eagle_jax.io import default_model
from eagle_jax.io import gguf_file
from eagle_jax.io import hf_files

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


def hf_reference(ffn=FFN):
    """Random HF-layout tensors and their GGUF name and type."""
    rng = np.random.default_rng(0)
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN),
              "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
              "ffn_gate": (ffn, HIDDEN), "ffn_up": (ffn, HIDDEN), "ffn_down": (HIDDEN, ffn),
              "attn_norm": (HIDDEN,), "ffn_norm": (HIDDEN,)}
    reference = {"model.embed_tokens.weight": ("token_embd.weight", (VOCAB, HIDDEN)),
                 "model.norm.weight": ("output_norm.weight", (HIDDEN,)),
                 "lm_head.weight": ("output.weight", (VOCAB, HIDDEN))}
    for layer in range(LAYERS):
        for short, shape in shapes.items():
            reference[f"model.layers.{layer}.{GGUF_TO_HF[short]}.weight"] = (f"blk.{layer}.{short}.weight", shape)
    return {hf: (name, rng.standard_normal(shape).astype(np.float32)) for hf, (name, shape) in reference.items()}


def write_gguf(path, reference, architecture="llama", extra=None, tokenizer=False, ffn=FFN, encoded=None):
    """Writes `reference` as llama.cpp would: permuted q/k rows, quantized.

    `encoded` maps GGUF tensor names to (raw blocks, type) written instead of quantizing the reference.
    """
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(ffn)
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
        if name in (encoded or {}):
            blocks, kind = encoded[name]
            writer.add_tensor(name, blocks, raw_dtype=kind)
            continue
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


# ---- K-quants, which gguf.quants can read but not write: blocks built here from llama.cpp's spec ----
# ggml-common.h / ggml-quants.c (quantize_row_q4_K_ref, quantize_row_q6_K_ref, dequantize_row_q*_K):
#   block_q4_K (144 bytes per 256 values): f16 d, f16 dmin, 12 bytes of 6-bit scales and mins for the
#     eight 32-value sub-blocks (get_scale_min_k4), 128 bytes of 4-bit quants; y = d*sc*q - dmin*m.
#   block_q6_K (210 bytes per 256 values): 128 bytes low 4 bits, 64 bytes high 2 bits, 16 int8 scales
#     (one per 16 values), f16 d; y = d*sc*(q - 32).
QK_K = 256


def _f16(value):
    return np.float32(np.float16(value))


def encode_q4_k(weights):
    """[rows, n*256] float32 -> [rows, n*144] uint8 Q4_K blocks (a plain min/max quantizer)."""
    out = []
    for block in weights.reshape(-1, QK_K):
        subs = block.reshape(8, 32)
        mins = np.minimum(subs.min(1), 0.0)  # stored as the positive dmin*m, as llama.cpp does
        scales = (subs.max(1) - mins) / 15
        d, dmin = _f16(scales.max() / 63), _f16(-mins.min() / 63)
        sc = np.clip(np.rint(scales / d), 0, 63).astype(np.uint8)
        m = np.clip(np.rint(-mins / dmin), 0, 63).astype(np.uint8) if dmin > 0 else np.zeros(8, np.uint8)
        packed = np.zeros(12, np.uint8)
        for j in range(8):
            if j < 4:
                packed[j], packed[j + 4] = sc[j], m[j]
            else:
                packed[j + 4] = (sc[j] & 0xF) | ((m[j] & 0xF) << 4)
                packed[j - 4] |= (sc[j] >> 4) << 6
                packed[j] |= (m[j] >> 4) << 6
        levels = np.zeros((8, 32), np.uint8)
        for j in range(8):
            step = d * np.float32(sc[j])
            if step:
                levels[j] = np.clip(np.rint((subs[j] + dmin * np.float32(m[j])) / step), 0, 15)
        levels = levels.reshape(-1)
        quants = np.concatenate([levels[j:j + 32] | (levels[j + 32:j + 64] << 4) for j in range(0, QK_K, 64)])
        out.append(np.concatenate([np.float16([d, dmin]).view(np.uint8), packed, quants.astype(np.uint8)]))
    return np.stack(out).reshape(weights.shape[0], -1)


def decode_q4_k(blocks):
    """dequantize_row_q4_K, loop for loop."""
    values = []
    for block in blocks.reshape(-1, 144):
        d, dmin = block[:4].view(np.float16).astype(np.float32)
        scales, quants = block[4:16], block[16:]
        for j in range(8):
            if j < 4:
                sc, m = scales[j] & 63, scales[j + 4] & 63
            else:
                sc = (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4)
                m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)
            q = quants[32 * (j // 2):32 * (j // 2) + 32]
            q = q & 0xF if j % 2 == 0 else q >> 4
            values.append(d * np.float32(sc) * q.astype(np.float32) - dmin * np.float32(m))
    return np.concatenate(values).reshape(blocks.shape[0], -1)


def encode_q6_k(weights):
    """[rows, n*256] float32 -> [rows, n*210] uint8 Q6_K blocks (a negative d, as llama.cpp writes)."""
    out = []
    for block in weights.reshape(-1, QK_K):
        subs = block.reshape(16, 16)
        scales = np.abs(subs).max(1) / 31
        d = _f16(-scales.max() / 128)
        sc = np.clip(np.rint(scales / d), -128, 127).astype(np.int8)
        levels = np.full((16, 16), 32, np.uint8)
        for j in range(16):
            step = d * np.float32(sc[j])
            if step:
                levels[j] = np.clip(np.rint(subs[j] / step), -32, 31) + 32
        levels = levels.reshape(-1)
        low, high = np.zeros(128, np.uint8), np.zeros(64, np.uint8)
        for half in range(2):
            n, part = 128 * half, levels[128 * half:128 * half + 128]
            for l in range(32):
                low[64 * half + l] = (part[l] & 0xF) | ((part[l + 64] & 0xF) << 4)
                low[64 * half + l + 32] = (part[l + 32] & 0xF) | ((part[l + 96] & 0xF) << 4)
                high[32 * half + l] = ((part[l] >> 4) | ((part[l + 32] >> 4) << 2) | ((part[l + 64] >> 4) << 4)
                                       | ((part[l + 96] >> 4) << 6))
        out.append(np.concatenate([low, high, sc.view(np.uint8), np.float16([d]).view(np.uint8)]))
    return np.stack(out).reshape(weights.shape[0], -1)


def decode_q6_k(blocks):
    """dequantize_row_q6_K, loop for loop."""
    values = []
    for block in blocks.reshape(-1, 210):
        low, high, sc = block[:128], block[128:192], block[192:208].view(np.int8)
        d = block[208:].view(np.float16).astype(np.float32)[0]
        y = np.zeros(QK_K, np.float32)
        for half in range(2):
            ql, qh, scale = low[64 * half:], high[32 * half:], sc[8 * half:]
            for l in range(32):
                s = l // 16
                q1 = int((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32
                q2 = int((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32
                q3 = int((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32
                q4 = int((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32
                for offset, q, index in ((0, q1, s), (32, q2, s + 2), (64, q3, s + 4), (96, q4, s + 6)):
                    y[128 * half + l + offset] = d * np.float32(scale[index]) * np.float32(q)
        values.append(y)
    return np.concatenate(values).reshape(blocks.shape[0], -1)


@pytest.mark.parametrize("kind, encode, decode, tolerance", [
    (Q.Q4_K, encode_q4_k, decode_q4_k, 0.1),  # 4 bits over each sub-block's range, 6-bit scales
    (Q.Q6_K, encode_q6_k, decode_q6_k, 0.03),  # 6 bits, 8-bit scales
])
def test_k_quants_dequantize_as_llama_cpp_does(tmp_path, kind, encode, decode, tolerance):
    # K-quant blocks span 256 values of a row: ffn_down rows (FFN wide) become two blocks each.
    ffn = 2 * QK_K
    reference = hf_reference(ffn=ffn)
    encoded, expected = {}, {}
    for layer in range(LAYERS):
        hf_name = f"model.layers.{layer}.mlp.down_proj.weight"
        name, weight = reference[hf_name]
        weight = weight * np.linspace(0.1, 3.0, weight.shape[1], dtype=np.float32)  # sub-blocks of many scales
        reference[hf_name] = (name, weight)
        blocks = encode(weight)
        assert blocks.nbytes == weight.size // QK_K * gguf.GGML_QUANT_SIZES[kind][1]
        encoded[name], expected[hf_name] = (blocks, kind), decode(blocks)
        # The encoding is meaningful: the spec's decoding is close to the weights.
        assert np.abs(expected[hf_name] - weight).max() <= tolerance * np.abs(weight).max()
    if kind == Q.Q4_K:  # the packed high bits of 6-bit scales and mins are exercised
        scales = encoded["blk.0.ffn_down.weight"][0].reshape(-1, 144)[:, 4:16]
        assert (scales[:, :8] >> 6).any()
    path = write_gguf(tmp_path / "k.gguf", reference, ffn=ffn, encoded=encoded)
    config, tensors = gguf_file.read_gguf(path, progress=False)
    assert config["intermediate_size"] == ffn
    for hf_name, values in expected.items():
        assert tensors[hf_name].shape == values.shape
        np.testing.assert_allclose(tensors[hf_name], values, rtol=1e-6, atol=1e-7)


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


# ---- GGUFs whose header lies: each says what exceeds the file ----

def _patched(tmp_path, offset, layout, value, name="bad.gguf"):
    import struct

    data = bytearray(write_gguf(tmp_path / "m.gguf", hf_reference()).read_bytes())
    struct.pack_into(layout, data, offset, value)
    (tmp_path / name).write_bytes(bytes(data))
    return tmp_path / name


@pytest.mark.parametrize("offset, value, message", [
    (8, 10**9, r"claims 1000000000 tensors and \d+ metadata entries, more than a file of \d+ bytes can describe"),
    (16, 10**6, r"claims \d+ tensors and 1000000 metadata entries, more than a file"),
    (24, 10**12, r"metadata entry 0's key \(a string of length 1000000000000\) needs 1000000000000 bytes at offset 32, "
                 r"which exceeds the file"),
])
def test_counts_and_string_lengths_that_exceed_the_file_are_named(tmp_path, offset, value, message):
    path = _patched(tmp_path, offset, "<Q", value)
    with pytest.raises(hf_files.CheckpointError, match=message):
        gguf_file.read_gguf(path, progress=False)


def test_a_truncated_gguf_names_the_tensor_past_its_end(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", hf_reference())
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:-100])
    with pytest.raises(hf_files.CheckpointError, match=r"cut.gguf: tensor '[\w.]+' \(\d+ bytes at offset \d+\) extends "
                                                       r"past the end of the file"):
        gguf_file.read_gguf(tmp_path / "cut.gguf", progress=False)
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF")
    with pytest.raises(hf_files.CheckpointError, match="not a GGUF file"):
        gguf_file.read_gguf(tmp_path / "tiny.gguf", progress=False)


def test_a_block_count_beyond_the_tensors_fails_before_dequantizing(tmp_path, monkeypatch):
    reference = hf_reference()
    path = write_gguf(tmp_path / "m.gguf", reference)
    reader = gguf.GGUFReader(path)
    field = reader.get_field("llama.block_count")
    data = bytearray(path.read_bytes())
    offset = int(field.parts[field.data[0]].ctypes.data - reader.data.ctypes.data)  # where its value lies
    data[offset:offset + 4] = (200_000).to_bytes(4, "little")
    del reader, field
    (tmp_path / "many.gguf").write_bytes(bytes(data))
    monkeypatch.setattr(gguf.quants, "dequantize", lambda *args: pytest.fail("dequantized before checking"))
    with pytest.raises(hf_files.CheckpointError, match="llama.block_count is 200000, but the file holds tensors for "
                                                       "blocks 0..1"):
        gguf_file.read_gguf(tmp_path / "many.gguf", progress=False)


def test_a_zero_head_count_is_a_clear_error(tmp_path):
    reference = hf_reference()
    writer_path = tmp_path / "m.gguf"
    write_gguf(writer_path, reference)
    reader = gguf.GGUFReader(writer_path)
    field = reader.get_field("llama.attention.head_count")
    offset = int(field.parts[field.data[0]].ctypes.data - reader.data.ctypes.data)
    data = bytearray(writer_path.read_bytes())
    data[offset:offset + 4] = (0).to_bytes(4, "little")
    del reader, field
    (tmp_path / "zero.gguf").write_bytes(bytes(data))
    with pytest.raises(hf_files.CheckpointError, match="'llama.attention.head_count' is 0, not a positive size"):
        gguf_file.read_gguf(tmp_path / "zero.gguf", progress=False)


def test_a_nan_weight_in_a_gguf_is_refused_by_name(tmp_path):
    reference = hf_reference()
    name, weight = reference["model.layers.0.self_attn.q_proj.weight"]
    weight[0, 0] = np.nan
    with pytest.raises(hf_files.CheckpointError, match="tensor blk.0.attn_q.weight holds NaN or Inf values"):
        gguf_file.read_gguf(write_gguf(tmp_path / "m.gguf", reference), progress=False)
