"""Token selection: greedy, temperature and top-p (nucleus) sampling.

`Sampling` is a frozen dataclass passed to jit as a static argument: greedy and sampled
decoding are different programs, and a user rarely changes these between prompts.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probabilities(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """The distribution tokens are drawn from: softmax(logits / T), truncated to the top-p nucleus.

    Args:
        logits: [..., V] float32.
    Returns:
        [..., V] float32 probabilities summing to 1.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32) / sampling.temperature, axis=-1)
    if sampling.top_p >= 1:
        return probs
    ordered = jnp.sort(probs, axis=-1)[..., ::-1]
    # Keep the smallest prefix whose mass reaches top_p: a token is kept while the mass
    # *before* it is still below top_p (so the most likely token is always kept).
    mass_before = jnp.cumsum(ordered, axis=-1) - ordered
    kept = jnp.sum(mass_before < sampling.top_p, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(ordered, kept - 1, axis=-1)
    probs = jnp.where(probs >= threshold, probs, 0.0)
    return probs / jnp.sum(probs, axis=-1, keepdims=True)


def sample_from(probs: jax.Array, rng: jax.Array) -> jax.Array:
    """Draws one int32 token per row from probabilities [..., V]."""
    return jax.random.categorical(rng, jnp.log(probs), axis=-1).astype(jnp.int32)


def select(logits: jax.Array, sampling: Sampling, rng: jax.Array) -> jax.Array:
    """Next token per row, int32 (argmax would give int64 under x64; ids stay int32 everywhere)."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return sample_from(probabilities(logits, sampling), rng)
