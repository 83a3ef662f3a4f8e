"""Logit processors against NumPy references written here, position by position under speculation:
penalties counting the drafts before each verified position, temperature, min-p, top-k, top-p,
and the token counts a step carries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.decode import processors
from eagle_jax.decode import sampling

V, K = 12, 3


def penalised_reference(logits, output, prompt, repetition, presence, frequency):
    """One position's logits [V] after the penalties, given the output so far (a token list) and the prompt."""
    out = np.asarray(logits, np.float64).copy()
    counts = np.bincount(np.asarray(output, np.int64), minlength=V)
    for token in range(V):
        if counts[token] or token in prompt:
            out[token] = out[token] / repetition if out[token] > 0 else out[token] * repetition
        out[token] -= frequency * counts[token] + presence * (counts[token] > 0)
    return out


def masked_reference(logits, temperature, min_p, top_k, top_p):
    """One position's logits [V] after temperature, min-p, top-k and top-p (vLLM's order), -inf where removed.

    Written as set operations on probabilities: min-p keeps p >= min_p * max p; top-k keeps tokens
    at least as likely as the k-th; top-p walks the renormalised survivors from the most likely and
    keeps tokens until their mass reaches top_p (and every token tied with the last one kept).
    """
    z = np.asarray(logits, np.float64) / (temperature if temperature > 0 else 1.0)
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    kept = probs >= min_p * probs.max()
    if top_k:
        kept &= probs >= np.sort(probs[kept])[::-1][min(top_k, kept.sum()) - 1]
    if top_p < 1:
        renormalised = np.where(kept, probs, 0) / probs[kept].sum()
        mass, last = 0.0, None
        for token in np.argsort(-renormalised, kind="stable"):
            if mass >= top_p:
                break
            mass, last = mass + renormalised[token], renormalised[token]
        kept &= renormalised >= last
    return np.where(kept, z, -np.inf)


def random_drafts(rng, batch):
    """Drafts with repeats (token 2 twice in row 0) so prefix counts above 1 are exercised."""
    drafts = rng.integers(0, V, (batch, K)).astype(np.int32)
    drafts[0] = [2, 5, 2]
    return drafts


def test_penalties_see_the_drafts_before_each_position():
    rng = np.random.default_rng(0)
    batch = 4
    logits = rng.standard_normal((batch, K + 1, V)).astype(np.float32) * 3
    prompts = [rng.integers(0, V, 5) for _ in range(batch)]
    outputs = [list(rng.integers(0, V, n)) for n in (0, 3, 6, 2)]
    outputs[1] = [2, 2, 7]  # a draft token already in the output
    drafts = random_drafts(rng, batch)
    repetition = np.array([1.3, 0.7, 1.0, 2.0], np.float32)  # < 1 rewards repeats, as HF allows
    presence = np.array([0.5, -0.4, 1.5, 0.0], np.float32)
    frequency = np.array([0.3, 0.8, -1.0, 2.0], np.float32)

    counts = processors.TokenCounts.create(jnp.asarray(np.stack(prompts), jnp.int32), jnp.full((batch,), 5, jnp.int32), V)
    padded = np.full((batch, 6), processors.NO_TOKEN, np.int32)
    for row, output in enumerate(outputs):
        padded[row, :len(output)] = output
    counts = counts.add(jnp.asarray(padded))
    got = jax.jit(processors.penalize)(jnp.asarray(logits), counts.output, counts.prompt, jnp.asarray(repetition),
                                       jnp.asarray(presence), jnp.asarray(frequency),
                                       processors.chain_prefix(jnp.asarray(drafts)))
    for row in range(batch):
        for position in range(K + 1):
            want = penalised_reference(logits[row, position], outputs[row] + list(drafts[row, :position]),
                                       prompts[row], repetition[row], presence[row], frequency[row])
            np.testing.assert_allclose(np.asarray(got[row, position]), want, rtol=1e-5, atol=1e-5)


def test_chain_prefix_lists_the_drafts_before_each_position():
    prefix = processors.chain_prefix(jnp.array([[4, 5, 6]], jnp.int32))
    n = processors.NO_TOKEN
    assert prefix.tolist() == [[[n, n, n], [4, n, n], [4, 5, n], [4, 5, 6]]]


def test_token_counts_follow_a_step():
    counts = processors.TokenCounts.create(jnp.array([[3, 3, 1, 9], [0, 0, 0, 0]], jnp.int32),
                                           jnp.array([3, 1], jnp.int32), V)
    assert np.flatnonzero(counts.prompt[0]).tolist() == [1, 3]  # 9 is past the prompt's length
    assert np.flatnonzero(counts.prompt[1]).tolist() == [0]
    counts = counts.add(jnp.array([[5], [6]], jnp.int32))
    drafts = jnp.array([[5, 7, 8], [1, 1, 2]], jnp.int32)
    counts = counts.commit(drafts, jnp.array([2, 3], jnp.int32), jnp.array([4, 1], jnp.int32))
    want = np.zeros((2, V), np.int32)
    for row, tokens in enumerate([[5, 5, 7, 4], [6, 1, 1, 2, 1]]):  # first token, accepted drafts, next token
        np.add.at(want[row], tokens, 1)
    np.testing.assert_array_equal(np.asarray(counts.output), want)


