"""Token selection: temperature and top-p against a brute-force numpy reference, and sampling
that follows it (never a filtered-out token, and the right frequencies by chi-square)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
