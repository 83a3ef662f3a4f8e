"""Verification rules: greedy prefix matching, and rejection sampling that preserves the target
distribution, raw or processed (top-k, min-p, top-p, penalties that count the drafts before each
position), with greedy rows exact under penalties and seeded rows independent of their batch."""

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


# Rejection sampling under processors: the target's processed distribution is what comes out.

from eagle_jax.decode import processors  # noqa: E402
from eagle_jax.decode import sampling  # noqa: E402
from tests.decode import test_processors as references  # noqa: E402  (the NumPy references)

PROMPT, HISTORY = [0, 4], [1, 1, 3]  # every row's prompt and its output before this step


def processed_reference(logits: np.ndarray, prefix: tuple, settings: sampling.Sampling,
                        history: list = HISTORY) -> np.ndarray:
    """The target's processed distribution [V] after history + prefix, by the NumPy references."""
    z = references.penalised_reference(np.pad(logits, (0, references.V - V), constant_values=-1e9),
                                       list(history) + list(prefix), PROMPT, settings.repetition_penalty,
                                       settings.presence_penalty, settings.frequency_penalty)[:V]
    if settings.greedy:
        return np.eye(V)[np.argmax(z)]
    z = references.masked_reference(z, settings.temperature, settings.min_p, settings.top_k, settings.top_p)
    probs = np.exp(z - z.max())
    return probs / probs.sum()


def processed_step(seed: int, settings: list[sampling.Sampling], histories: np.ndarray | None = None):
    """One speculative step per row under per-row settings: drafts drawn from the draft's processed q,
    verified against the target's processed p (both counting the row's history, HISTORY unless
    `histories` [rows, n] says otherwise, and the drafts before each position).

    Target and draft logits depend on the position and the previous token ([K+1, V, V] and
    [K, V, V], different draws); the penalties make p depend on the whole prefix.
    Returns (num_accepted, next_token, drafts, target logits [K+1, V, V]).
    """
    rng = np.random.default_rng(seed)
    target_logits = (rng.standard_normal((K + 1, V, V)) * 1.5).astype(np.float32)
    draft_logits = (0.5 * target_logits[:K] + rng.standard_normal((K, V, V))).astype(np.float32)
    rows = len(settings)
    params, mode = sampling.SamplingParams.stack(settings), sampling.SamplingMode.of(settings)
    counts = processors.TokenCounts.create(jnp.asarray([PROMPT] * rows, jnp.int32), jnp.full((rows,), 2, jnp.int32), V)
    counts = counts.add(jnp.asarray([HISTORY] * rows if histories is None else histories, jnp.int32))

    @jax.jit
    def step(key, params, counts):  # arguments, not constants: [rows] arrays stay out of the program
        draft_key, accept_key = jax.random.split(key)
        drafts = jnp.full((rows, K), processors.NO_TOKEN, jnp.int32)
        previous, draft_probs = jnp.zeros((rows,), jnp.int32), []
        for j, step_key in enumerate(jax.random.split(draft_key, K)):
            logits = processors.process(jnp.asarray(draft_logits)[j, previous][:, None], params, mode, counts,
                                        prefix=drafts[:, None])  # [rows, 1, V]
            draft_probs.append(sampling.distribution(logits, params)[:, 0])
            previous = sampling.sample(logits, params, step_key)[:, 0]
            drafts = drafts.at[:, j].set(previous)
        before = jnp.concatenate([jnp.zeros((rows, 1), jnp.int32), drafts], axis=1)  # [rows, K+1]
        logits = jnp.asarray(target_logits)[jnp.arange(K + 1), before]  # [rows, K+1, V]
        processed = processors.process(logits, params, mode, counts, prefix=processors.chain_prefix(drafts))
        draft_probs = jnp.stack(draft_probs, axis=1) if mode.sample else None
        return drafts, acceptance.verify(drafts, draft_probs, processed, params, mode, accept_key)

    drafts, (num_accepted, next_token) = step(jax.random.key(seed), params, counts)
    return np.asarray(num_accepted), np.asarray(next_token), np.asarray(drafts), target_logits


PROCESSED_CASES = {
    "top_k": sampling.Sampling(temperature=1.0, top_k=3),
    "min_p": sampling.Sampling(temperature=0.8, min_p=0.15),
    "penalties": sampling.Sampling(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.5,
                                   frequency_penalty=0.4),
    "all": sampling.Sampling(temperature=1.2, top_k=4, top_p=0.9, min_p=0.05, repetition_penalty=0.8,
                             frequency_penalty=0.3),
}
PROCESSED_ROWS = 60_000


