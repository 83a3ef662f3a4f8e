"""Static batching on the host: one batch decodes until its longest row finishes (or the host
ends it: stop strings)."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from eagle_jax.decode import state as state_lib
from eagle_jax.serve import device_calls
from eagle_jax.serve import outputs as outputs_lib
from eagle_jax.serve import programs as programs_lib
from eagle_jax.serve import result as result_lib


def generate_static(programs: programs_lib.BatchPrograms, outputs: Sequence[outputs_lib.RowOutput],
                    on_tokens: Callable[[int, list[int]], None] | None = None,
                    began: float | None = None) -> list[result_lib.Result]:
    """One static batch: prefill, then step (donating the state) until every row is done.

    Args:
        outputs: the host side of the batch's rows (its first rows; the rest are idle padding).
        on_tokens: called as `on_tokens(row, new_ids)` after prefill and each device call.
        began: `time.perf_counter()` at the caller's start, which the rows' times count from;
            default now.
    """
    num_rows = len(outputs)
    prefilled = time.perf_counter()
    began = prefilled if began is None else began
    calls = device_calls.CallCounts(prefill_calls=1)
    state = calls.timed("prefill_seconds", programs.prefill)
    # Streaming and stop strings need the tokens as they come; otherwise they are read once, at the end.
    watch = on_tokens is not None or any(output.stream is not None and output.sampling.stop for output in outputs)
    wanted = any(output.logprobs is not None for output in outputs)  # the logprobs buffers, [B, C, N]
    first_token = None
    finish = np.full(num_rows, np.nan)
    steps = np.zeros(num_rows, np.int64)  # num_steps as of the last fetch (prefill: none)
    while True:
        counts, done, num_steps = calls.fetch((state.num_generated, state.done, state.num_steps))
        calls.run_steps += int(np.max(num_steps[:num_rows] - steps))
        steps = num_steps[:num_rows]
        if watch:
            _take(outputs, calls.fetch((state.output, state.logprobs if wanted else None)), counts, on_tokens)
            ended = [row for row, output in enumerate(outputs) if output.finished and not done[row]]
            if ended:  # stop strings: those rows take no more steps
                state, done = device_calls.stop_rows(state, done, ended), np.array(done | np.isin(np.arange(len(done)), ended))
        now = time.perf_counter() - began
        first_token = now if first_token is None else first_token  # prefill emits every row's first token
        finish[np.isnan(finish) & done[:num_rows]] = now
        if np.all(done):
            break
        running = [(programs.prompt_lengths[row], programs.opts.max_new_tokens, counts[row])
                   for row in range(num_rows) if not done[row]]
        state = calls.timed("run_seconds", programs.step, state, device_calls.attend_length(
            tuple(programs.runs), programs.opts, programs.steps_per_call, running))
        calls.run_calls += 1
    host = calls.fetch(device_calls.host_view(state, wanted))
    _take(outputs, (host.output, host.logprobs), host.num_generated, on_tokens)
    seconds = time.perf_counter() - prefilled
    stats = state_lib.stats(host, programs.opts)
    calls.host_seconds = time.perf_counter() - prefilled - calls.sync_seconds
    return [device_calls.result(output, stats[row], seconds, programs.compile_seconds, first_token, float(finish[row]),
                   calls.as_dict()) for row, output in enumerate(outputs)]


def _take(outputs: Sequence[outputs_lib.RowOutput], fetched, counts: np.ndarray,
          on_tokens: Callable[[int, list[int]], None] | None) -> None:
    """Hands each row its new tokens (`RowOutput.take`) and streams those it keeps."""
    output, logprobs = fetched
    for row, row_output in enumerate(outputs):
        new, _ = row_output.take(output[row], int(counts[row]), outputs_lib.row_logprobs(logprobs, row))
        if on_tokens is not None and new:
            on_tokens(row, new)
