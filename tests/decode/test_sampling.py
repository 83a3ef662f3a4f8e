"""Token selection: temperature and top-p against a brute-force numpy reference, and sampling
that follows it (never a filtered-out token, and the right frequencies by chi-square); the
OpenAI/vLLM settings' validation, their per-row arrays and static mode, per-row draws and keys,
and logprobs."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.decode import processors
from eagle_jax.decode import sampling

V = 10
ALPHA = 1e-4  # significance of every chi-square here; seeds are fixed, so the outcome is too


def softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    z = np.asarray(logits, np.float64) / temperature
    z = np.exp(z - z.max())
    return z / z.sum()


def top_p_reference(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """softmax(logits / T) restricted to the nucleus, found by brute force over all 2^V subsets.

    The nucleus is the smallest set of tokens whose mass reaches top_p (>=; so the token whose
    mass crosses top_p is kept), taking the most probable such set; every token tied with its
    least probable member is kept as well, so the result does not depend on how ties are ordered.
    """
    probs = softmax(logits, temperature)
    if top_p >= 1:
        return probs
    subsets = np.array(list(itertools.product([0, 1], repeat=len(probs))), bool)  # [2^V, V]
    mass = subsets @ probs
    size = subsets.sum(1)
    reaching = mass >= top_p
    smallest = size == size[reaching].min()
    best = subsets[np.flatnonzero(reaching & smallest)[np.argmax(mass[reaching & smallest])]]
    kept = probs >= probs[best].min()
    return np.where(kept, probs, 0.0) / probs[kept].sum()


def random_logits(rows: int, seed: int) -> np.ndarray:
    """Distinct logits (no ties): standard normal, so nuclei hold from 1 to 9 of the 10 tokens."""
    return (np.random.default_rng(seed).standard_normal((rows, V))).astype(np.float32)


def test_top_p_one_is_plain_softmax():
    logits = random_logits(4, seed=0)
    for temperature in (0.5, 1.0, 2.0):
        got = sampling.probabilities(jnp.asarray(logits), sampling.Sampling(temperature, 1.0))
        want = np.stack([softmax(row, temperature) for row in logits])
        np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.6, 0.9, 0.99])
def test_top_p_matches_brute_force_reference(temperature, top_p):
    logits = random_logits(6, seed=1)
    got = np.asarray(sampling.probabilities(jnp.asarray(logits), sampling.Sampling(temperature, top_p)))
    for row, probs in zip(logits, got):
        want = top_p_reference(row, temperature, top_p)
        # The reference's nucleus is not within float32 rounding of a boundary, so the kept sets must agree exactly.
        ordered = np.sort(softmax(row, temperature))[::-1]
        assert np.min(np.abs(np.cumsum(ordered) - top_p)) > 1e-5
        np.testing.assert_array_equal(probs > 0, want > 0)
        np.testing.assert_allclose(probs, want, atol=1e-6)


def test_top_p_keeps_the_crossing_token_and_only_it():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = jnp.asarray(np.log(probs), jnp.float32)
    for top_p, kept in [(0.4, 1), (0.6, 2), (0.79, 2), (0.81, 3), (0.96, 4)]:
        got = np.asarray(sampling.probabilities(logits, sampling.Sampling(1.0, top_p)))
        assert np.count_nonzero(got) == kept, (top_p, got)
        np.testing.assert_allclose(got[:kept], probs[:kept] / probs[:kept].sum(), rtol=1e-5)


def test_top_p_keeps_every_token_tied_at_the_boundary():
    # Masses 0.447, three ties of 0.164, 0.060: reaching 0.7 needs the first token and two of
    # the tied ones; all three tied tokens are kept (no arbitrary tie break).
    logits = np.array([0.0, 1.0, 2.0, 1.0, 1.0], np.float32)
    got = np.asarray(sampling.probabilities(jnp.asarray(logits), sampling.Sampling(1.0, 0.7)))
    assert (got > 0).tolist() == [False, True, True, True, True]
    np.testing.assert_allclose(got, top_p_reference(logits, 1.0, 0.7), atol=1e-6)
    # A tiny top_p keeps just the most likely token.
    got = np.asarray(sampling.probabilities(jnp.asarray(logits), sampling.Sampling(0.5, 1e-6)))
    assert got.tolist() == [0.0, 0.0, 1.0, 0.0, 0.0]


def test_chi_square_p_value_matches_the_table(chi_square):
    # chi2.isf(1e-4, 5) = 25.745 (scipy). Counts off by +d and -d on two cells of expectation e
    # give the statistic 2 d^2 / e, here 25.745 with 5 degrees of freedom.
    expected = np.full(6, 2000.0)
    d = np.sqrt(25.745 * 2000.0 / 2)
    observed = expected + np.array([d, -d, 0, 0, 0, 0])
    assert chi_square(observed, expected / expected.sum()) == pytest.approx(1e-4, rel=0.01)
    with pytest.raises(AssertionError, match="probability is 0"):
        chi_square([5, 1, 0], [0.5, 0.0, 0.5])


SAMPLES = 20000


def sampled_counts(logits: np.ndarray, settings: sampling.Sampling) -> np.ndarray:
    """Token counts [rows, V] from SAMPLES draws of `select` per row of logits, all in one call."""
    batch = jnp.broadcast_to(jnp.asarray(logits), (SAMPLES,) + logits.shape)
    tokens = np.asarray(jax.jit(sampling.select, static_argnums=1)(batch, settings, jax.random.key(7)))
    assert tokens.shape == (SAMPLES, len(logits)) and tokens.dtype == np.int32
    return np.stack([np.bincount(column, minlength=V) for column in tokens.T])


@pytest.mark.parametrize("temperature, top_p", [(1.0, 0.6), (0.5, 0.9), (1.5, 0.8), (2.0, 0.5)])
def test_sampling_with_top_p_follows_the_reference(chi_square, temperature, top_p):
    """`select` never draws a filtered-out token and draws the kept ones at the reference's rates."""
    logits = random_logits(3, seed=2)  # three rows with different nuclei (3 to 7 tokens) in one call
    counts = sampled_counts(logits, sampling.Sampling(temperature, top_p))
    want = np.stack([top_p_reference(row, temperature, top_p) for row in logits])
    assert not counts[want == 0].any(), (counts, want)
    assert chi_square(counts, want) > ALPHA, (counts, (want * SAMPLES).round(1))


