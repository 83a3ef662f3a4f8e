"""`SlotLoop(first_tokens_at_prefill=True)`, the server's loop: a round that refills slots returns
the new requests' first tokens after the prefill, without a run call, and the next round runs;
the tokens are those of the loop without it. Asserts on counters and tokens, never on time."""

import jax
import numpy as np
import pytest

from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib
from eagle_jax.serve import scheduler as scheduler_lib

BUDGETS = (9, 4, 12, 1, 7)  # a budget of 1 ends at its prefill


@pytest.fixture(scope="module")
def programs(speculation_target, agreeing_head):
    engine = engine_lib.Engine(speculation_target, agreeing_head(speculation_target.config, 0.3, residual=1.0, seed=1),
                               config=config_lib.EngineConfig(num_speculative_tokens=3, max_length=64, batch_size=2,
                                                              scheduler="continuous", steps_per_call=2))
    return engine.slot_programs(sampling_lib.SamplingMode())


def drain(loop: scheduler_lib.SlotLoop, prompts) -> tuple[dict, list]:
    """Every request's streamed tokens, and per round (run calls before, after, request ids with events)."""
    ids = [loop.add(np.asarray(p, np.int32), budget) for p, budget in zip(prompts, BUDGETS)]
    streamed, rounds = {i: [] for i in ids}, []
    while not loop.idle:
        before = loop.calls.run_calls
        events = loop.step()
        for event in events:
            streamed[event.request_id] += event.token_ids
        rounds.append((before, loop.calls.run_calls, events))
    return streamed, rounds


def test_first_tokens_come_before_any_run_call(programs, random_prompts):
    prompts = random_prompts((5, 9, 6, 8, 7), seed=2)
    expected, _ = drain(scheduler_lib.SlotLoop(programs, jax.random.key(0), refill_at=1), prompts)
    loop = scheduler_lib.SlotLoop(programs, jax.random.key(0), refill_at=1, first_tokens_at_prefill=True)
    streamed, rounds = drain(loop, prompts)
    assert streamed == expected
    assert [len(tokens) for tokens in streamed.values()] == list(BUDGETS)
    # The first round prefills two requests and runs nothing: each gets exactly its first token.
    before, after, events = rounds[0]
    assert before == after == 0 and sorted(len(e.token_ids) for e in events) == [1, 1]
    # Every round that refilled ran no steps, and a round follows each with a run call.
    refills = [r for r in rounds if r[0] == r[1]]
    assert len(refills) == loop.calls.prefill_calls and loop.calls.run_calls == len(rounds) - len(refills)
    # The request with a budget of 1 finished in a refill round, before any step.
    done_at_prefill = [e for before, after, events in refills for e in events if e.result is not None
                       and e.result.token_ids == streamed[3]]
    assert done_at_prefill and streamed[3] == expected[3]
