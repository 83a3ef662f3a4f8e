"""The host side of generation: input checks, dtypes, compile counts, streaming, EOS, sampling."""

import collections

import numpy as np
import pytest

from eagle_jax.serve import config as config_lib
from eagle_jax.serve import inputs
from eagle_jax.serve import engine as engine_lib
from eagle_jax.decode import sampling as sampling_lib

MAX_NEW = 8


@pytest.fixture(scope="module")
def target(random_target):
    return random_target(seed=0)


@pytest.fixture(scope="module")
def engine(target):
    return engine_lib.Engine(target, config=config_lib.EngineConfig(max_length=64))


def prompt(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 101, length).tolist()


@pytest.mark.parametrize("ids, message", [
    ([3, -1, 4], "token id -1 is outside the vocabulary"),
    ([3, 101], "token id 101 is outside the vocabulary"),
    ([1.0, 2.0], "token ids must be integers"),
    ([], "non-empty 1-D"),
    ([[1, 2], [3, 4]], "non-empty 1-D"),
])
def test_bad_token_ids(engine, ids, message):
    with pytest.raises(config_lib.InputError, match=message):
        engine.generate([ids], max_new_tokens=MAX_NEW)


@pytest.mark.parametrize("ids, bad", [
    (np.array([3, 2**31 + 3], np.int64), 2**31 + 3),  # int32 would read -2147483645
    (np.array([2**32 + 3, 4], np.int64), 2**32 + 3),  # int32 would read 3: a valid, wrong token
    ([5, 2**40 + 7], 2**40 + 7),  # a Python list becomes int64 too
    (np.array([2**63 + 5], np.uint64), 2**63 + 5),  # int32 would read 5
    (np.array([2**31], np.uint32), 2**31),
])
def test_ids_that_int32_would_wrap_are_refused(engine, ids, bad):
    """The int64 -> int32 wrap (vLLM's gibberish bug): such ids are refused with their true value, never cast."""
    with pytest.raises(config_lib.InputError, match=f"token id {bad} is outside the vocabulary"):
        engine.generate([ids], max_new_tokens=MAX_NEW)
    with pytest.raises(config_lib.InputError, match=f"token id {bad} is outside"):
        inputs.as_token_ids(ids, 101)


def test_prompt_too_long_for_max_length(engine):
    with pytest.raises(config_lib.InputError, match=r"prompt 1 has 60 tokens.*more than max_length=64"):
        engine.generate([prompt(3), prompt(60)], max_new_tokens=MAX_NEW)


def test_bad_settings(target, engine):
    with pytest.raises(config_lib.InputError, match="max_new_tokens must be >= 1"):
        engine.generate([prompt(3)], max_new_tokens=0)
    with pytest.raises(config_lib.InputError, match="num_speculative_tokens must be an integer >= 0, got -1"):
        engine_lib.Engine(target, config=config_lib.EngineConfig(num_speculative_tokens=-1))
    with pytest.raises(config_lib.InputError, match="needs a draft head"):
        engine_lib.Engine(target, config=config_lib.EngineConfig(num_speculative_tokens=2))


def test_int64_ids_give_the_same_output_as_int32(engine):
    ids = np.asarray(prompt(9, seed=1))
    [wide] = engine.generate([ids.astype(np.int64)], max_new_tokens=MAX_NEW, ignore_eos=True)
    [narrow] = engine.generate([ids.astype(np.int32)], max_new_tokens=MAX_NEW, ignore_eos=True)
    assert wide.token_ids == narrow.token_ids and len(wide.token_ids) == MAX_NEW


def test_compile_count_stays_flat_within_buckets(target, xla_compilations):
    # A fresh engine (no persistent cache: every program it needs is compiled, and counted there).
    # Prompts of 17..23 tokens share the 32-wide prefill bucket and (+ 8 new + 1) the 32-slot cache.
    engine = engine_lib.Engine(target, config=config_lib.EngineConfig(steps_per_call=3, max_length=64))
    with xla_compilations() as compiled:
        engine.generate([prompt(23, seed=2)], max_new_tokens=MAX_NEW, ignore_eos=True)
    assert engine.num_compilations == 2  # prefill and decode
    assert len(compiled) >= 2, compiled  # the listener sees compilations
    with xla_compilations() as compiled:
        for length in (17, 19, 21, 22):
            # steps_per_call=3 with 8 new tokens: several dispatches of the same program per prompt.
            [result] = engine.generate([prompt(length, seed=length)], max_new_tokens=MAX_NEW, ignore_eos=True)
            assert len(result.token_ids) == MAX_NEW
    # Nothing compiles again: not the engine's programs, nor anything else on the host path.
    assert engine.num_compilations == 2
    assert compiled == []