def test_the_check_catches_a_wrong_temperature(chi_square):
    """Drawing at 1.15 times the temperature inside the same nuclei is rejected with room to spare."""
    logits = random_logits(3, seed=2)
    want = np.stack([top_p_reference(row, 1.0, 0.6) for row in logits])
    counts = sampled_counts(logits, sampling.Sampling(1.15, 0.6))
    assert not counts[want == 0].any()  # same nuclei: only the frequencies are off
    assert chi_square(counts, want) < 1e-12


# The OpenAI/vLLM settings: validation, per-row arrays, the static mode, per-row draws, logprobs.

@pytest.mark.parametrize("settings, message", [
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.1), "min_p"),
    (dict(min_p=float("nan")), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=sampling.MAX_LOGPROBS + 1), "logprobs"),
    (dict(seed=1.5), "seed"),
    (dict(stop=""), "stop must be a non-empty string"),
    (dict(stop=["ok", ""]), "stop must be"),
    (dict(stop=[3]), "stop must be"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be"),
    (dict(stop_token_ids=list(range(sampling.MAX_STOP_TOKEN_IDS + 1))), "at most 8"),
    (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=1.5), "min_tokens"),
    (dict(n=0), "n must be"),
    (dict(n=sampling.MAX_N + 1), "n must be"),
])
def test_invalid_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        sampling.Sampling(**settings)