def test_emitted_ids():
    ids = processors.emitted_ids(jnp.array([[4, 5, 6], [4, 5, 6]], jnp.int32), jnp.array([1, 3], jnp.int32),
                                 jnp.array([9, 8], jnp.int32))
    n = processors.NO_TOKEN
    assert ids.tolist() == [[4, 9, n, n], [4, 5, 6, 8]]
    plain = processors.emitted_ids(jnp.zeros((2, 0), jnp.int32), jnp.zeros((2,), jnp.int32), jnp.array([9, 8]))
    assert plain.tolist() == [[9], [8]]  # a step without drafts emits its one token


def test_stop_ids_are_masked_until_min_tokens():
    """vLLM's min_tokens: a row's stop ids get -inf where it has emitted fewer than min_tokens tokens,
    position by position (a chain's position j follows num_generated + j tokens)."""
    logits = np.random.default_rng(2).standard_normal((2, K + 1, V)).astype(np.float32)
    settings = [sampling.Sampling(min_tokens=5, stop_token_ids=(3, 7)), sampling.Sampling(min_tokens=2, ignore_eos=True)]
    params = sampling.SamplingParams.stack(settings, eos_ids=(1,), stop_width=4)
    assert np.asarray(params.stop_ids).tolist() == [[1, 3, 7, -1], [-1, -1, -1, -1]]  # EOS first; row 1 ignores it
    emitted = jnp.asarray([[3, 4, 5, 6], [0, 1, 2, 3]], jnp.int32)
    got = np.asarray(processors.process(jnp.asarray(logits), params, sampling.SamplingMode.of(settings), emitted=emitted))
    for row, stops, min_tokens in ((0, [1, 3, 7], 5), (1, [], 2)):
        for position in range(K + 1):
            expected = logits[row, position].copy()
            if emitted[row, position] < min_tokens:
                expected[stops] = -np.inf
            np.testing.assert_array_equal(got[row, position], expected)
    with pytest.raises(ValueError, match="min_tokens needs"):
        processors.process(jnp.asarray(logits), params, sampling.SamplingMode(min_tokens=True))


ROWS = [  # (temperature, min_p, top_k, top_p): one batch, each row its own settings
    sampling.Sampling(temperature=1.0),
    sampling.Sampling(temperature=0.7, top_k=3),
    sampling.Sampling(temperature=1.3, top_p=0.6),
    sampling.Sampling(temperature=1.0, min_p=0.2),
    sampling.Sampling(temperature=0.9, top_k=5, top_p=0.8, min_p=0.05),
    sampling.Sampling(temperature=2.0, top_k=1),
    sampling.Sampling(temperature=0.0),  # greedy among sampled rows: logits unchanged
    sampling.Sampling(temperature=1.0, top_k=V + 5),  # above V: every token
]


def test_masks_match_the_reference_row_by_row():
    logits = np.random.default_rng(1).standard_normal((len(ROWS), 2, V)).astype(np.float32) * 2
    params, mode = sampling.SamplingParams.stack(ROWS), sampling.SamplingMode.of(ROWS)
    got = np.asarray(jax.jit(processors.process, static_argnums=2)(jnp.asarray(logits), params, mode))
    for row, settings in enumerate(ROWS):
        for position in range(2):
            if settings.greedy:
                want = logits[row, position].astype(np.float64)
            else:
                want = masked_reference(logits[row, position], settings.temperature, settings.min_p,
                                        settings.top_k, settings.top_p)
            np.testing.assert_array_equal(np.isfinite(got[row, position]), np.isfinite(want), err_msg=str(settings))
            finite = np.isfinite(want)
            np.testing.assert_allclose(got[row, position][finite], want[finite], rtol=1e-5, err_msg=str(settings))


@pytest.mark.parametrize("top_k, top_p", [(3, 1.0), (0, 0.5), (4, 0.7)])
def test_top_k_only_mode_agrees_with_the_sorting_one(top_k, top_p):
    """`lax.top_k` with a cap (no top-p in the mode) and the full sort keep the same tokens."""
    logits = jnp.asarray(np.random.default_rng(2).standard_normal((3, 4, V)), jnp.float32)
    rows = [sampling.Sampling(temperature=1.0, top_k=top_k, top_p=top_p)] * 3
    params = sampling.SamplingParams.stack(rows)
    narrow = processors.process(logits, params, sampling.SamplingMode.of(rows))
    wide = processors.process(logits, params, sampling.SamplingMode(sample=True, top_k=8, top_p=True))
    np.testing.assert_array_equal(np.asarray(narrow), np.asarray(wide))


def test_greedy_mode_without_penalties_changes_nothing():
    logits = jnp.asarray(np.random.default_rng(3).standard_normal((2, 3, V)), jnp.float32)
    rows = [sampling.Sampling(), sampling.Sampling(top_k=2)]
    got = processors.process(logits, sampling.SamplingParams.stack(rows), sampling.SamplingMode.of(rows))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(logits))


def test_penalties_need_counts():
    rows = [sampling.Sampling(presence_penalty=1.0)]
    with pytest.raises(ValueError, match="TokenCounts"):
        processors.process(jnp.zeros((1, 1, V)), sampling.SamplingParams.stack(rows), sampling.SamplingMode.of(rows))