def test_streaming_receives_exactly_the_result(target):
    engine = engine_lib.Engine(target, config=config_lib.EngineConfig(max_length=64, steps_per_call=3))
    prompts = [prompt(9, seed=3), prompt(12, seed=4)]
    streamed = collections.defaultdict(list)
    calls = []

    def on_tokens(index, ids):
        calls.append(index)
        streamed[index] += ids

    results = engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, on_tokens=on_tokens)
    assert [streamed[0], streamed[1]] == [r.token_ids for r in results]
    assert calls.count(0) > 1 and calls.count(1) > 1  # tokens arrived in pieces, not once at the end


@pytest.mark.parametrize("scheduler", ["static", "continuous"])
def test_each_result_is_handed_over_once_as_it_finishes(target, scheduler):
    """Three prompts through two rows: on_result gets every prompt's result once, as `generate` returns it
    (but for the continuous call's shared `calls` counters), the first before the last batch or slot is done."""
    engine = engine_lib.Engine(target, config=config_lib.EngineConfig(max_length=64, batch_size=2,
                                                                      scheduler=scheduler))
    prompts = [prompt(9, seed=3), prompt(12, seed=4), prompt(5, seed=5)]
    calls = []
    results = engine.generate(prompts, max_new_tokens=[MAX_NEW, 2, MAX_NEW] if scheduler == "continuous" else MAX_NEW,
                              ignore_eos=True, on_result=lambda index, result: calls.append((index, result)))
    handed = dict(calls)
    assert len(calls) == 3 and sorted(handed) == [0, 1, 2]
    assert [handed[index].token_ids for index in range(3)] == [result.token_ids for result in results]
    assert [handed[index].stats for index in range(3)] == [result.stats for result in results]
    # Static: the first batch's two come before the second batch's one; continuous: the short budget first.
    assert list(handed)[0] == (1 if scheduler == "continuous" else 0)


def test_eos_stops_a_row(target):
    """Two rows in one batch: the row that produces the EOS token stops there, the other runs on."""
    engine = engine_lib.Engine(target, config=config_lib.EngineConfig(max_length=64, batch_size=2))
    prompts = [prompt(10, seed=5), prompt(12, seed=6)]
    free = [r.token_ids for r in engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)]
    stop = next(token for token in free[0][1:] if token not in free[1])
    first = free[0].index(stop)
    assert first < MAX_NEW - 1
    stopped = [r.token_ids for r in engine.generate(prompts, max_new_tokens=MAX_NEW, eos_ids=[stop])]
    assert stopped == [free[0][:first + 1], free[1]]  # the EOS token is kept, nothing after it
    ignored = [r.token_ids for r in engine.generate(prompts, max_new_tokens=MAX_NEW, eos_ids=[stop], ignore_eos=True)]
    assert ignored == free


def test_sampling_is_reproducible_for_a_seed(engine):
    ids = prompt(11, seed=6)
    sampling = sampling_lib.Sampling(temperature=1.0, top_p=0.9)
    runs = [engine.generate([ids], max_new_tokens=MAX_NEW, sampling=sampling, seed=seed, ignore_eos=True)[0].token_ids
            for seed in (7, 7, 8)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]  # the seed is used (a tiny random model is far from deterministic at T=1)


def test_request_times_follow_the_batches(target):
    """Times count from the call's start: a static batch's rows share the first token (prefill
    emits it), each row finishes at or after it, and the next batch starts after the last finish."""
    engine = engine_lib.Engine(target, config=config_lib.EngineConfig(steps_per_call=2, max_length=64, batch_size=2))
    results = engine.generate([prompt(5, seed=7), prompt(9, seed=8), prompt(4, seed=9)], max_new_tokens=MAX_NEW,
                              ignore_eos=True)
    first, second, third = results
    assert first.first_token_seconds == second.first_token_seconds > 0
    assert all(r.finish_seconds >= r.first_token_seconds for r in results)
    assert third.first_token_seconds >= max(first.finish_seconds, second.finish_seconds)
