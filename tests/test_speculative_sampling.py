"""Sampled speculative decoding end to end: the token drawn by a speculative step is distributed
as the target's (temperature 1), for EAGLE-1 and EAGLE-3 heads that disagree with the target."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax import engine
from eagle_jax import sampling

ROWS = 4096
CRITICAL = {7: 24.32}  # chi-square, p = 0.001


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_second_token_follows_target_distribution(random_target, random_head, method):
    target = random_target(vocab_size=8, hidden_size=32, num_layers=2, eos_token_id=None)
    head = random_head(target.config, method, seed=3, draft_vocab_size=6)
    generator = engine.Engine(target, head, num_speculative_tokens=2, batch_size=ROWS, max_length=32)
    prompt = np.array([1, 4, 2, 7, 3], np.int32)
    results = generator.generate([prompt] * ROWS, max_new_tokens=2, seed=11,
                                 sampling=sampling.Sampling(temperature=1.0))
    tokens = np.array([r.token_ids[:2] for r in results])  # token 0 from prefill, token 1 from a speculative step
    first = np.bincount(tokens[:, 0], minlength=8).argmax()
    chosen = tokens[tokens[:, 0] == first, 1]
    # The target's exact distribution of the second token given the prompt and that first token.
    sequence = jnp.asarray(np.append(prompt, first)[None])
    positions = jnp.arange(sequence.shape[1], dtype=jnp.int32)[None]
    hidden, _, _ = target(sequence, positions, target.init_cache(1, 32))
    expected = np.asarray(jax.nn.softmax(target.logits(hidden)[0, -1])) * len(chosen)
    observed = np.bincount(chosen, minlength=8)
    statistic = float(((observed - expected) ** 2 / np.maximum(expected, 1e-9)).sum())
    assert len(chosen) > 500
    assert statistic < CRITICAL[7], (observed, expected.round(1))
    assert results[0].stats["num_drafts"] == 1  # the second token really came from a speculative step
