"""`SlotLoop(full_steps=...)`, the server's loop: while every slot is held and requests wait, a run
call may take more steps than `steps_per_call` (it still returns once `refill_at` rows finish);
otherwise calls stay short. The tokens are those of the loop without it. Asserts on step counts
and tokens, never on time."""

import jax
import numpy as np
import pytest

from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib
from eagle_jax.serve import scheduler as scheduler_lib

STEPS_PER_CALL = 2
BUDGETS = (24, 30, 18, 27, 21, 25)


@pytest.fixture(scope="module")
def programs(speculation_target, agreeing_head):
    engine = engine_lib.Engine(speculation_target, agreeing_head(speculation_target.config, 0.3, residual=1.0, seed=1),
                               config=config_lib.EngineConfig(num_speculative_tokens=3, max_length=64, batch_size=2,
                                                              scheduler="continuous", steps_per_call=STEPS_PER_CALL))
    return engine.slot_programs(sampling_lib.SamplingMode())


def drain(loop: scheduler_lib.SlotLoop, prompts) -> tuple[dict, list, list]:
    """Every request's tokens, and the steps of each round whose call started with every slot
    held and requests waiting (`full`), and of every other round (`short`)."""
    ids = [loop.add(np.asarray(p, np.int32), budget) for p, budget in zip(prompts, BUDGETS)]
    tokens = {i: [] for i in ids}
    full, short = [], []
    while not loop.idle:
        # The round refills the free slots first: its call starts full if more requests wait than slots are free.
        starts_full = loop.num_waiting > loop.programs.batch_size - loop.num_running
        before = loop.calls.run_steps
        for event in loop.step():
            tokens[event.request_id] += event.token_ids
        (full if starts_full else short).append(loop.calls.run_steps - before)
    return tokens, full, short


def test_calls_run_longer_only_while_every_slot_is_held_and_requests_wait(programs, random_prompts):
    prompts = random_prompts((5, 9, 6, 8, 7, 4), seed=3)
    expected, _, _ = drain(scheduler_lib.SlotLoop(programs, jax.random.key(0), refill_at=2), prompts)
    tokens, full, short = drain(scheduler_lib.SlotLoop(programs, jax.random.key(0), refill_at=2, full_steps=16),
                                prompts)
    assert tokens == expected
    assert [len(tokens[i]) for i in range(len(prompts))] == list(BUDGETS)
    assert full and short  # both kinds of round happened
    assert max(short) <= STEPS_PER_CALL < max(full) <= 16