def test_valid_settings_at_their_limits_are_hashable():
    edge = sampling.Sampling(temperature=0.0, top_p=1.0, top_k=0, min_p=1.0, repetition_penalty=1e-3,
                             presence_penalty=-2.0, frequency_penalty=2.0, seed=2 ** 40, logprobs=sampling.MAX_LOGPROBS)
    assert hash(edge) == hash(sampling.Sampling(**vars(edge)))
    assert sampling.Sampling(temperature=0.5).greedy is False and sampling.Sampling().greedy is True
    listed = sampling.Sampling(stop=["a", "b"], stop_token_ids=[4, 2], min_tokens=3, n=2, ignore_eos=True)
    assert listed.stop == ("a", "b") and listed.stop_token_ids == (4, 2) and hash(listed)  # lists become tuples
    assert sampling.Sampling(stop="end").stop == ("end",)
    assert listed.stop_ids((2, 9)) == (4, 2) and sampling.Sampling(stop_token_ids=[2]).stop_ids((2, 9)) == (2, 9)
    assert listed.sample_seed(1) is None and sampling.Sampling(seed=5).sample_seed(0) == 5
    assert len({sampling.Sampling(seed=5).sample_seed(i) for i in range(4)}) == 4


def test_mode_of_a_batch_and_what_it_covers():
    greedy_only = sampling.SamplingMode.of([sampling.Sampling(), sampling.Sampling(top_k=5)])
    assert greedy_only == sampling.SamplingMode()  # the plain argmax program
    rows = [sampling.Sampling(), sampling.Sampling(temperature=1.0, top_k=8),
            sampling.Sampling(temperature=0.5, min_p=0.1, logprobs=3), sampling.Sampling(presence_penalty=0.5)]
    mode = sampling.SamplingMode.of(rows)
    assert mode == sampling.SamplingMode(sample=True, penalties=True, min_p=True, top_k=8, top_p=False, logprobs=3)
    assert not mode.covers(sampling.Sampling(min_tokens=2)) and sampling.SamplingMode.of(
        [sampling.Sampling(min_tokens=2)]) == sampling.SamplingMode(min_tokens=True)
    assert all(mode.covers(row) for row in rows)
    assert not mode.covers(sampling.Sampling(temperature=1.0, top_p=0.9))
    assert not mode.covers(sampling.Sampling(temperature=1.0, top_k=9))
    with pytest.raises(ValueError, match="rows \\[1\\]"):
        sampling.SamplingParams.stack([rows[0], sampling.Sampling(temperature=1.0, top_p=0.5)], mode)


def test_params_stack_the_rows_in_order():
    rows = [sampling.Sampling(temperature=0.7, top_k=4, seed=3), sampling.Sampling(top_k=9, repetition_penalty=1.2)]
    params = sampling.SamplingParams.stack(rows)
    np.testing.assert_allclose(np.asarray(params.temperature), [0.7, 0.0])
    assert np.asarray(params.top_k).tolist() == [4, 0]  # a greedy row's top-k does not apply
    np.testing.assert_allclose(np.asarray(params.repetition_penalty), [1.0, 1.2])
    assert np.asarray(params.seeded).tolist() == [True, False]
    assert np.asarray(params.greedy).tolist() == [False, True]


def test_static_probabilities_apply_top_k_and_min_p():
    logits = random_logits(3, seed=3)
    for settings in (sampling.Sampling(temperature=0.8, top_k=3), sampling.Sampling(temperature=1.2, min_p=0.2)):
        got = np.asarray(sampling.probabilities(jnp.asarray(logits), settings))
        for row, probs in zip(logits, got):
            want = softmax(row, settings.temperature)
            keep = (want >= np.sort(want)[-settings.top_k]) if settings.top_k else (want >= settings.min_p * want.max())
            want = np.where(keep, want, 0) / want[keep].sum()
            np.testing.assert_allclose(probs, want, atol=1e-6)
    with pytest.raises(ValueError, match="penalties"):
        sampling.probabilities(jnp.asarray(logits), sampling.Sampling(temperature=1.0, frequency_penalty=0.1))


