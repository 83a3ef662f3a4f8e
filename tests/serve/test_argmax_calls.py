"""Slot programs compiled for a generous sampling mode take the argmax step in the device calls
where every running row is greedy and unprocessed, and the processing step otherwise: the same
tokens either way, and rows that need processing are processed whatever ran before them."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from eagle_jax.decode import sampling
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib
from eagle_jax.serve import scheduler as scheduler_lib

ROWS, K = 3, 3
MODE = sampling.SamplingMode(sample=True, penalties=True, min_p=True, top_k=8, top_p=True, logprobs=3,
                             min_tokens=True)
GREEDY = sampling.Sampling()
SEEDED = sampling.Sampling(temperature=1.0, top_k=8, repetition_penalty=1.5, seed=5)


@pytest.fixture(scope="module")
def engines(speculation_target, agreeing_head):
    head = agreeing_head(speculation_target.config, 0.3, residual=1.0, seed=1)

    def make(mode):
        return engine_lib.Engine(speculation_target, head, config=config_lib.EngineConfig(
            num_speculative_tokens=K, max_length=64, batch_size=ROWS, scheduler="continuous", sampling_mode=mode,
            steps_per_call=2))

    return {"generous": make(MODE), "argmax": make(None)}


@pytest.fixture(scope="module")
def prompts(random_prompts):
    return [random_prompts((6,), seed=seed)[0] for seed in range(ROWS + 1)]


def test_greedy_rows_take_the_argmax_step(engines, prompts):
    """All greedy: every run call of the generous programs is an argmax call, with the tokens of
    programs compiled for greedy alone."""
    results = engines["generous"].generate(prompts, max_new_tokens=12)
    expected = engines["argmax"].generate(prompts, max_new_tokens=12)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    calls = results[0].calls
    assert calls["run_calls"] > 1 and calls["argmax_run_calls"] == calls["run_calls"], calls


def test_a_processed_row_switches_calls_while_it_runs(engines, prompts):
    """A seeded sampled row with a short budget beside greedy rows: the calls while it runs process, those
    after it take the argmax; the greedy rows' tokens are unchanged and the sampled row's are
    its own (as alone), so it was processed at every step."""
    generous = engines["generous"]
    alone = generous.generate(prompts[:1], max_new_tokens=4, sampling=SEEDED)[0].token_ids
    assert alone != generous.generate(prompts[:1], max_new_tokens=4)[0].token_ids  # its draws are not the argmax
    results = generous.generate(prompts[:ROWS], max_new_tokens=[4] + [16] * (ROWS - 1),
                                sampling=[SEEDED] + [GREEDY] * (ROWS - 1))
    assert results[0].token_ids == alone
    expected = engines["argmax"].generate(prompts[1:ROWS], max_new_tokens=16)
    assert [r.token_ids for r in results[1:]] == [r.token_ids for r in expected]
    calls = results[0].calls
    assert 0 < calls["argmax_run_calls"] < calls["run_calls"], calls


def test_a_processed_row_after_argmax_calls(engines, prompts):
    """Greedy rows fill the slots and run argmax calls; a seeded, penalised request waits for a
    slot, then gets its own tokens: its counts start from its prompt, whatever the calls before it skipped."""
    generous = engines["generous"]
    alone = generous.generate(prompts[ROWS:], max_new_tokens=8, sampling=SEEDED)[0].token_ids
    results = generous.generate(prompts, max_new_tokens=[6] * ROWS + [8], sampling=[GREEDY] * ROWS + [SEEDED])
    assert results[ROWS].token_ids == alone
    calls = results[0].calls
    assert 0 < calls["argmax_run_calls"] < calls["run_calls"], calls


def test_argmax_calls_leave_the_token_counts_alone(engines, prompts):
    """The argmax step does no penalty bookkeeping: no row it runs reads its counts, and a penalised
    row starts its own at its prefill (as the test above checks). After argmax calls, each greedy
    row's counts hold the one token its prefill emitted; after processing calls, every token."""
    programs = engines["generous"].slot_programs(MODE)

    def counted(sampling_of_first_row):
        loop = scheduler_lib.SlotLoop(programs, jax.random.key(0))
        for row, prompt in enumerate(prompts[:ROWS]):
            loop.add(np.asarray(prompt, np.int32), 10, sampling_of_first_row if row == 0 else GREEDY)
        loop.step()  # refill and one run call, before any row finishes
        assert loop.num_running == ROWS
        return np.asarray(jax.device_get(loop._state.counts.output)).sum(axis=1), loop.calls

    sums, calls = counted(GREEDY)
    assert calls.argmax_run_calls == calls.run_calls == 1
    assert sums.tolist() == [1] * ROWS
    sums, calls = counted(SEEDED)
    assert calls.argmax_run_calls == 0
    assert all(total > 1 for total in sums), sums
