"""Verification rules: greedy prefix matching, and rejection sampling that preserves the target distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax import acceptance

V, K, ROWS = 6, 3, 20000
# Chi-square critical values at significance 1e-4 for V - 1 = 5 degrees of freedom (scipy: chi2.isf(1e-4, 5)).
CRITICAL = 25.74


def test_greedy_on_hand_made_arrays():
    drafts = jnp.array([[5, 6, 7],   # all accepted: bonus from position 3
                        [5, 9, 7],   # second rejected: the target's token 6 there
                        [1, 6, 7],   # first rejected
                        [5, 6, 8]],  # last rejected
                       jnp.int32)
    targets = jnp.array([[5, 6, 7, 8]] * 4, jnp.int32)
    num_accepted, next_token = acceptance.greedy(drafts, targets)
    assert num_accepted.tolist() == [3, 1, 0, 2]
    assert next_token.tolist() == [8, 6, 5, 7]
    assert num_accepted.dtype == jnp.int32 and next_token.dtype == jnp.int32


def test_greedy_stops_at_the_first_mismatch():
    """A later match after a mismatch does not count (a prefix, not a total)."""
    num_accepted, next_token = acceptance.greedy(jnp.array([[9, 6, 7]], jnp.int32), jnp.array([[5, 6, 7, 8]], jnp.int32))
    assert num_accepted.tolist() == [0] and next_token.tolist() == [5]


def distributions(seed: int = 0):
    """Fixed target p [K+1, V] and draft q [K, V], deliberately far apart (q favours what p does not)."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(V), K + 1)
    q = rng.dirichlet(np.ones(V) * 0.5, K)
    q[0] = np.roll(p[0], 2)  # high draft mass where the target has little and vice versa
    return p.astype(np.float32), q.astype(np.float32)


def simulate(rule, seed: int = 1):
    """Runs one verification per row with drafts drawn from q; returns (num_accepted, next_token, drafts)."""
    p, q = distributions()
    draft_rng, accept_rng = jax.random.split(jax.random.key(seed))
    drafts = jax.random.categorical(draft_rng, jnp.log(jnp.asarray(q)), axis=-1, shape=(ROWS, K)).astype(jnp.int32)
    target_probs = jnp.broadcast_to(jnp.asarray(p), (ROWS, K + 1, V))
    draft_probs = jnp.broadcast_to(jnp.asarray(q), (ROWS, K, V))
    num_accepted, next_token = jax.jit(rule)(drafts, draft_probs, target_probs, accept_rng)
    return np.asarray(num_accepted), np.asarray(next_token), np.asarray(drafts), p


def chi_square(tokens: np.ndarray, probs: np.ndarray) -> float:
    observed = np.bincount(tokens, minlength=V)
    expected = probs * len(tokens)
    return float(np.sum((observed - expected) ** 2 / expected))


def emitted(num_accepted, next_token, drafts, position: int) -> np.ndarray:
    """The token emitted at `position` of a step, for rows that emit one there (n >= position)."""
    rows = num_accepted >= position
    return np.where(num_accepted[rows] > position, drafts[rows, min(position, K - 1)], next_token[rows])


def test_critical_value_matches_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    assert scipy_stats.chi2.isf(1e-4, V - 1) == pytest.approx(CRITICAL, abs=0.01)


def test_rejection_sampling_emits_the_target_distribution():
    num_accepted, next_token, drafts, p = simulate(acceptance.rejection)
    assert num_accepted.min() >= 0 and num_accepted.max() <= K
    assert 0 < np.mean(num_accepted == 0) < 1 and np.any(num_accepted == K)  # every branch is exercised
    # First token of the step ~ p_0.
    assert chi_square(emitted(num_accepted, next_token, drafts, 0), p[0]) < CRITICAL
    # Given the first draft was kept, the second token ~ p_1 (drafts and p are independent of
    # history here, so each position's marginal must be exactly p at that position).
    assert chi_square(emitted(num_accepted, next_token, drafts, 1), p[1]) < CRITICAL
    # And the bonus token after k accepted drafts ~ p_k.
    assert chi_square(next_token[num_accepted == K], p[K]) < 5 * CRITICAL  # few rows: a looser bound


def accept_always(drafts, draft_probs, target_probs, rng):
    """Wrong rule: keep every draft (the output is then distributed as q)."""
    batch, k = drafts.shape
    bonus = jax.random.categorical(rng, jnp.log(target_probs[:, k]), axis=-1).astype(jnp.int32)
    return jnp.full((batch,), k, jnp.int32), bonus


def resample_from_target(drafts, draft_probs, target_probs, rng):
    """Wrong rule: the right acceptance test, but on rejection resample from p instead of max(p - q, 0)."""
    correct_accepted, _ = acceptance.rejection(drafts, draft_probs, target_probs, rng)
    pick = jnp.take_along_axis(target_probs, correct_accepted[:, None, None], axis=1)[:, 0]
    return correct_accepted, jax.random.categorical(jax.random.fold_in(rng, 1), jnp.log(pick), axis=-1).astype(jnp.int32)


@pytest.mark.parametrize("rule", [accept_always, resample_from_target])
def test_the_check_catches_wrong_rules(rule):
    num_accepted, next_token, drafts, p = simulate(rule)
    assert chi_square(emitted(num_accepted, next_token, drafts, 0), p[0]) > CRITICAL
