"""`SlotLoop(on_first_tokens=...)`, the server's loop: a round that refills slots hands over the new
requests' first tokens from their prefill, before the round's run call, and then runs as any
round does; the tokens are those of the loop without it. Asserts on counters and tokens, never on
time."""

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


def drain(loop: scheduler_lib.SlotLoop, prompts, streamed: dict | None = None) -> tuple[dict, list]:
    """Every request's streamed tokens (added to `streamed`), and each round's (run calls before, after, events)."""
    ids = [loop.add(np.asarray(p, np.int32), budget) for p, budget in zip(prompts, BUDGETS)]
    streamed = {i: [] for i in ids} if streamed is None else streamed
    rounds = []
    while not loop.idle:
        before = loop.calls.run_calls
        events = loop.step()
        for event in events:
            streamed[event.request_id] += event.token_ids
        rounds.append((before, loop.calls.run_calls, events))
    return streamed, rounds


def test_first_tokens_come_from_the_prefill_before_the_run_call(programs, random_prompts):
    prompts = random_prompts((5, 9, 6, 8, 7), seed=2)
    expected, _ = drain(scheduler_lib.SlotLoop(programs, jax.random.key(0), refill_at=1), prompts)
    streamed = {i: [] for i in range(len(prompts))}
    handed = []  # (run calls so far, events) per hand-over

    def on_first_tokens(events):
        handed.append((loop.calls.run_calls, events))
        for event in events:
            streamed[event.request_id] += event.token_ids

    loop = scheduler_lib.SlotLoop(programs, jax.random.key(0), refill_at=1, on_first_tokens=on_first_tokens)
    streamed, rounds = drain(loop, prompts, streamed)
    assert streamed == expected
    assert [len(tokens) for tokens in streamed.values()] == list(BUDGETS)
    # Every request's first token, and only that, came through a hand-over; the first one came
    # before any run call, and each came before its round's run call.
    firsts = {e.request_id: e.token_ids for _, events in handed for e in events}
    assert firsts == {i: tokens[:1] for i, tokens in streamed.items()}
    assert all(e.result is None for _, events in handed for e in events)
    assert handed[0][0] == 0 and sorted(len(e.token_ids) for e in handed[0][1]) == [1, 1]
    refill_rounds = [(before, after) for before, after, _ in rounds if after > before]
    assert {before for before, _ in handed} <= {before for before, _ in refill_rounds}
    # No round is spent on the first tokens: every round ran a call, and each refill fetched once more.
    assert loop.calls.run_calls == len(rounds) and loop.calls.syncs == len(rounds) + loop.calls.prefill_calls
    # The request with a budget of 1 finished at its prefill; its result came with the next round.
    result = next(e.result for _, _, events in rounds for e in events if e.request_id == 3 and e.result)
    assert result.token_ids == expected[3] == firsts[3]
