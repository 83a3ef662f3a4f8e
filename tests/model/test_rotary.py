"""Rotary embeddings (`model.rotary`) against HF transformers' Llama rotary, llama3 rescaling included."""

import numpy as np
import pytest
import torch
import transformers
from transformers.models.llama import modeling_llama

from eagle_jax.model import config as config_lib
from eagle_jax.model import rotary

HEAD_DIM = 16
# A short original context, so that the interpolated band between the two wavelengths is not empty.
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def hf_rotary(rope_scaling):
    rope_scaling = dict(rope_scaling) if rope_scaling else None  # transformers writes into the dict it is given
    hf_config = transformers.LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, head_dim=HEAD_DIM,
                                         rope_theta=10000.0, rope_scaling=rope_scaling, max_position_embeddings=512)
    return hf_config, modeling_llama.LlamaRotaryEmbedding(hf_config)


@pytest.mark.parametrize("rope_scaling", [None, LLAMA3_SCALING], ids=["rope", "llama3-rope"])
def test_inverse_frequencies_and_rotation_match_hf(rope_scaling):
    hf_config, hf_embedding = hf_rotary(rope_scaling)
    cfg = config_lib.LlamaConfig.from_hf_config(hf_config.to_dict() | dict(vocab_size=10, intermediate_size=8,
                                                                             num_hidden_layers=1, num_key_value_heads=4))
    inv_freq = rotary.rope_inverse_frequencies(HEAD_DIM, cfg.rope_theta, cfg.rope_scaling)
    np.testing.assert_allclose(inv_freq, hf_embedding.inv_freq.numpy(), rtol=1e-6)

    rng = np.random.default_rng(0)
    positions = rng.integers(0, 500, (2, 5))
    q, k = rng.standard_normal((2, 2, 5, 3, HEAD_DIM)).astype(np.float32)  # [B, T, N, H] each
    cos, sin = hf_embedding(torch.zeros(1), torch.tensor(positions))
    # HF rotates [B, N, T, H] with cos and sin [B, T, H] (unsqueezed at the head axis).
    want_q, want_k = modeling_llama.apply_rotary_pos_emb(torch.tensor(q).transpose(1, 2),
                                                         torch.tensor(k).transpose(1, 2), cos, sin)
    for got, want in ((rotary.apply_rotary(q, positions, inv_freq), want_q),
                      (rotary.apply_rotary(k, positions, inv_freq), want_k)):
        # Angles up to 500 radians: float32 rounds them by ~3e-5, differently in either order of operations.
        np.testing.assert_allclose(np.asarray(got), want.transpose(1, 2).numpy(), atol=1e-4)


def test_llama3_rescaling_changes_long_wavelengths_only():
    plain = rotary.rope_inverse_frequencies(HEAD_DIM, 10000.0, None)
    scaling = config_lib.RopeScaling(**{k: v for k, v in LLAMA3_SCALING.items() if k != "rope_type"})
    scaled = rotary.rope_inverse_frequencies(HEAD_DIM, 10000.0, scaling)
    assert scaled[0] == plain[0]  # the shortest wavelength is kept
    np.testing.assert_allclose(scaled[-1], plain[-1] / scaling.factor, rtol=1e-6)  # the longest slowed by factor
