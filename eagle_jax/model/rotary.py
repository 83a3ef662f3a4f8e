"""Rotary position embeddings: inverse frequencies (with llama3's long-context rescaling) and
their rotate-half application.

Rotate-half is HF's convention, so HF's q/k weights load without a permutation. The frequencies
are numpy, not traced values: a module keeps its rope settings as static, hashable attributes
and recomputes them at trace time, so they fold into the compiled program as constants.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.model import config as config_lib


def rope_inverse_frequencies(head_dim: int, theta: float, scaling: config_lib.RopeScaling | None) -> np.ndarray:
    """Rotary inverse frequencies [H/2], with the `llama3` long-context rescaling when given."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv_freq.astype(np.float32)
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    between = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(between, interpolated, scaled).astype(np.float32)


def apply_rotary(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half rotary embedding (HF convention, so q/k weights need no permutation).

    Args:
        x: [B, T, N, H] queries or keys.
        positions: [B, T] int32 absolute positions.
        inv_freq: [H/2] inverse frequencies.
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)