@pytest.mark.parametrize("case", list(PROCESSED_CASES))
def test_rejection_emits_the_processed_target_at_every_position(chi_square, case):
    settings = PROCESSED_CASES[case]
    num_accepted, next_token, drafts, target_logits = processed_step(5, [settings] * PROCESSED_ROWS)
    for position in range(K + 1):
        reached = num_accepted >= position
        if position < K:  # both branches ran at this position
            assert np.sum(num_accepted > position) > 2000 and np.sum(num_accepted == position) > 2000, position
        token = next_token[reached]
        if position < K:
            token = np.where(num_accepted[reached] > position, drafts[reached, position], token)
        # One multinomial per prefix of drafts (the penalties make p depend on all of it).
        group = (drafts[reached, :position] * V ** np.arange(position)).sum(1)
        observed = np.zeros((V ** position, V))
        np.add.at(observed, (group, token), 1)
        expected = np.zeros_like(observed)
        for g in np.unique(group):
            prefix = tuple(int(g) // V ** i % V for i in range(position))
            previous = prefix[-1] if prefix else 0
            expected[g] = processed_reference(target_logits[position, previous], prefix, settings)
        used = observed.sum(1) > 0
        assert chi_square(observed[used], expected[used]) > ALPHA, position


def test_greedy_rows_with_penalties_emit_the_sequential_processed_argmax():
    """Greedy rows (alone, or among sampled rows) emit exactly what one-token-at-a-time argmax
    over the penalised target gives, however many drafts they accept."""
    greedy = sampling.Sampling(repetition_penalty=1.6, presence_penalty=0.7, frequency_penalty=0.5)
    sampled = sampling.Sampling(temperature=1.0, frequency_penalty=0.5)
    histories = np.random.default_rng(7).integers(0, V, (256, 4))  # rows differ by their output so far
    for settings in ([greedy] * 256, [greedy, sampled] * 128):
        num_accepted, next_token, drafts, target_logits = processed_step(6, settings, histories)
        greedy_rows = [row for row, s in enumerate(settings) if s.greedy]
        accepted_counts = np.bincount(num_accepted[greedy_rows], minlength=K + 1)
        assert (accepted_counts[:K] > 0).all(), accepted_counts  # rejections at every depth
        for row in greedy_rows:
            emitted = list(drafts[row, :num_accepted[row]]) + [next_token[row]]
            prefix = []
            for position, token in enumerate(emitted):
                previous = prefix[-1] if prefix else 0
                want = np.argmax(processed_reference(target_logits[position, previous], tuple(prefix), greedy,
                                                     histories[row]))
                assert token == want, (row, position, emitted)
                prefix.append(int(token))


def test_one_hot_drafts_need_no_draft_probabilities():
    """draft_probs=None is the same rule as passing one-hot q."""
    rng = np.random.default_rng(4)
    drafts = jnp.asarray(rng.integers(0, V, (512, K)), jnp.int32)
    target = jnp.asarray(rng.dirichlet(np.ones(V), (512, K + 1)), jnp.float32)
    key = jax.random.key(3)
    implicit = acceptance.rejection(drafts, None, target, key)
    explicit = acceptance.rejection(drafts, jax.nn.one_hot(drafts, V), target, key)
    for a, b in zip(implicit, explicit):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert len(set(np.asarray(implicit[0]).tolist())) == K + 1  # every acceptance length happened


def test_a_seeded_row_verifies_the_same_whatever_shares_its_batch():
    rng = np.random.default_rng(5)
    drafts = jnp.asarray(rng.integers(0, V, (4, K)), jnp.int32)
    draft_probs = jnp.asarray(rng.dirichlet(np.ones(V), (4, K)), jnp.float32)
    target = jnp.asarray(rng.dirichlet(np.ones(V), (4, K + 1)), jnp.float32)
    seeded = sampling.Sampling(temperature=1.0, seed=1234)

    def row_zero(others: list[sampling.Sampling], batch_key: int):
        params = sampling.SamplingParams.stack([seeded] + others)
        keys = sampling.row_keys(params, jax.random.key(batch_key), jnp.full((4,), 7, jnp.int32))
        outcomes = [acceptance.rejection(drafts, draft_probs, target, keys) for _ in range(2)]
        return [(int(n[0]), int(t[0])) for n, t in outcomes]

    first = row_zero([sampling.Sampling(temperature=0.5)] * 3, batch_key=0)
    assert row_zero([sampling.Sampling(temperature=1.0, seed=9)] * 3, batch_key=1) == first
    # Different seeds give different draws (over many seeds, not all equal).
    results = set()
    for seed in range(20):
        params = sampling.SamplingParams.stack([sampling.Sampling(temperature=1.0, seed=seed)] * 4)
        keys = sampling.row_keys(params, jax.random.key(0), jnp.zeros((4,), jnp.int32))
        n, t = acceptance.rejection(drafts, draft_probs, target, keys)
        results.add((int(n[0]), int(t[0])))
    assert len(results) > 3
