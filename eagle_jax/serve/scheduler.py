"""Continuous batching on the host over fixed decode slots (static batches: `static_batch`).

`SlotLoop` and `generate`: rows refill from a queue as they finish, after JetStream's
prefill / insert / generate split. The device holds one `DecodeState` of
`batch_size` rows (slots) with one cache length, so no program recompiles across prompts:

* prefill: the ordinary `speculative.start` on the requests a round starts, padded to one of a
  few fixed row counts R (`inputs.row_buckets`) and widths w: one call prefills every slot a round
  frees, and one new request prefills one row, however many slots there are. Its caches are w
  slots long, all that a prefill writes, not the slots' whole cache;
* insert: scatters the prefilled rows into their slots of the big state (donated, so in place),
  only the first w slots of its caches: a refill moves what the prefill wrote, not the whole cache;
* run: the ordinary `speculative.run_steps` on all slots, returning once `refill_at` of its
  rows have finished (a traced argument); idle slots are `done` and change nothing.

`SlotLoop` is that loop as a stepping object (requests added and cancelled between rounds,
one round per `step`), for a server's device-loop thread; `generate` runs it over a list of
prompts. Each round is one sync and three device calls, however many slots it refills.

Every request brings its own `Sampling`: its row's settings and stop ids are written at its
prefill (`sampling.SamplingParams`), so one set of programs serves any mix the programs'
sampling mode covers; the host finds stop strings and shapes logprobs (`outputs.RowOutput`).
The engine compiles the programs (`programs`, `Engine.slot_programs`); this module owns the
host loop, `device_calls` what it does around each call.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Sequence

import jax
import numpy as np

from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.decode import state as state_lib
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import device_calls
from eagle_jax.serve import inputs as inputs_lib
from eagle_jax.serve import outputs as outputs_lib
from eagle_jax.serve import programs as programs_lib
from eagle_jax.serve import result as result_lib


# What a run call needs when every running row is greedy and unprocessed: the argmax step.
ARGMAX = sampling_lib.SamplingMode()
# A refill's prefill key, compiled: op by op, fold_in dispatches each of its threefry ops.
_fold_in = jax.jit(jax.random.fold_in)


@dataclasses.dataclass(frozen=True)
class Request:
    """A queued request: one row (one sample of a prompt)."""

    request_id: int
    prompt: np.ndarray  # int32 ids
    budget: int  # its max_new_tokens
    sampling: sampling_lib.Sampling
    seed: int | None  # its row's seed (`Sampling.sample_seed`), None: unseeded


@dataclasses.dataclass
class Slot:
    """The request a decode slot holds, as of the last harvest."""

    request_id: int
    prompt_length: int
    budget: int  # its max_new_tokens
    prefilled: float  # `time.perf_counter()` at its prefill
    output: outputs_lib.RowOutput  # its tokens so far, stop strings, logprobs, finish reason
    generated: int = 1  # tokens so far (prefill emits one)
    first_token_seconds: float | None = None  # from `began`, at the first sync after its prefill
    cancelled: bool = False


@dataclasses.dataclass(frozen=True)
class Event:
    """What one round brought a request: its new token ids (and their logprob entries, when it asked
    for them), and its `Result` once finished."""

    request_id: int
    token_ids: list[int]
    result: result_lib.Result | None = None
    logprobs: list = dataclasses.field(default_factory=list)


class SlotLoop:
    """Continuous batching over `programs.batch_size` decode slots, one round per `step`.

    Args:
        programs: the compiled slot programs (`Engine.slot_programs`).
        rng: the seed key. A refill's prefill uses `fold_in(prefill key, i)`, i being the first
            request it starts; the steps share the state's key, so sampled outputs are
            reproducible for a seed, batch size, steps_per_call and refill_at (greedy outputs do
            not depend on them).
        refill_at: how many rows must finish before a run call returns (1 to batch_size).
        began: `time.perf_counter()` that every request's times count from; default now.
        eos_ids: the model's EOS ids; a request ends at them unless it ignores EOS (none: no row
            ends at EOS on the device; a server may watch for them on the host instead).
        tokenizer: decodes each request's text and finds its stop strings (`outputs.RowOutput`).
        on_first_tokens: called, in a round that refills slots, with the new requests' first
            tokens (an `Event` each, read from the prefill's rows) before the round's run call, so
            that a server's time to first token waits for the prefill and not for the steps too
            (on a GPU a run call returns when its loop ends). One small fetch more a refill; the
            round's own events then carry each request's tokens after the first. None: the first
            token comes with the rest of the round's (offline).
        full_steps: the steps a run call may take while every slot is held and requests wait
            (default `programs.steps_per_call`). No waiting request can start before rows finish
            then, and the call returns once `refill_at` of them have, so a longer call delays
            nobody and saves the rounds (a fetch, the host's work) that shorter calls would end
            in. A server keeps its calls short otherwise: a request that arrives while a slot is
            free waits for the call in flight.
    """

    def __init__(self, programs: programs_lib.SlotPrograms, rng: jax.Array, refill_at: int = 1,
                 began: float | None = None, eos_ids: tuple[int, ...] = (), tokenizer=None,
                 on_first_tokens: Callable[[list[Event]], None] | None = None, full_steps: int | None = None):
        self.programs = programs
        self.refill_at = refill_at
        self.full_steps = full_steps or programs.steps_per_call
        self.on_first_tokens = on_first_tokens
        self.began = time.perf_counter() if began is None else began
        self.eos_ids, self.tokenizer = tuple(eos_ids), tokenizer
        self.calls = device_calls.CallCounts()
        state_rng, self._prefill_rng = jax.random.split(rng)
        _fold_in(self._prefill_rng, 0)  # compiled now, not in the first refill
        self._state = programs.empty(state_rng)
        self._queue: collections.deque[Request] = collections.deque()
        self._slots: list[Slot | None] = [None] * programs.batch_size
        self._next_id = 0
        self._steps = np.zeros(programs.batch_size, np.int64)  # each row's num_steps as of the last fetch
        self._host = None  # the last fetched state (no caches): cancelled rows' results are read from it
        self._to_stop: set[int] = set()  # rows the host ended since the last fetch: done on the device next round

    def add(self, prompt_ids: np.ndarray, budget: int, sampling: sampling_lib.Sampling = sampling_lib.Sampling(),
            sample: int = 0) -> int:
        """Queues an int32 prompt (at most `programs.widths[-1]` tokens) with its max_new_tokens and
        settings (`sample`: which of its n samples this row is, for its seed); returns its id.

        Raises:
            config.InputError: settings the programs' sampling mode does not cover.
        """
        mode = self.programs.opts.sampling_mode
        if not mode.covers(sampling):
            raise config_lib.InputError(f"{sampling} asks for more than these programs' sampling mode {mode} covers")
        request_id = self._next_id
        self._next_id += 1
        self._queue.append(Request(request_id, prompt_ids, int(budget), sampling, sampling.sample_seed(sample)))
        return request_id

    def cancel(self, request_id: int) -> None:
        """Drops a queued request, or frees an active one's slot at the next round.

        An active request's `Result` (its tokens and acceptance counters as of the last round) comes
        in the next `step`'s events, so that its drafts are still counted; a queued one has none.
        """
        self._queue = collections.deque(entry for entry in self._queue if entry.request_id != request_id)
        for slot in self._slots:
            if slot is not None and slot.request_id == request_id:
                slot.cancelled = True

    @property
    def num_running(self) -> int:
        """Requests holding a slot."""
        return sum(slot is not None and not slot.cancelled for slot in self._slots)

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._queue)

    @property
    def idle(self) -> bool:
        """No request active or queued."""
        return not self._queue and all(slot is None for slot in self._slots)

    def step(self) -> list[Event]:
        """One round: refill free slots from the queue (and fetch the new requests' first tokens,
        with `on_first_tokens`), one run call, one fetch.

        Returns:
            An event for each request with new tokens or finished in this round.
        """
        events = self._harvest_cancelled()
        if self._to_stop:
            self._state = device_calls.stop_rows(self._state, self._host.done, self._to_stop)
            self._to_stop.clear()
        started = self._refill()
        if all(slot is None for slot in self._slots):
            return events
        if started is not None and self.on_first_tokens is not None:
            self.on_first_tokens(self._first_tokens(*started))
        programs, calls = self.programs, self.calls
        running = [(slot.prompt_length, slot.budget, slot.generated) for slot in self._slots if slot is not None]
        # Leave the device loop to refill only when slots can be refilled, and as a batch.
        wait_for = min(self.refill_at, len(self._queue)) if self._queue else programs.batch_size + 1
        steps = self.full_steps if self._queue and len(running) == programs.batch_size else programs.steps_per_call
        slot_ids = self._rows_to_run()
        rows = programs.batch_size if slot_ids is None else len(slot_ids)
        length = device_calls.attend_length(programs.attend_lengths[rows], programs.opts, steps, running)
        argmax = all(ARGMAX.covers(slot.output.sampling) for slot in self._slots if slot is not None)
        self._state = calls.timed("run_seconds", programs.run, self._state, length, np.int32(wait_for), argmax,
                                  slot_ids, steps)
        calls.run_calls += 1
        calls.argmax_run_calls += argmax
        calls.row_run_calls += slot_ids is not None
        return events + self._harvest()

    def _rows_to_run(self) -> np.ndarray | None:
        """The slots a run call takes: the held ones, padded with idle slots (done, so unchanged) to
        the fewest rows of `programs.row_counts`; None while that is every slot."""
        held = [row for row, slot in enumerate(self._slots) if slot is not None]
        rows = inputs_lib.smallest_bucket(len(held), self.programs.row_counts)
        if rows == self.programs.batch_size:
            return None
        idle = [row for row, slot in enumerate(self._slots) if slot is None]
        return np.array(held + idle[:rows - len(held)], np.int32)

    def _harvest(self) -> list[Event]:
        """One fetch (tokens, cursors, logprobs and the acceptance counters, not the caches; the
        logprobs buffers ([B, C, N]) only while a request wants them), then each slot's new tokens
        and, for the rows that finished, their `Result`s; their slots are freed."""
        programs, calls = self.programs, self.calls
        host = self._fetch(self._state, [slot for slot in self._slots if slot is not None])
        calls.run_steps += int(np.max(host.num_steps - self._steps))
        self._steps = np.array(host.num_steps, np.int64)
        self._host = host
        now = time.perf_counter()
        events = []
        stats = None  # computed once, when a row finishes
        for row, slot in enumerate(self._slots):
            if slot is None:
                continue
            if slot.first_token_seconds is None:  # prefill emitted it
                slot.first_token_seconds = now - self.began
            new, logprobs = _take(slot, host, row)
            finished = None
            if host.done[row] or slot.output.finished:
                if not host.done[row]:  # a stop string: the device row stops at the next round
                    self._to_stop.add(row)
                stats = state_lib.stats(host, programs.opts) if stats is None else stats
                finished = device_calls.result(slot.output, stats[row], now - slot.prefilled, programs.compile_seconds,
                                  slot.first_token_seconds, now - self.began)
                self._slots[row] = None
            if new or finished is not None:
                events.append(Event(slot.request_id, new, finished, logprobs))
        return events

    def _harvest_cancelled(self) -> list[Event]:
        """Frees the cancelled slots; each request's `Result` as of the last fetch (none before one)."""
        events = []
        stats = None
        for row, slot in enumerate(self._slots):
            if slot is None or not slot.cancelled:
                continue
            self._slots[row] = None
            if self._host is None:
                continue
            stats = state_lib.stats(self._host, self.programs.opts) if stats is None else stats
            now = time.perf_counter()
            if not self._host.done[row]:
                self._to_stop.add(row)
            events.append(Event(slot.request_id, [], device_calls.result(
                slot.output, stats[row], now - slot.prefilled, self.programs.compile_seconds,
                slot.first_token_seconds, now - self.began, finish_reason="abort")))
        return events

    def _refill(self) -> tuple[state_lib.DecodeState, list[int]] | None:
        """One prefill and one insert call fill every free slot from the queue; returns the
        prefill's rows and the slot each of the started requests took (row i: slot i), or None
        if none started."""
        free = [row for row, slot in enumerate(self._slots) if slot is None]
        starting = [(row, self._queue.popleft()) for row in free[:len(self._queue)]]
        if not starting:
            return None
        now = time.perf_counter()
        programs = self.programs
        requests = [request for _, request in starting]
        tokens, lengths, budgets = _prefill_inputs([request.prompt for request in requests],
                                                   [request.budget for request in requests],
                                                   programs.row_counts, programs.widths)
        padding = len(lengths) - len(requests)  # rows of one token and a budget of one, dropped by insert
        params = sampling_lib.SamplingParams.stack(
            [request.sampling for request in requests] + [sampling_lib.Sampling()] * padding, eos_ids=self.eos_ids,
            stop_width=sampling_lib.STOP_WIDTH, seeds=[request.seed for request in requests] + [None] * padding)
        key = _fold_in(self._prefill_rng, requests[0].request_id)
        rows = self.calls.timed("prefill_seconds", programs.prefill, tokens, lengths, budgets, params, key)
        slot_ids = np.full(len(lengths), programs.batch_size, np.int32)
        for index, (row, request) in enumerate(starting):
            slot_ids[index] = row
            self._steps[row] = 0
            output = outputs_lib.RowOutput(request.sampling, request.sampling.stop_ids(self.eos_ids), self.tokenizer)
            self._slots[row] = Slot(request.request_id, len(request.prompt), request.budget, now, output)
        self._state = self.calls.timed("prefill_seconds", programs.insert, self._state, rows, slot_ids)
        self.calls.prefill_calls += 1
        self.calls.insert_calls += 1
        return rows, [row for row, _ in starting]

    def _first_tokens(self, rows: state_lib.DecodeState, slots: list[int]) -> list[Event]:
        """The started requests' first tokens, fetched from their prefill's rows (`rows`, which
        insert did not donate): waits for the prefill, not for the insert queued after it."""
        host = self._fetch(rows, [self._slots[slot] for slot in slots])
        now = time.perf_counter()
        events = []
        for index, slot_index in enumerate(slots):
            slot = self._slots[slot_index]
            slot.first_token_seconds = now - self.began
            new, logprobs = _take(slot, host, index)
            if new:
                events.append(Event(slot.request_id, new, None, logprobs))
        return events

    def _fetch(self, state: state_lib.DecodeState, slots: list[Slot]) -> state_lib.DecodeState:
        """The host view of `state` (`device_calls.host_view`), with logprobs if one of `slots` wants them."""
        wanted = any(slot.output.logprobs is not None for slot in slots)
        return self.calls.fetch(device_calls.host_view(state, wanted))


def _take(slot: Slot, host: state_lib.DecodeState, row: int) -> tuple[list[int], list]:
    """The slot's new tokens (and their logprob entries) from row `row` of a fetched state; its count updated."""
    slot.generated = int(host.num_generated[row])
    return slot.output.take(host.output[row], slot.generated, outputs_lib.row_logprobs(host.logprobs, row))


def generate(programs: programs_lib.SlotPrograms, prompts: Sequence[np.ndarray], budgets: Sequence[int],
             rng: jax.Array, on_tokens: Callable[[int, list[int]], None] | None = None,
             began: float | None = None, refill_at: int = 1,
             samplings: Sequence[sampling_lib.Sampling] | None = None, samples: Sequence[int] | None = None,
             eos_ids: tuple[int, ...] = (), tokenizer=None,
             on_result: Callable[[int, result_lib.Result], None] | None = None) -> list[result_lib.Result]:
    """Generates for every prompt through the slots (`SlotLoop`); results in input order.

    Args:
        prompts: int32 prompts, each at most `programs.widths[-1]` tokens.
        budgets: each prompt's max_new_tokens.
        rng: the seed key (`SlotLoop`).
        on_tokens: called as `on_tokens(prompt_index, new_ids)` after each device call.
        began: `time.perf_counter()` at the caller's start, which every prompt's times count
            from (as if all arrived then); default now.
        refill_at: how many rows must finish before a run call returns (1 to batch_size).
        samplings: each prompt's settings (default greedy); samples: which of its request's n
            samples each prompt is (for its seed, `Sampling.sample_seed`; default 0).
        eos_ids, tokenizer: as `SlotLoop` takes them.
        on_result: called as `on_result(prompt_index, result)` as each prompt finishes (its
            `calls` left empty: they count the whole call).
    """
    loop_began = time.perf_counter()
    loop = SlotLoop(programs, rng, refill_at, began, eos_ids, tokenizer)
    samplings = [sampling_lib.Sampling()] * len(prompts) if samplings is None else samplings
    samples = [0] * len(prompts) if samples is None else samples
    for prompt, budget, sampling, sample in zip(prompts, budgets, samplings, samples):
        loop.add(prompt, budget, sampling, sample)  # ids 0, 1, ...: the prompts' indices
    results: list[result_lib.Result | None] = [None] * len(prompts)
    while not loop.idle:
        for event in loop.step():
            if on_tokens is not None and event.token_ids:
                on_tokens(event.request_id, event.token_ids)
            if event.result is not None:
                results[event.request_id] = event.result
                if on_result is not None:
                    on_result(event.request_id, event.result)
    loop.calls.host_seconds = time.perf_counter() - loop_began - loop.calls.sync_seconds
    calls = loop.calls.as_dict()
    return [dataclasses.replace(result, calls=calls) for result in results]


def _prefill_inputs(prompts: Sequence[np.ndarray], budgets: Sequence[int], row_counts: Sequence[int],
                    widths: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A refill's prefill inputs: prompt i in row i, padded to the narrowest width bucket that holds
    the longest and to the fewest rows of `row_counts` that hold them all; the padding rows hold one
    token and a budget of one."""
    width = inputs_lib.smallest_bucket(max(len(prompt) for prompt in prompts), widths)
    rows = inputs_lib.smallest_bucket(len(prompts), row_counts)
    tokens, lengths, row_budgets = programs_lib.idle_rows(rows, width)
    for row, (prompt, budget) in enumerate(zip(prompts, budgets)):
        tokens[row, :len(prompt)] = prompt
        lengths[row], row_budgets[row] = len(prompt), budget
    return tokens, lengths, row_budgets
