"""Continuous batching (`scheduler`): more prompts than slots, ragged lengths, budgets and EOS.

Every prompt's output must equal its own batch-1 static generation (float32 greedy), for plain
decoding and for EAGLE-1 and EAGLE-3 speculative decoding, and nothing may recompile as prompts
enter and leave slots.
"""

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.serve import config as config_lib
from eagle_jax.serve import device_calls
from eagle_jax.serve import inputs
from eagle_jax.serve import programs as programs_lib
from eagle_jax.serve import engine as engine_lib
from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.serve import scheduler as scheduler_lib
from eagle_jax.decode import speculative
from eagle_jax.decode import tree as tree_lib
from eagle_jax.decode import state as state_lib

MAX_LENGTH = 64  # prompts up to 32 tokens (prefills 16 and 32 wide), one 64-slot cache
PROMPT_LENGTHS = (3, 17, 1, 9, 26, 6, 12)  # 7 prompts through 3 slots
BUDGETS = (14, 5, 9, 1, 11, 16, 7)
SLOTS = 3
# Slot programs: one prefill and one insert per row bucket (1 and 3 rows here) and width bucket
# (16 and 32), one building the idle slots, one run of every slot per attention length (16, 32 and
# 64 slots here: a quarter, half and all of the cache) and one run of a single row (whole cache).
WIDTHS = sorted({inputs.bucket_length(n, MAX_LENGTH // 2) for n in range(1, MAX_LENGTH // 2 + 1)})
ROWS = inputs.row_buckets(SLOTS)
SLOT_PROGRAMS = 2 * len(ROWS) * len(WIDTHS) + 1 + 3 + 1
DRAFT_VOCAB = 64
K = {"plain": 0, "eagle": 3, "eagle3": 4}


@pytest.fixture(scope="module")
def target(speculation_target):
    return speculation_target


@pytest.fixture(scope="module")
def prompts(random_prompts):
    return random_prompts(PROMPT_LENGTHS, seed=100)


def static_results(target, head, k, prompts, budgets, eos_ids):
    """Each prompt alone: plain `Engine.generate`, batch 1 (with the slots' shapes, so even the
    drafts, which greedy outputs do not depend on, must match)."""
    engine = engine_lib.Engine(target, head, config=config_lib.EngineConfig(num_speculative_tokens=k, max_length=MAX_LENGTH, fixed_shapes=True))
    return [engine.generate([p], max_new_tokens=b, eos_ids=eos_ids)[0] for p, b in zip(prompts, budgets)]


def static(target, head, k, prompts, budgets, eos_ids):
    return [r.token_ids for r in static_results(target, head, k, prompts, budgets, eos_ids)]


@pytest.fixture(scope="module")
def eos_id(target, prompts):
    """A token that greedy decoding emits at different steps for several prompts (and never for others)."""
    free = static(target, None, 0, prompts, [16] * len(prompts), eos_ids=[])
    firsts = collections.defaultdict(dict)
    for row, tokens in enumerate(free):
        for index, token in enumerate(tokens):
            firsts[token].setdefault(row, index)
    # Most distinct first positions among rows, hit by at least two rows but not all.
    candidates = [t for t, rows in firsts.items() if 2 <= len(rows) < len(prompts)]
    return max(candidates, key=lambda t: (len(set(firsts[t].values())), -t))


@pytest.fixture(scope="module")
def heads(target, prompts, agreeing_head, biased_eagle3_head):
    free = static(target, None, 0, prompts, [16] * len(prompts), eos_ids=[])
    frequent = np.argsort(-np.bincount(np.concatenate(free), minlength=target.config.vocab_size))[:2]
    return {"plain": None, "eagle": agreeing_head(target.config, 0.3, residual=1.0, seed=1),
            "eagle3": biased_eagle3_head(target.config, frequent, DRAFT_VOCAB, seed=3)}


@pytest.fixture(scope="module")
def reference(target, prompts, heads, eos_id):
    return functools.cache(lambda kind: static_results(target, heads[kind], K[kind], prompts, BUDGETS, [eos_id]))


@pytest.mark.parametrize("kind", ["plain", "eagle", "eagle3"])
def test_continuous_equals_batch_one(target, prompts, heads, eos_id, reference, kind, xla_compilations):
    expected = [r.token_ids for r in reference(kind)]
    lengths = [len(t) for t in expected]
    # The test is only interesting if rows end at different steps, some by EOS, some by budget.
    assert len(set(lengths)) >= 4, lengths
    assert any(t[-1] == eos_id for t in expected) and any(len(t) == b for t, b in zip(expected, BUDGETS)), expected
    engine = engine_lib.Engine(target, heads[kind], config=config_lib.EngineConfig(
        num_speculative_tokens=K[kind], max_length=MAX_LENGTH, batch_size=SLOTS, scheduler="continuous", steps_per_call=2))
    streamed = collections.defaultdict(list)

    def on_tokens(index, ids):
        streamed[index] += ids

    results = engine.generate(prompts, max_new_tokens=list(BUDGETS), eos_ids=[eos_id],
                              on_tokens=on_tokens)
    assert [r.token_ids for r in results] == expected
    # Greedy outputs are lossless whatever the drafts; equal statistics show that the draft
    # state (draft cache, pending pairs) was inserted intact too.
    assert [r.stats for r in results] == [r.stats for r in reference(kind)]
    assert [streamed[i] for i in range(len(prompts))] == expected
    # Prefill and insert (per bucket), empty and run: compiled once, before the first prompt; the prompts
    # compile nothing, nor does a second call with other budgets.
    assert SLOT_PROGRAMS == 13 and engine.num_compilations == SLOT_PROGRAMS
    with xla_compilations() as compiled:
        again = engine.generate(prompts[::-1], max_new_tokens=list(BUDGETS[::-1]), eos_ids=[eos_id])
    assert [r.token_ids for r in again] == expected[::-1]
    assert engine.num_compilations == SLOT_PROGRAMS
    assert compiled == []  # nor anything else on the host path
    for result in results + again:
        stats = result.stats
        if K[kind]:
            # One token from prefill, then per active step its accepted drafts and one more token;
            # EOS or the budget may cut the last step's extra token.
            spare = result.num_tokens - 1 - stats["num_accepted_tokens"]
            assert spare in (stats["num_drafts"] - 1, stats["num_drafts"]), stats
        else:
            assert stats["num_drafts"] == 0 and stats["num_accepted_tokens"] == 0
    if kind == "eagle":
        assert sum(r.stats["num_accepted_tokens"] for r in results) > 0  # drafts were accepted


@pytest.mark.parametrize("kind", ["eagle3"])
def test_a_lone_request_runs_its_row_alone(target, prompts, heads, kind):
    """Once one request is left in the three slots, run calls take its row alone (the 1-row
    bucket, `programs.take_rows`) and put it back: its tokens, and its statistics, are still its
    batch-1 ones, as are those of the requests that ran beside it before."""
    budgets = [24, 2, 4]
    engine = engine_lib.Engine(target, heads[kind], config=config_lib.EngineConfig(
        num_speculative_tokens=K[kind], max_length=MAX_LENGTH, batch_size=SLOTS, scheduler="continuous", steps_per_call=2))
    results = engine.generate(prompts[:3], max_new_tokens=budgets, eos_ids=[])
    expected = static_results(target, heads[kind], K[kind], prompts[:3], budgets, eos_ids=[])
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert [r.stats for r in results] == [r.stats for r in expected]
    calls = results[0].calls
    assert 0 < calls["row_run_calls"] < calls["run_calls"], calls
    assert engine.num_compilations == SLOT_PROGRAMS


def test_take_rows_gathers_rows(slot_programs):
    """`programs.take_rows`: row i of the result is slot ids[i] of every per-row leaf (caches too),
    and the state's key kept."""
    state = with_stale_caches(slot_programs("eagle").empty(jax.random.key(0)), seed=5)
    state = state.replace(num_generated=jnp.arange(SLOTS, dtype=jnp.int32) + 7)
    ids = np.array([2, 0], np.int32)
    rows = programs_lib.take_rows(state, ids)
    for got, full in zip(cache_leaves(rows), cache_leaves(state)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(full)[ids])
    np.testing.assert_array_equal(np.asarray(rows.num_generated), [9, 7])
    np.testing.assert_array_equal(np.asarray(rows.cache.lengths), np.asarray(state.cache.lengths)[ids])
    assert jax.random.key_data(rows.rng).tolist() == jax.random.key_data(state.rng).tolist()


def test_warm_up_runs_every_program_once_on_idle_slots(slot_programs, xla_compilations):
    """`SlotPrograms.warm_up` calls each prefill and insert bucket and each run (rows, reach, argmax
    or not) once, compiles nothing, and leaves every slot idle: no row was inserted or stepped."""
    programs = slot_programs("eagle")
    seen = collections.Counter()
    outputs = []

    def recorded(kind, call, key):
        def wrapped(*args):
            seen[kind, key(*args)] += 1
            outputs.append(call(*args))
            return outputs[-1]
        return wrapped

    run_key = lambda state, length, refill_at, argmax, slot_ids: (
        SLOTS if slot_ids is None else len(slot_ids), length, argmax)
    warm = dataclasses.replace(
        programs, prefill=recorded("prefill", programs.prefill, lambda tokens, *_: tokens.shape),
        insert=recorded("insert", programs.insert, lambda state, new, ids: (len(ids), new.cache.max_length)),
        run=recorded("run", programs.run, run_key))
    with xla_compilations() as compiled:
        warm.warm_up(jax.random.key(0))
    assert compiled == []
    buckets = [(rows, width) for rows in programs.row_counts for width in programs.widths]
    runs = [(rows, length, argmax) for rows in programs.row_counts for length in programs.attend_lengths[rows]
            for argmax in (False, True)]
    assert programs.attend_lengths == {1: (MAX_LENGTH,), SLOTS: (16, 32, MAX_LENGTH)}
    assert seen == collections.Counter([("prefill", b) for b in buckets] + [("insert", b) for b in buckets]
                                       + [("run", r) for r in runs])
    last = outputs[-1]
    assert np.asarray(last.done).all() and not np.asarray(last.num_generated).any()
    assert not np.asarray(last.cache.lengths).any()


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_speculation_pauses_while_the_slots_are_full(target, prompts, heads, eos_id, reference, kind):
    """Speculation off while all three slots are busy (`speculative_disable_by_batch_size=2`), on in
    the tail as the queue drains: outputs stay plain greedy's, and the one step program serves both."""
    engine = engine_lib.Engine(target, heads[kind], config=config_lib.EngineConfig(steps_per_call=2, num_speculative_tokens=K[kind], max_length=MAX_LENGTH,
                               batch_size=SLOTS, scheduler="continuous", speculative_disable_by_batch_size=SLOTS - 1))
    results = engine.generate(prompts, max_new_tokens=list(BUDGETS), eos_ids=[eos_id])
    assert [r.token_ids for r in results] == [r.token_ids for r in reference("plain")]
    # Tokens = 1 + drafting steps + accepted drafts + plain steps (one fewer if the last step was
    # cut): the remainder is a lower bound on the plain steps.
    plain_steps = [r.num_tokens - 1 - r.stats["num_drafts"] - r.stats["num_accepted_tokens"] for r in results]
    assert max(plain_steps) >= 1 and sum(r.stats["num_drafts"] for r in results) > 0, [r.stats for r in results]
    assert engine.num_compilations == SLOT_PROGRAMS


def cache_leaves(state):
    caches = [cache for cache in (state.cache, state.draft_cache) if cache is not None]
    return [leaf for cache in caches for leaf in cache.keys + cache.values]


def with_stale_caches(state, seed=0):
    """`state` with every slot of its caches (target and head) holding large random values: what
    slots that held other rows hold, but loud, so that a row reading a slot it did not write
    changes its tokens."""
    noise = np.random.default_rng(seed)
    fill = lambda leaf: jnp.asarray(100 * noise.standard_normal(leaf.shape), leaf.dtype)
    stale = lambda cache: None if cache is None else cache.replace(keys=tuple(map(fill, cache.keys)),
                                                                   values=tuple(map(fill, cache.values)))
    return state.replace(cache=stale(state.cache), draft_cache=stale(state.draft_cache))


@pytest.fixture(scope="module")
def slot_programs(target, heads, eos_id):
    """`slot_programs(kind)`: the continuous scheduler's programs for "eagle" (a chain) or "tree"
    (an EAGLE-2 tree with the same head), greedy; compiled once per kind. The rows stop at the EOS
    ids their host loop gives them (`eos_ids`)."""
    def compile(kind):
        drafting = dict(tree=tree_lib.TreeOptions(2, 3, 5)) if kind == "tree" else dict(num_speculative_tokens=K[kind])
        engine = engine_lib.Engine(target, heads["eagle"], config=config_lib.EngineConfig(steps_per_call=2, max_length=MAX_LENGTH, batch_size=SLOTS,
                                   scheduler="continuous", **drafting))
        return engine.slot_programs()

    return functools.cache(compile)


def test_a_refill_moves_only_its_prefill_width(slot_programs):
    """A slot prefill's caches (target and head) are as long as its width, not the slots' cache,
    and insert scatters row i over the first slots of slot slot_ids[i]'s caches only: the other
    slots, and those a padding row (an id past the slots) names, keep what they held."""
    programs = slot_programs("eagle")
    state = programs.empty(jax.random.key(0))
    assert {leaf.shape[1] for leaf in cache_leaves(state)} == {MAX_LENGTH}
    assert programs.row_counts == (1, SLOTS)
    placements = {1: [[1], [SLOTS]], SLOTS: [[2, SLOTS, 0], [0, 1, 2]]}  # row i -> slot ids[i]
    for rows_count in programs.row_counts:
        for width in programs.widths:
            for slot_ids in placements[rows_count]:
                rows = programs.prefill(np.ones((rows_count, width), np.int32), np.full((rows_count,), width, np.int32),
                                        np.ones((rows_count,), np.int32),
                                        sampling_lib.SamplingParams.neutral(rows_count, sampling_lib.STOP_WIDTH),
                                        jax.random.key(1))
                assert {leaf.shape[:2] for leaf in cache_leaves(rows)} == {(rows_count, width)}
                before = with_stale_caches(state, seed=width + rows_count)
                old = [np.asarray(leaf) for leaf in cache_leaves(before)]
                state = programs.insert(before, rows, np.array(slot_ids, np.int32))  # donates `before`
                for got, was, new in zip(cache_leaves(state), old, cache_leaves(rows)):
                    expected = was.copy()
                    for row, slot in enumerate(slot_ids):
                        if slot < SLOTS:
                            expected[slot, :width] = np.asarray(new)[row]
                    np.testing.assert_array_equal(np.asarray(got), expected)


@pytest.mark.parametrize("kind", ["eagle", "tree"])
def test_stale_cache_slots_are_never_read(slot_programs, prompts, reference, eos_id, kind):
    """Every slot of the idle state's caches holds large random values: a refilled row keeps them
    past its prefill's width, and must still give its batch-1 tokens (and, for chains, statistics),
    since a query sees only the slots up to its position, which the row wrote."""
    programs = slot_programs(kind)
    stale = dataclasses.replace(programs, empty=lambda rng: with_stale_caches(programs.empty(rng)))
    results = scheduler_lib.generate(stale, [np.asarray(p, np.int32) for p in prompts], list(BUDGETS),
                                     jax.random.key(0), eos_ids=(eos_id,))
    expected = reference("plain" if kind == "tree" else kind)  # greedy trees are lossless too
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    if kind != "tree":
        assert [r.stats for r in results] == [r.stats for r in expected]


def test_one_slot_and_idle_slots(target, prompts, eos_id, reference):
    """One slot (pure queue) and more slots than prompts (idle slots) give the same outputs.

    Every prompt's times count from the call's start: through one slot each prompt's first token
    comes after the previous prompt's last; with a slot each, all start in the first device call.
    """
    expected = [r.token_ids for r in reference("plain")]
    for slots, count in ((1, 3), (5, 2)):
        engine = engine_lib.Engine(target, config=config_lib.EngineConfig(steps_per_call=2, max_length=MAX_LENGTH, batch_size=slots, scheduler="continuous"))
        results = engine.generate(prompts[:count], max_new_tokens=list(BUDGETS[:count]), eos_ids=[eos_id])
        assert [r.token_ids for r in results] == expected[:count]
        assert all(0 < r.first_token_seconds <= r.finish_seconds for r in results)
        if slots == 1:
            assert all(after.first_token_seconds >= before.finish_seconds
                       for before, after in zip(results, results[1:]))
        else:
            assert len({r.first_token_seconds for r in results}) == 1


def test_input_errors(target):
    engine = engine_lib.Engine(target, config=config_lib.EngineConfig(max_length=MAX_LENGTH, batch_size=2, scheduler="continuous"))
    with pytest.raises(config_lib.InputError, match="takes up to max_length // 2 = 32"):
        engine.generate([[1] * 33], max_new_tokens=4)
    with pytest.raises(config_lib.InputError, match="2 max_new_tokens values for 1 prompts"):
        engine.generate([[1, 2]], max_new_tokens=[3, 4])
    with pytest.raises(config_lib.InputError, match="max_new_tokens must be >= 1"):
        engine.generate([[1, 2], [3]], max_new_tokens=[3, 0])
    with pytest.raises(config_lib.InputError, match="needs scheduler='continuous'"):
        engine_lib.Engine(target, config=config_lib.EngineConfig(max_length=MAX_LENGTH)).generate([[1, 2]], max_new_tokens=[3])
    with pytest.raises(config_lib.InputError, match="scheduler must be"):
        engine_lib.Engine(target, config=config_lib.EngineConfig(scheduler="dynamic"))


def test_sampling_is_reproducible_for_a_seed(target, prompts):
    engine = engine_lib.Engine(target, config=config_lib.EngineConfig(max_length=MAX_LENGTH, batch_size=SLOTS, scheduler="continuous"))
    sampling = sampling_lib.Sampling(temperature=1.0, top_p=0.9)
    runs = [[r.token_ids for r in engine.generate(prompts, max_new_tokens=list(BUDGETS), sampling=sampling,
                                                  seed=seed, ignore_eos=True)] for seed in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]
    assert [len(t) for t in runs[0]] == list(BUDGETS)


def test_eager_equals_compiled(target, prompts, eos_id, reference):
    engine = engine_lib.Engine(target, config=config_lib.EngineConfig(steps_per_call=4, max_length=MAX_LENGTH, batch_size=2, scheduler="continuous", eager=True))
    results = engine.generate(prompts[:3], max_new_tokens=list(BUDGETS[:3]), eos_ids=[eos_id])
    assert engine.num_compilations == 0
    assert [r.token_ids for r in results] == [r.token_ids for r in reference("plain")[:3]]


def test_persistent_cache_holds_the_slot_programs(target, prompts, tmp_path):
    """A second engine on the same cache directory loads prefill, insert and run: it compiles nothing."""
    outputs = []
    for _ in range(2):
        engine = engine_lib.Engine(target, config=config_lib.EngineConfig(max_length=MAX_LENGTH, batch_size=SLOTS, scheduler="continuous",
                                   cache_dir=tmp_path))
        outputs.append([r.token_ids for r in engine.generate(prompts[:4], max_new_tokens=list(BUDGETS[:4]))])
    assert engine.num_compilations == 0 and engine.compile_cache.hits == SLOT_PROGRAMS
    assert outputs[0] == outputs[1]


def test_slot_run_stops_when_a_running_row_finishes(target):
    """With `stop_on_finish` a device call ends at the step where a running row finishes, so
    its slot can be refilled; rows already done at entry (idle slots) do not end it."""
    opts = state_lib.Options(k=0, max_new_tokens=20, cache_length=MAX_LENGTH)
    tokens = np.ones((3, 16), np.int32)
    state = speculative.start(target, None, tokens, np.array([4, 5, 6], np.int32), jax.random.key(0), opts,
                              np.array([3, 20, 1], np.int32))
    assert np.asarray(state.done).tolist() == [False, False, True]  # the budget-1 row is done after prefill
    stopped = speculative.run_steps(target, None, state, 64, opts, stop_on_finish=True)
    assert np.asarray(stopped.done).tolist() == [True, False, True]
    assert np.asarray(stopped.num_generated).tolist()[:2] == [3, 3]  # the long row ran exactly as long
    finished = speculative.run_steps(target, None, state, 64, opts)
    assert np.asarray(finished.done).all() and int(finished.num_generated[1]) == 20


def test_each_call_attends_over_the_shortest_length_that_covers_its_rows():
    """`device_calls.attend_length`: prompt + tokens reachable in one call + the step's headroom."""
    opts = state_lib.Options(k=3, cache_length=64)
    choose = lambda *running: device_calls.attend_length((16, 32, 64), opts, 2, running)
    assert choose((3, 30, 1)) == 16  # 3 + min(1 + 2 x 4, 30) + 4 = 16
    assert choose((3, 30, 2)) == 32  # 17
    assert choose((20, 4, 1), (9, 10, 1)) == 32  # 20 + 4 + 4 = 28: the budget caps the call
    assert choose((3, 30, 29)) == 64  # 37
    assert choose() == 16  # nothing running


def test_refills_wait_for_several_rows(target, prompts, eos_id, reference):
    """`refill_at`: a device call returns only once that many rows finished (or the queue's
    prompts, if fewer), and one prefill refills every freed slot: fewer round trips, the same
    outputs, streaming intact, and the same programs serve both settings (a host-side policy)."""
    expected = [r.token_ids for r in reference("plain")]
    calls = {}
    engine = engine_lib.Engine(target, config=config_lib.EngineConfig(steps_per_call=16, max_length=MAX_LENGTH, batch_size=SLOTS, scheduler="continuous",
                               refill_at=SLOTS))
    for refill_at in (SLOTS, 1):  # the engine's setting, then another through the same programs
        streamed = collections.defaultdict(list)
        on_tokens = lambda index, ids: streamed[index].extend(ids)
        if refill_at == engine.config.resolved_refill_at:
            results = engine.generate(prompts, max_new_tokens=list(BUDGETS), eos_ids=[eos_id], on_tokens=on_tokens)
        else:
            results = scheduler_lib.generate(engine.slot_programs(), [np.asarray(p, np.int32) for p in prompts],
                                             list(BUDGETS), jax.random.key(0), on_tokens, refill_at=refill_at,
                                             eos_ids=(eos_id,))
        assert [r.token_ids for r in results] == expected
        assert [streamed[i] for i in range(len(prompts))] == expected
        assert engine.num_compilations == SLOT_PROGRAMS
        calls[refill_at] = results[0].calls
        assert all(r.calls == calls[refill_at] for r in results)  # the call's counters, shared
        assert calls[refill_at]["prefill_calls"] == calls[refill_at]["insert_calls"] <= calls[refill_at]["run_calls"]
        assert calls[refill_at]["syncs"] == calls[refill_at]["run_calls"]
    # Budgets fit in one call (16 steps), so with refill_at = SLOTS every refill but the last
    # waits for all three slots: 7 prompts take 3 prefills (3, 3, 1).
    assert calls[SLOTS]["prefill_calls"] == 3 and calls[SLOTS]["run_calls"] < calls[1]["run_calls"], calls


def test_run_steps_count_each_device_loop_iteration(target, prompts, eos_id, reference):
    """`CallCounts.run_steps`: plain decoding emits one token a step after the prefill's, so a batch
    of one loops len - 1 steps, and one slot of continuous batching runs the prompts back to back
    (whatever a call's length: four steps here, so most prompts take several calls)."""
    plain = reference("plain")
    assert [r.calls["run_steps"] for r in plain] == [len(r.token_ids) - 1 for r in plain]
    # A static batch loops as long as its longest row (one budget for all: static batches have one).
    batched = engine_lib.Engine(target, config=config_lib.EngineConfig(max_length=MAX_LENGTH, batch_size=SLOTS, fixed_shapes=True)).generate(
        prompts, max_new_tokens=16, eos_ids=[eos_id])
    longest = [max(len(r.token_ids) - 1 for r in batched[start:start + SLOTS]) for start in range(0, len(prompts), SLOTS)]
    assert len(set(longest)) > 1  # EOS ends some batches early: not one figure for all
    assert [r.calls["run_steps"] for r in batched] == [longest[row // SLOTS] for row in range(len(prompts))]
    engine = engine_lib.Engine(target, config=config_lib.EngineConfig(steps_per_call=4, max_length=MAX_LENGTH, batch_size=1, scheduler="continuous", refill_at=1))
    results = engine.generate(prompts, max_new_tokens=list(BUDGETS), eos_ids=[eos_id])
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    assert results[0].calls["run_steps"] == sum(len(r.token_ids) - 1 for r in plain)
    # The time inside run and prefill/insert calls is part of the loop's host time, for both schedulers.
    for calls in (results[0].calls, batched[0].calls):
        assert 0 < calls["run_seconds"] and 0 < calls["prefill_seconds"]
        assert calls["run_seconds"] + calls["prefill_seconds"] <= calls["host_seconds"]


def test_a_slot_loop_takes_requests_between_rounds_and_frees_cancelled_slots(slot_programs, prompts, reference,
                                                                           eos_id):
    """`SlotLoop`, stepped by hand: requests added while others run; one cancelled while queued
    gives no result, one cancelled while active gives the tokens it had streamed (a prefix of its
    batch-1 tokens) with its acceptance counters; every other request's tokens (streamed, then in
    its `Result`) are its batch-1 tokens; the loop is idle once all are out."""
    expected = [r.token_ids for r in reference("eagle")]
    loop = scheduler_lib.SlotLoop(slot_programs("eagle"), jax.random.key(0), refill_at=1, eos_ids=(eos_id,))
    assert loop.idle and loop.step() == []
    add = lambda index: loop.add(np.asarray(prompts[index], np.int32), BUDGETS[index])
    ids = {add(index): index for index in range(4)}  # 4 requests for 3 slots: the last waits
    queued_cancel = add(4)
    ids[queued_cancel] = 4
    loop.cancel(queued_cancel)
    streamed, results = collections.defaultdict(list), {}
    events = loop.step()
    active_cancel = next(event.request_id for event in events if event.result is None)
    loop.cancel(active_cancel)
    ids[add(5)] = 5  # joins once a slot frees
    while not loop.idle:
        events += loop.step()
    for event in events:
        streamed[event.request_id] += event.token_ids
        if event.result is not None:
            results[event.request_id] = event.result
    done = set(ids) - {queued_cancel, active_cancel}
    assert set(results) == done | {active_cancel}
    cut = results.pop(active_cancel)
    assert cut.token_ids and cut.token_ids == streamed[active_cancel]
    assert cut.token_ids == expected[ids[active_cancel]][:len(cut.token_ids)]
    assert cut.stats["num_drafts"] > 0
    for request_id in done:
        assert results[request_id].token_ids == streamed[request_id] == expected[ids[request_id]]


def test_row_buckets():
    assert inputs.row_buckets(64) == (1, 4, 16, 64) and inputs.row_buckets(16) == (1, 4, 16)
    assert inputs.row_buckets(5) == (1, 4, 5) and inputs.row_buckets(1) == (1,)
    assert [inputs.smallest_bucket(n, (1, 4, 5)) for n in (1, 2, 4, 5)] == [1, 4, 4, 5]


def test_a_refill_prefills_the_fewest_rows_that_hold_its_requests(slot_programs, prompts, reference, eos_id):
    """One request prefills one row; two, with two slots free, the 3-row bucket (one padding row,
    dropped at insert): the padding never lands in a slot, as every request's tokens show."""
    programs = slot_programs("eagle")
    shapes = []

    def prefill(tokens, *args):
        shapes.append(tokens.shape)
        return programs.prefill(tokens, *args)

    loop = scheduler_lib.SlotLoop(dataclasses.replace(programs, prefill=prefill), jax.random.key(0), eos_ids=(eos_id,))
    add = lambda index: loop.add(np.asarray(prompts[index], np.int32), BUDGETS[index])
    ids = {add(0): 0}
    events = loop.step()
    ids |= {add(1): 1, add(2): 2}
    while not loop.idle:
        events += loop.step()
    assert [rows for rows, _ in shapes] == [1, 3]
    expected = [r.token_ids for r in reference("eagle")]
    results = {event.request_id: event.result for event in events if event.result is not None}
    assert {request_id: result.token_ids for request_id, result in results.items()} == {
        request_id: expected[index] for request_id, index in ids.items()}
