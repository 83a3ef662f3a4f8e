"""What a host loop does around each device call, for both schedulers (`scheduler`, `static_batch`):
count and time the calls, pick attention's reach, fetch what the host reads, stop rows the host
ended, and build each row's `Result`."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import numpy as np

from eagle_jax.decode import state as state_lib
from eagle_jax.serve import outputs as outputs_lib
from eagle_jax.serve import result as result_lib


@dataclasses.dataclass
class CallCounts:
    """What one host loop asked of the device: to attribute time between device and host.

    `sync_seconds` is the host's wall time blocked fetching results (it waits there for the
    device's queued work); `host_seconds` is the rest of the loop's wall time (inputs, dispatch,
    harvesting, streaming). On an asynchronous device the two add up to the loop's wall time.
    `run_seconds` and `prefill_seconds` are the parts of `host_seconds` spent inside run calls and
    inside prefill and insert calls: dispatch alone where the device runs asynchronously, the
    whole device loop where a call returns only when its loop has ended (XLA:GPU's data-dependent
    `while_loop`), so that `run_seconds / run_steps` is then the time a step costs.
    """

    run_calls: int = 0
    argmax_run_calls: int = 0  # run calls that took the argmax step: every running row greedy, unprocessed
    row_run_calls: int = 0  # run calls over a row bucket below the slots (the held slots and idle padding)
    # Device-loop iterations over all run calls (each call: its longest-running row's steps; with
    # steps_per_check > 1, the idle steps up to a call's exit test are not counted).
    run_steps: int = 0
    prefill_calls: int = 0
    insert_calls: int = 0
    syncs: int = 0  # device-to-host fetches that wait for the device
    sync_seconds: float = 0.0
    host_seconds: float = 0.0
    run_seconds: float = 0.0
    prefill_seconds: float = 0.0

    @property
    def device_calls(self) -> int:
        return self.run_calls + self.prefill_calls + self.insert_calls

    def as_dict(self) -> dict:
        return dict(dataclasses.asdict(self), device_calls=self.device_calls)

    def timed(self, seconds: str, call: Callable, *args):
        """`call(*args)`, its wall time added to the field `seconds` ("run_seconds" or "prefill_seconds")."""
        began = time.perf_counter()
        result = call(*args)
        setattr(self, seconds, getattr(self, seconds) + time.perf_counter() - began)
        return result

    def fetch(self, arrays):
        """`jax.device_get(arrays)`, counted as a sync."""
        began = time.perf_counter()
        fetched = jax.device_get(arrays)
        self.syncs += 1
        self.sync_seconds += time.perf_counter() - began
        return fetched


def result(output: outputs_lib.RowOutput, stats: dict, seconds: float, compile_seconds: float,
           first_token_seconds: float | None, finish_seconds: float, calls: dict | None = None,
           finish_reason: str | None = None) -> result_lib.Result:
    """A row's `Result` from its host output (`finish_reason` overrides its own, e.g. "abort")."""
    return result_lib.Result(
        token_ids=list(output.token_ids), seconds=seconds, compile_seconds=compile_seconds, stats=stats,
        first_token_seconds=first_token_seconds, finish_seconds=finish_seconds, calls=calls or {},
        finish_reason=finish_reason or output.finish_reason or "length", stop_reason=output.stop_reason,
        logprobs=output.logprobs, text=output.text())


def host_view(state: state_lib.DecodeState, logprobs: bool = True) -> state_lib.DecodeState:
    """What a host loop fetches after a call: tokens, cursors, counters and (when `logprobs`: some row
    asked for them) logprobs; not the caches, the settings or the penalties' token counts."""
    return state.replace(cache=None, draft_cache=None, pending_tokens=None, pending_features=None,
                         pending_count=None, next_token=None, rng=None, params=None, counts=None,
                         logprobs=state.logprobs if logprobs else None)


def stop_rows(state: state_lib.DecodeState, done: np.ndarray, rows) -> state_lib.DecodeState:
    """`state` with `rows` marked done (from the host copy `done`), where the device keeps `done`:
    a row the host ended (a stop string, a cancel) takes no more steps."""
    mask = np.array(done, bool)
    mask[list(rows)] = True
    return state.replace(done=jax.device_put(mask, state.done.sharding))


def attend_length(lengths: Sequence[int], opts: state_lib.Options, steps_per_call: int,
                  running: Sequence[tuple[int, int, int]]) -> int:
    """The shortest of `lengths` (ascending) above every cache slot the next device call can touch.

    Args:
        running: (prompt length, budget, tokens generated so far) of each row still running.
            A row's step writes and reads slots below prompt + generated + the step's headroom;
            one call adds at most steps_per_call x (k + 1) tokens, never past the budget.
    """
    need = 0
    for prompt_length, budget, generated in running:
        reach = min(int(generated) + steps_per_call * (opts.k + 1), int(budget))
        need = max(need, int(prompt_length) + reach + opts.cache_headroom)
    return next((length for length in lengths if length >= need), lengths[-1])
