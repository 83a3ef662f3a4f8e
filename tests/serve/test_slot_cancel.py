"""A cancelled request stops costing device work: its row is done on the device at the next round.

Asserts on the device state and the loop's counters (tokens, steps), never on time.
"""

import jax
import numpy as np
import pytest

from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib
from eagle_jax.serve import scheduler as scheduler_lib

MAX_LENGTH = 128
STEPS_PER_CALL = 2
BUDGET = 60  # far more than a few rounds produce, so neither row ends by itself in the test


@pytest.fixture(scope="module")
def programs(speculation_target, agreeing_head):
    engine = engine_lib.Engine(speculation_target, agreeing_head(speculation_target.config, 0.3, residual=1.0, seed=1),
                               config=config_lib.EngineConfig(num_speculative_tokens=3, max_length=MAX_LENGTH,
                                                              batch_size=3, scheduler="continuous",
                                                              steps_per_call=STEPS_PER_CALL))
    return engine.slot_programs(sampling_lib.SamplingMode())


def rows_of(loop, ids):
    return {slot.request_id: row for row, slot in enumerate(loop._slots) if slot is not None and slot.request_id in ids}


def test_a_cancelled_row_stops_stepping_while_another_runs(programs, random_prompts):
    loop = scheduler_lib.SlotLoop(programs, jax.random.key(0), refill_at=1)
    kept, cancelled = (loop.add(np.asarray(p, np.int32), BUDGET) for p in random_prompts((5, 9), seed=3))
    streamed = {kept: [], cancelled: []}
    for event in loop.step():
        streamed[event.request_id] += event.token_ids
    rows = rows_of(loop, {kept, cancelled})
    loop.cancel(cancelled)
    before = loop._host
    results = {}
    for _ in range(3):
        for event in loop.step():
            streamed[event.request_id] += event.token_ids
            if event.result is not None:
                results[event.request_id] = event.result
    after = loop._host
    gone, running = rows[cancelled], rows[kept]
    # The cancelled row: done on the device, not one more token or step; the other row goes on.
    assert bool(after.done[gone]) and not bool(after.done[running])
    assert int(after.num_generated[gone]) == int(before.num_generated[gone])
    assert int(after.num_steps[gone]) == int(before.num_steps[gone])
    assert int(after.num_generated[running]) > int(before.num_generated[running])
    assert int(after.num_steps[running]) - int(before.num_steps[running]) == 3 * STEPS_PER_CALL
    # Its Result, as before: the tokens streamed before the cancel, and its acceptance counters.
    assert set(results) == {cancelled} and results[cancelled].token_ids == streamed[cancelled]
    assert results[cancelled].stats["num_drafts"] == int(before.num_drafts[gone]) > 0
    assert loop.num_running == 1


def test_with_no_other_row_the_loop_idles_and_a_refill_reuses_the_row(programs, random_prompts):
    loop = scheduler_lib.SlotLoop(programs, jax.random.key(0), refill_at=1)
    first = loop.add(np.asarray(random_prompts((7,), seed=5)[0], np.int32), BUDGET)
    loop.step()
    [row] = rows_of(loop, {first}).values()
    loop.cancel(first)
    calls = loop.calls.run_calls
    [event] = loop.step()
    assert event.request_id == first and event.result is not None
    assert loop.idle and loop.calls.run_calls == calls  # no device call for a slot nobody holds
    assert bool(np.asarray(loop._state.done)[row])
    # The freed row serves the next request from its start.
    second = loop.add(np.asarray(random_prompts((4,), seed=6)[0], np.int32), 5)
    results = {}
    while not loop.idle:
        results.update({e.request_id: e.result for e in loop.step() if e.result is not None})
    assert len(results[second].token_ids) == 5
