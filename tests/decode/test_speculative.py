"""Speculative decoding is lossless and its acceptance is exactly what EAGLE's rules give.

The target is random but "aligned" (conftest's `aligned_target`): its next token is close to
argmax(lm_head(embed(t))). An EAGLE-1 head with fc = [I; 0] and zeroed attention and MLP outputs
(`agreeing_head`) computes exactly lm_head(embed(t)), so it agrees with the target most of the time. Noise in fc
and live attention/MLP outputs make heads that agree partially and depend on the draft cache, so
steps accept varying numbers of drafts: the interesting case for losslessness, and for checking
the acceptance counts against `reference_stats`, which recomputes every draft from scratch.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle_jax.model import eagle
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib
from tests.decode import speculation_fixtures

MAX_NEW = 12
# With 12 new tokens and k <= 5 every prompt needs a 32-slot cache and a 16-wide prefill, so
# each engine compiles its two programs once.
PROMPT_LENGTHS = (4, 9, 14)
DRAFT_VOCAB = 64

target = speculation_fixtures.target
prompts = speculation_fixtures.prompts_fixture(PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def reference(target, prompts):
    """Plain greedy decoding (k = 0)."""
    results = engine_lib.Engine(target, config=config_lib.EngineConfig(max_length=64)).generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
    tokens = [r.token_ids for r in results]
    assert all(len(set(t)) > 5 for t in tokens)  # non-repetitive continuations: bookkeeping errors would show
    return tokens


@pytest.fixture(scope="module")
def make_head(target, reference, random_head, agreeing_head, biased_eagle3_head):
    """Head kinds by name (see module docstring)."""
    cfg = target.config
    frequent = np.argsort(-np.bincount(np.concatenate(reference), minlength=cfg.vocab_size))[:2]
    heads = {
        "eagle-agree": lambda: agreeing_head(cfg, 0.0),
        "eagle-noisy": lambda: agreeing_head(cfg, 0.3, residual=1.0, seed=1),
        "eagle-bias": lambda: agreeing_head(cfg, 0.3, residual=1.0, fc_bias=True, seed=2),
        "eagle3-biased": lambda: biased_eagle3_head(cfg, frequent, DRAFT_VOCAB, seed=3),
        "eagle3-two-layers": lambda: biased_eagle3_head(cfg, frequent, DRAFT_VOCAB, seed=5, num_layers=2),
        "eagle3-random": lambda: random_head(cfg, "eagle3", seed=4, draft_vocab_size=DRAFT_VOCAB,
                                             feature_layers=(0, 1, 2)),
    }
    return functools.cache(lambda kind: heads[kind]())


@pytest.fixture(scope="module")
def run(target, prompts, make_head):
    """Memoised speculative generation of all prompts for (head kind, k, batch size)."""

    @functools.cache
    def generate(kind: str, k: int, batch_size: int):
        engine = engine_lib.Engine(target, make_head(kind), config=config_lib.EngineConfig(steps_per_call=4, num_speculative_tokens=k, max_length=64,
                                   batch_size=batch_size))
        results = engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
        # One bucket: prefill and the speculative step; batches of several rows compile the step
        # once per attention reach (a quarter, half or all of the cache; `Engine._run_programs`).
        runs = sum(key[0] == "run" for key in engine.compiler.compiled)
        assert engine.num_compilations == 1 + runs and (runs == 1) == (batch_size == 1)
        return results

    return generate


CASES = [  # k = 1..5, both head kinds and batch sizes; 3 prompts each (batch size 2 leaves an idle row).
    # A two-layer EAGLE-3 head: test_tree.py's cases and test_train_objective.py
    ("eagle-agree", 3, 2),
    ("eagle-noisy", 1, 1),
    ("eagle-bias", 2, 1),
    ("eagle3-biased", 4, 2),
    ("eagle3-random", 5, 1),
]


@pytest.mark.parametrize("kind, k, batch_size", CASES)
def test_speculative_greedy_is_lossless(run, reference, kind, k, batch_size):
    results = run(kind, k, batch_size)
    assert [r.token_ids for r in results] == reference


def test_agreeing_head_has_high_acceptance(run):
    k = 3
    lengths = [r.stats["acceptance_length"] for r in run("eagle-agree", k, 2)]
    assert np.mean(lengths) > 1 + 0.5 * k, lengths  # measured: 3.0 (3, 2, 4) of the maximum 4


def test_partial_agreement_accepts_some_drafts(run):
    """The noisy and biased heads accept some drafts but not all (measured 1.1 to 1.6)."""
    for case in [("eagle-noisy", 1, 1), ("eagle-bias", 2, 1), ("eagle3-biased", 4, 2)]:
        lengths = [r.stats["acceptance_length"] for r in run(*case)]
        assert 1 < np.mean(lengths) < case[1] + 1, (case, lengths)


def test_eager_equals_compiled(target, prompts, make_head, run):
    kind, k, batch_size = "eagle-bias", 2, 1
    compiled = run(kind, k, batch_size)[0]
    engine = engine_lib.Engine(target, make_head(kind), config=config_lib.EngineConfig(steps_per_call=4, num_speculative_tokens=k, max_length=64,
                               batch_size=batch_size, eager=True))
    [eager] = engine.generate(prompts[:1], max_new_tokens=MAX_NEW, ignore_eos=True)
    assert engine.num_compilations == 0
    assert eager.token_ids == compiled.token_ids
    assert eager.stats == compiled.stats


@pytest.mark.parametrize("kind, k, batch_size", CASES)
def test_stats_are_consistent(run, kind, k, batch_size):
    for result in run(kind, k, batch_size):
        stats = result.stats
        drafts, accepted = stats["num_drafts"], stats["num_accepted_tokens"]
        assert 0 < drafts < MAX_NEW
        assert stats["num_draft_tokens"] == k * drafts
        assert stats["acceptance_length"] == pytest.approx(1 + accepted / drafts)
        rates = stats["acceptance_rate_per_position"]
        assert len(rates) == k and all(0 <= r <= 1 for r in rates)
        assert sum(rates) * drafts == pytest.approx(accepted)
        assert all(a >= b for a, b in zip(rates, rates[1:]))  # a draft is kept only after its predecessors
        # 1 token from prefill, then accepted + 1 per step; the budget may cut the last step's
        # bonus or correction token, and the drafts it cuts do not count as accepted.
        assert 1 + drafts + accepted in (MAX_NEW, MAX_NEW + 1)


# ---- A reference of the draft/verify loop, recomputed from scratch at every step ------------------

WIDTH = 48  # >= prompt + new tokens + k + 1: one compiled shape for every call below


def _pad(rows, width=WIDTH):
    rows = np.asarray(rows)
    return np.concatenate([rows, np.zeros((width - len(rows),) + rows.shape[1:], rows.dtype)])[None]


@functools.partial(jax.jit, static_argnums=(0, 2))
def _features(target_def, target_params, head_def, head_params, tokens):
    """The feature stream the head reads, [1, W, D], from one full target forward."""
    target, head = nnx.merge(target_def, target_params), nnx.merge(head_def, head_params)
    positions = jnp.arange(WIDTH, dtype=jnp.int32)[None]
    capture = head.config.feature_layers if head.config.method == "eagle3" else ()
    hidden, _, captured = target(tokens, positions, target.init_cache(1, WIDTH), capture)
    return head.project(captured if capture else hidden), jnp.argmax(target.logits(hidden), -1)


@functools.partial(jax.jit, static_argnums=(0, 2))
def _draft(head_def, head_params, target_def, target_params, tokens, features):
    """One head forward over W (token, feature) pairs from an empty draft cache."""
    head, target = nnx.merge(head_def, head_params), nnx.merge(target_def, target_params)
    positions = jnp.arange(WIDTH, dtype=jnp.int32)[None]
    out, logits, _ = head(tokens, features, positions, eagle.init_cache(head.config, 1, WIDTH, jnp.float32), target)
    return out, head.to_target_ids(jnp.argmax(logits, -1).astype(jnp.int32))


def reference_stats(target, head, prompt, output, k, eos=None, plain_steps=0):
    """(num_drafts, accepted per depth) of EAGLE greedy decoding, without any cache bookkeeping.

    Committed tokens t_0..t_{L-1}, next token t_L emitted: draft slot i holds (t_{i+1}, f_i) with f_i
    the target feature at i; the first draft reads slots 0..L-1, each further draft appends
    (previous draft, the head's own output feature). Drafts are kept while they equal the target's
    greedy tokens; then L advances by accepted + 1. A draft counts only if it is emitted: within
    the budget and not past the EOS token `eos`. The first `plain_steps` steps draft nothing (speculation
    disabled) and emit one token each. Also returns how many accepted drafts were cut.
    """
    head_split, target_split = nnx.split(head), nnx.split(target)
    sequence = list(prompt) + list(output)
    while len(sequence) < len(prompt) + MAX_NEW + k + 1:  # the target's tokens past the budget too
        _, greedy = _features(*target_split, *head_split, _pad(sequence))
        sequence.append(int(greedy[0, len(sequence) - 1]))
    features, _ = _features(*target_split, *head_split, _pad(sequence))
    features = np.asarray(features[0])
    length, generated, steps, accepted, cut = len(prompt), 1, 0, np.zeros(k, int), 0
    while generated < MAX_NEW and sequence[length] != eos:
        if plain_steps:
            plain_steps, generated, length = plain_steps - 1, generated + 1, length + 1
            continue
        tokens, feats, drafts = sequence[1:length + 1], list(features[:length]), []
        for _ in range(k):
            out, ids = _draft(*head_split, *target_split, _pad(tokens), _pad(np.stack(feats)))
            drafts.append(int(ids[0, len(tokens) - 1]))
            tokens.append(drafts[-1])
            feats.append(np.asarray(out[0, len(tokens) - 2]))
        kept = 0
        while kept < k and drafts[kept] == sequence[length + 1 + kept]:
            kept += 1
        step_tokens = sequence[length + 1:length + 2 + kept][:MAX_NEW - generated]
        emitted = step_tokens.index(eos) + 1 if eos in step_tokens else len(step_tokens)
        accepted[:min(kept, emitted)] += 1
        cut += max(kept - emitted, 0)
        steps, generated, length = steps + 1, generated + emitted, length + emitted
    return steps, accepted, cut


@pytest.mark.parametrize("kind, k, batch_size", CASES)
def test_acceptance_matches_a_reference_without_caches(target, make_head, prompts, reference, run,
                                                       kind, k, batch_size):
    """Exact per-depth acceptance counts: catches draft-cache, pending-pair and d2t mistakes, which
    leave the output lossless and only cost acceptance."""
    for prompt, output, result in zip(prompts, reference, run(kind, k, batch_size)):
        steps, accepted, _ = reference_stats(target, make_head(kind), prompt, output, k)
        assert result.stats["num_drafts"] == steps
        assert [round(rate * steps) for rate in result.stats["acceptance_rate_per_position"]] == accepted.tolist()


# (kind, k, whether EOS cuts accepted drafts: measured, the EAGLE-3 head accepts too rarely)
@pytest.mark.parametrize("kind, k, cuts_drafts", [("eagle-agree", 3, True), ("eagle3-biased", 4, False)])
def test_acceptance_with_eos_matches_the_reference(target, make_head, prompts, reference, kind, k, cuts_drafts):
    """EOS on and fixed shapes (the benchmark's settings): the EOS token is the first row's sixth,
    which for the agreeing head arrives in steps that accepted drafts past it: those must not count."""
    eos = reference[0][5]
    assert eos not in reference[0][:5]
    engine = engine_lib.Engine(target, make_head(kind), config=config_lib.EngineConfig(steps_per_call=4, num_speculative_tokens=k, max_length=64, batch_size=2,
                               fixed_shapes=True))
    results = engine.generate(prompts, max_new_tokens=MAX_NEW, eos_ids=[eos])
    stopped = [output[:output.index(eos) + 1] if eos in output else output for output in reference]
    assert [r.token_ids for r in results] == stopped
    assert len(stopped[0]) < MAX_NEW
    total_cut = 0
    for prompt, output, result in zip(prompts, stopped, results):
        steps, accepted, cut = reference_stats(target, make_head(kind), prompt, output, k, eos)
        assert result.stats["num_drafts"] == steps
        assert [round(rate * steps) for rate in result.stats["acceptance_rate_per_position"]] == accepted.tolist()
        total_cut += cut
    assert (total_cut > 0) == cuts_drafts


@pytest.mark.parametrize("kind, k", [("eagle-noisy", 3), ("eagle3-biased", 4)])
def test_speculation_resumes_with_the_draft_state_it_would_have_had(target, make_head, prompts, reference,
                                                                     kind, k):
    """Two rows, speculation disabled while both are active: the short row decodes plainly to its
    budget of SHORT tokens, then the long row speculates from token SHORT on. Its acceptance, depth by
    depth, must be what drafting from scratch gives after SHORT - 1 plain steps: a draft cache or
    pending pair left behind by the plain steps would draft differently."""
    short = 5
    engine = engine_lib.Engine(target, make_head(kind), config=config_lib.EngineConfig(steps_per_call=3, num_speculative_tokens=k, max_length=64, batch_size=2,
                               scheduler="continuous", speculative_disable_by_batch_size=1))
    plain, speculated = engine.generate([prompts[2], prompts[1]], max_new_tokens=[short, MAX_NEW], ignore_eos=True)
    assert [plain.token_ids, speculated.token_ids] == [reference[2][:short], reference[1]]
    assert plain.stats["num_drafts"] == 0 and plain.stats["num_accepted_tokens"] == 0
    steps, accepted, _ = reference_stats(target, make_head(kind), prompts[1], reference[1], k, plain_steps=short - 1)
    assert speculated.stats["num_drafts"] == steps > 0
    assert [round(rate * steps) for rate in speculated.stats["acceptance_rate_per_position"]] == accepted.tolist()
    assert accepted[0] > 0  # drafts were accepted after the pause: a test that can tell


@pytest.mark.parametrize("kind", ["eagle-noisy", "eagle3-biased"])
def test_a_program_drafting_fewer_than_its_state_holds_drafts_as_that_k(target, make_head, prompts, reference, kind):
    """One slot, its state sized for k = 4, its run program drafting 2 (`speculative_tokens_by_rows`):
    the outputs are lossless and the acceptance, depth by depth, is exactly k = 2's; the positions
    past 2 accept nothing, and the drafted tokens count 2 a step."""
    engine = engine_lib.Engine(target, make_head(kind), config=config_lib.EngineConfig(
        steps_per_call=3, num_speculative_tokens=4, max_length=64, scheduler="continuous",
        speculative_tokens_by_rows=((1, 2),)))
    results = engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
    assert [r.token_ids for r in results] == reference
    for prompt, output, result in zip(prompts, reference, results):
        steps, accepted, _ = reference_stats(target, make_head(kind), prompt, output, 2)
        rates = result.stats["acceptance_rate_per_position"]
        assert result.stats["num_drafts"] == steps and result.stats["num_draft_tokens"] == 2 * steps
        assert [round(rate * steps) for rate in rates] == accepted.tolist() + [0, 0]
    assert sum(r.stats["num_accepted_tokens"] for r in results) > 0  # drafts were accepted: a test that can tell


def test_row_buckets_draft_their_own_k_on_one_state(target, make_head, prompts, reference):
    """Two slots, k = 2 while both run and 4 once one is left (row buckets of 2 and 1): lossless, and
    the long row's drafted tokens count both: more than 2 a step, fewer than 4."""
    short = 4
    engine = engine_lib.Engine(target, make_head("eagle-noisy"), config=config_lib.EngineConfig(
        steps_per_call=3, num_speculative_tokens=4, max_length=64, batch_size=2, scheduler="continuous",
        speculative_tokens_by_rows=((1, 4), (2, 2))))
    paired, alone = engine.generate([prompts[2], prompts[1]], max_new_tokens=[short, MAX_NEW], ignore_eos=True)
    assert [paired.token_ids, alone.token_ids] == [reference[2][:short], reference[1]]
    assert paired.stats["num_draft_tokens"] == 2 * paired.stats["num_drafts"] > 0
    assert 2 * alone.stats["num_drafts"] < alone.stats["num_draft_tokens"] < 4 * alone.stats["num_drafts"]


@pytest.mark.parametrize("kind, k, batch_size", [("eagle-bias", 2, 2), ("eagle3-biased", 4, 1)])
def test_checking_for_done_rows_less_often_changes_nothing(target, prompts, make_head, run, kind, k, batch_size):
    engine = engine_lib.Engine(target, make_head(kind), config=config_lib.EngineConfig(steps_per_call=4, num_speculative_tokens=k, max_length=64,
                               batch_size=batch_size, steps_per_check=3))
    results = engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
    expected = run(kind, k, batch_size)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert [r.stats for r in results] == [r.stats for r in expected]



@pytest.mark.parametrize("kind, k", [("eagle-noisy", 3), ("eagle3-biased", 4)])
def test_the_draft_loop_written_out_changes_nothing(target, prompts, make_head, run, kind, k):
    engine = engine_lib.Engine(target, make_head(kind), config=config_lib.EngineConfig(
        steps_per_call=4, num_speculative_tokens=k, max_length=64, unroll_draft=True))
    results = engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
    expected = run(kind, k, 1)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert [r.stats for r in results] == [r.stats for r in expected]
