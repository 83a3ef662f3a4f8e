"""Verification rules: greedy prefix matching, and rejection sampling that preserves the target distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.decode import acceptance

V, K, ROWS = 6, 3, 200_000
ALPHA = 1e-4  # significance of every chi-square below; seeds are fixed, so the outcome is too


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
    """A target p and a draft q that depend on position and on the previous token, as real ones do.

    p[j, a] [K+1, V, V] is the target at draft position j after token a (position 0 follows a
    fixed context token 0); q[j, a] [K, V, V] the draft there. q is 30% p and 70% noise, so
    drafts are accepted 35% to 83% of the time (60% on average); p gives some tokens no mass at all
    (as top-p does) while q still drafts them, and q never drafts some tokens p wants (as an
    EAGLE-3 draft vocabulary does): only the residual max(p - q, 0) can emit those.
    """
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.ones(V), (K + 1, V))
    p[rng.random((K + 1, V, V)) < 0.15] = 0.0
    p[..., 0] += 0.05  # no row is left empty
    q = 0.3 * p[:K] + 0.7 * rng.dirichlet(np.ones(V) * 0.5, (K, V))
    q[..., 1] = 0.0
    p, q = p / p.sum(-1, keepdims=True), q / q.sum(-1, keepdims=True)
    return p.astype(np.float32), q.astype(np.float32)


def draw_drafts(q: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Drafts [ROWS, K] drawn one position at a time, each from q at the previous draft."""
    drafts = np.zeros((ROWS, K), np.int32)
    previous = np.zeros(ROWS, np.int64)
    for j in range(K):
        cdf = np.cumsum(q[j, previous], axis=-1)
        drafts[:, j] = np.minimum((cdf < rng.random((ROWS, 1)) * cdf[:, -1:]).sum(-1), V - 1)
        previous = drafts[:, j]
    return drafts


def simulate(rule, seed: int = 1):
    """One verification per row, drafts drawn from q; p and q at each position follow the row's drafts.

    Returns (num_accepted [ROWS], next_token [ROWS], drafts [ROWS, K], p).
    """
    p, q = distributions()
    drafts = draw_drafts(q, np.random.default_rng(seed))
    previous = np.concatenate([np.zeros((ROWS, 1), np.int32), drafts], axis=1)  # [ROWS, K+1]
    target_probs = p[np.arange(K + 1), previous]  # [ROWS, K+1, V]: p_j given the drafts before j
    draft_probs = q[np.arange(K), previous[:, :K]]  # [ROWS, K, V]
    num_accepted, next_token = jax.jit(rule)(jnp.asarray(drafts), jnp.asarray(draft_probs),
                                             jnp.asarray(target_probs), jax.random.key(seed))
    return np.asarray(num_accepted), np.asarray(next_token), drafts, p


def emitted(num_accepted, next_token, drafts, position: int):
    """(previous token, token emitted at `position`) for the rows whose first `position` drafts were accepted.

    The token is the accepted draft there, the correction after a rejection there, or, at
    position K, the bonus token.
    """
    rows = num_accepted >= position
    previous = np.zeros(rows.sum(), np.int32) if position == 0 else drafts[rows, position - 1]
    token = next_token[rows]
    if position < K:
        token = np.where(num_accepted[rows] > position, drafts[rows, position], token)
    return previous, token


def position_p_value(chi_square, outcome, position: int) -> float:
    """Chi-square p-value of the tokens emitted at `position` against p there given the previous token."""
    num_accepted, next_token, drafts, p = outcome
    previous, token = emitted(num_accepted, next_token, drafts, position)
    counts = np.zeros((V, V))
    np.add.at(counts, (previous, token), 1)
    return chi_square(counts, p[position])  # one multinomial per previous token


def test_rejection_sampling_emits_the_target_distribution_at_every_position(chi_square):
    outcome = num_accepted, next_token, drafts, p = simulate(acceptance.rejection)
    assert num_accepted.dtype == np.int32 and next_token.dtype == np.int32
    assert num_accepted.min() >= 0 and num_accepted.max() <= K
    for position in range(K + 1):
        reached = num_accepted >= position
        if position < K:  # both branches ran often at every draft position
            accepts, rejects = np.sum(num_accepted > position), np.sum(num_accepted == position)
            assert accepts > 0.2 * reached.sum() and rejects > 0.2 * reached.sum(), (position, accepts, rejects)
        assert reached.sum() > 10_000  # K = 3 accepted drafts, hence bonus tokens, included
        assert position_p_value(chi_square, outcome, position) > ALPHA, position


def test_rejection_keeps_every_draft_when_draft_and_target_agree():
    """q == p: min(1, p / q) = 1, so no draft is ever rejected (and no empty residual is sampled)."""
    drafts = jnp.array([[0, 2, 3], [4, 4, 5]], jnp.int32)
    probs = jnp.asarray(np.random.default_rng(0).dirichlet(np.ones(V), (2, K + 1)), jnp.float32)
    num_accepted, _ = acceptance.rejection(drafts, probs[:, :K], probs, jax.random.key(0))
    assert num_accepted.tolist() == [K, K]


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


def residual_of_first_position(drafts, draft_probs, target_probs, rng):
    """Wrong rule, right at position 0 only: every correction subtracts the first position's q."""
    num_accepted, _ = acceptance.rejection(drafts, draft_probs, target_probs, rng)
    p_next = jnp.take_along_axis(target_probs, num_accepted[:, None, None], axis=1)[:, 0]
    q_first = jnp.where((num_accepted < drafts.shape[1])[:, None], draft_probs[:, 0], 0.0)
    residual = jnp.maximum(p_next - q_first, 0.0)
    return num_accepted, jax.random.categorical(jax.random.fold_in(rng, 2), jnp.log(residual), axis=-1).astype(jnp.int32)


def bonus_from_last_draft_position(drafts, draft_probs, target_probs, rng):
    """Wrong rule, wrong only for the bonus token: drawn from p at position k-1 instead of k."""
    num_accepted, next_token = acceptance.rejection(drafts, draft_probs, target_probs, rng)
    k = drafts.shape[1]
    bonus = jax.random.categorical(jax.random.fold_in(rng, 3), jnp.log(target_probs[:, k - 1]), axis=-1)
    return num_accepted, jnp.where(num_accepted == k, bonus.astype(jnp.int32), next_token)


@pytest.mark.parametrize("rule, wrong_at", [(accept_always, 0), (resample_from_target, 0),
                                            (residual_of_first_position, 1), (bonus_from_last_draft_position, K)])
def test_the_check_catches_wrong_rules(chi_square, rule, wrong_at):
    """Each wrong rule fails the check by a wide margin, first at the position where it goes wrong."""
    outcome = simulate(rule)
    for position in range(wrong_at):
        assert position_p_value(chi_square, outcome, position) > ALPHA, position
    try:
        assert position_p_value(chi_square, outcome, wrong_at) < 1e-12
    except AssertionError as error:  # or it emitted a token the target gives no mass
        assert "probability is 0" in str(error)