def test_per_row_draws_follow_each_rows_distribution(chi_square):
    """One call, rows with different settings: sampled rows at their processed rates, greedy rows argmax."""
    rows = [sampling.Sampling(temperature=1.0, top_k=3), sampling.Sampling(temperature=0.6, min_p=0.1),
            sampling.Sampling(temperature=1.5, top_p=0.7), sampling.Sampling()]
    logits = np.broadcast_to(random_logits(len(rows), seed=4)[:, None], (len(rows), SAMPLES, V))
    params, mode = sampling.SamplingParams.stack(rows), sampling.SamplingMode.of(rows)
    processed = processors.process(jnp.asarray(logits), params, mode)
    tokens = np.asarray(jax.jit(sampling.sample)(processed, params, jax.random.key(8)))  # [rows, SAMPLES]
    assert tokens.dtype == np.int32
    want = np.asarray(sampling.distribution(processed[:, :1], params))[:, 0]  # [rows, V]
    assert (tokens[3] == np.argmax(logits[3, 0])).all()
    counts = np.stack([np.bincount(row, minlength=V) for row in tokens[:3]])
    assert not counts[want[:3] == 0].any() and (want[:3] == 0).any(axis=1).all()  # every row masks something
    assert chi_square(counts, want[:3]) > ALPHA, (counts, (want[:3] * SAMPLES).round(1))


def test_row_keys_of_seeded_rows_ignore_the_batch():
    rows = [sampling.Sampling(temperature=1.0, seed=5), sampling.Sampling(temperature=1.0)]
    params = sampling.SamplingParams.stack(rows)
    counters = jnp.array([2, 2], jnp.int32)
    draw = lambda keys: np.asarray(jax.vmap(lambda key: jax.random.uniform(key))(keys))
    a = draw(sampling.row_keys(params, jax.random.key(0), counters))
    b = draw(sampling.row_keys(params, jax.random.key(1), counters))
    assert a[0] == b[0] and a[1] != b[1]  # the seeded row's key depends on its seed alone
    c = draw(sampling.row_keys(params, jax.random.key(0), counters + 1))
    assert c[0] != a[0]  # and moves on with the counter


def test_logprobs_match_numpy():
    logits = np.random.default_rng(5).standard_normal((2, 3, V)).astype(np.float32)
    logits[1, 2, 4] = -np.inf  # a masked token: -inf log-probability, never a top alternative ahead of others
    tokens = np.array([[0, 3, 9], [1, 1, 2]], np.int32)
    result = sampling.logprobs(jnp.asarray(logits), jnp.asarray(tokens), 4)
    unused = sampling.logprobs(jnp.asarray(logits), jnp.asarray([[0, 3, processors.NO_TOKEN]] * 2, jnp.int32), 0)
    assert np.asarray(unused.token)[:, 2].tolist() == [0.0, 0.0] and np.asarray(unused.rank)[:, 2].tolist() == [0, 0]
    assert np.asarray(unused.top_ids).shape == (2, 3, 0)
    z = logits.astype(np.float64)
    top = z.max(-1, keepdims=True)
    reference = z - top - np.log(np.exp(z - top).sum(-1, keepdims=True))
    chosen = np.take_along_axis(reference, tokens[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(result.token), chosen, atol=1e-5)
    order = np.argsort(-reference, axis=-1, kind="stable")[..., :4]
    np.testing.assert_array_equal(np.asarray(result.top_ids), order)
    np.testing.assert_allclose(np.asarray(result.top), np.take_along_axis(reference, order, -1), atol=1e-5)
    rank = (reference >= np.take_along_axis(reference, tokens[..., None], -1)).sum(-1)
    np.testing.assert_array_equal(np.asarray(result.rank), rank)
