"""Batching on the host: static batches, or continuous batching over fixed decode slots.

Static (`generate_static`): one batch decodes until its longest row finishes.

Continuous (`SlotLoop`, `generate`): rows refill from a queue as they finish, after JetStream's
prefill / insert / generate split. The device holds one `DecodeState` of
`batch_size` rows (slots) with one cache length, so no program recompiles across prompts:

* prefill: the ordinary `speculative.start` on a batch of `batch_size` rows (one of a few
  fixed widths w): the row of each free slot holds its next prompt, with the prompt's own budget
  of new tokens, so one call prefills every slot a round frees. Its caches are w slots long, all
  that a prefill writes, not the slots' whole cache;
* insert: writes the prefilled rows into their slots of the big state (donated, so in place),
  only the first w slots of its caches: a refill moves what the prefill wrote, not the whole cache;
* run: the ordinary `speculative.run_steps` on all slots, returning once `refill_at` of its
  rows have finished (a traced argument); idle slots are `done` and change nothing.

`SlotLoop` is that loop as a stepping object (requests added and cancelled between rounds,
one round per `step`), for a server's device-loop thread; `generate` runs it over a list of
prompts. Each round is one sync and three device calls, however many slots it refills.
The engine compiles the programs (`programs`, `Engine.batch_programs`, `Engine.slot_programs`);
this module owns the host loops.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Sequence

import jax
import numpy as np

from eagle_jax.decode import speculative
from eagle_jax.serve import programs as programs_lib
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


@dataclasses.dataclass
class Slot:
    """The request a decode slot holds, as of the last harvest."""

    request_id: int
    prompt_length: int
    budget: int  # its max_new_tokens
    prefilled: float  # `time.perf_counter()` at its prefill
    generated: int = 1  # tokens so far (prefill emits one)
    shown: int = 0  # tokens already returned in events
    first_token_seconds: float | None = None  # from `began`, at the first sync after its prefill
    cancelled: bool = False


@dataclasses.dataclass(frozen=True)
class Event:
    """What one round brought a request: its new token ids, and its `Result` once finished."""

    request_id: int
    token_ids: list[int]
    result: result_lib.Result | None = None


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
    """

    def __init__(self, programs: programs_lib.SlotPrograms, rng: jax.Array, refill_at: int = 1,
                 began: float | None = None):
        self.programs = programs
        self.refill_at = refill_at
        self.began = time.perf_counter() if began is None else began
        self.calls = CallCounts()
        state_rng, self._prefill_rng = jax.random.split(rng)
        self._state = programs.empty(state_rng)
        self._queue: collections.deque = collections.deque()  # (request id, prompt, budget)
        self._slots: list[Slot | None] = [None] * programs.batch_size
        self._next_id = 0
        self._steps = np.zeros(programs.batch_size, np.int64)  # each row's num_steps as of the last fetch
        self._host = None  # the last fetched state (no caches): cancelled rows' results are read from it

    def add(self, prompt_ids: np.ndarray, budget: int) -> int:
        """Queues an int32 prompt (at most `programs.widths[-1]` tokens) with its max_new_tokens; returns its id."""
        request_id = self._next_id
        self._next_id += 1
        self._queue.append((request_id, prompt_ids, int(budget)))
        return request_id

    def cancel(self, request_id: int) -> None:
        """Drops a queued request, or frees an active one's slot at the next round, where its row
        is marked done on the device: it takes no more steps, whether or not the slot is refilled.

        An active request's `Result` (its tokens and acceptance counters as of the last round) comes
        in the next `step`'s events, so that its drafts are still counted; a queued one has none.
        """
        self._queue = collections.deque(entry for entry in self._queue if entry[0] != request_id)
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
        """One round: refill free slots from the queue, one run call, one fetch.

        Returns:
            An event for each request with new tokens or finished in this round.
        """
        events = self._harvest_cancelled()
        self._refill()
        if all(slot is None for slot in self._slots):
            return events
        programs, calls = self.programs, self.calls
        running = [(slot.prompt_length, slot.budget, slot.generated) for slot in self._slots if slot is not None]
        # Leave the device loop to refill only when slots can be refilled, and as a batch.
        wait_for = min(self.refill_at, len(self._queue)) if self._queue else programs.batch_size + 1
        length = attend_length(programs.attend_lengths, programs.opts, programs.steps_per_call, running)
        self._state = calls.timed("run_seconds", programs.run, self._state, length, np.int32(wait_for))
        calls.run_calls += 1
        # One fetch: tokens, cursors and the acceptance counters (stats), not the caches.
        host = calls.fetch(self._state.replace(cache=None, draft_cache=None, pending_tokens=None,
                                               pending_features=None, pending_count=None, next_token=None, rng=None))
        calls.run_steps += int(np.max(host.num_steps - self._steps))
        self._steps = np.array(host.num_steps, np.int64)
        self._host = host
        now = time.perf_counter()
        stats = speculative.stats(host, programs.opts) if np.any(host.done) else None
        for row, slot in enumerate(self._slots):
            if slot is None:
                continue
            if slot.first_token_seconds is None:  # prefill emitted it
                slot.first_token_seconds = now - self.began
            count = int(host.num_generated[row])
            new, slot.shown, slot.generated = host.output[row, slot.shown:count].tolist(), count, count
            result = None
            if host.done[row]:
                result = result_lib.Result(
                    token_ids=host.output[row, :count].tolist(), seconds=now - slot.prefilled,
                    compile_seconds=programs.compile_seconds, stats=stats[row],
                    first_token_seconds=slot.first_token_seconds, finish_seconds=now - self.began)
                self._slots[row] = None
            if new or result is not None:
                events.append(Event(slot.request_id, new, result))
        return events

    def _harvest_cancelled(self) -> list[Event]:
        """Frees the cancelled slots; each request's `Result` as of the last fetch (none before one).

        A freed row is marked done on the device too: otherwise it would keep stepping (and count
        as running in the device loop's exit test and `disable_by_batch_size`) until a refill
        overwrote it, computing tokens for a client that has gone.
        """
        events = []
        stats = None
        stopped = []
        for row, slot in enumerate(self._slots):
            if slot is None or not slot.cancelled:
                continue
            self._slots[row] = None
            if self._host is None:
                continue
            stopped.append(row)
            stats = speculative.stats(self._host, self.programs.opts) if stats is None else stats
            events.append(Event(slot.request_id, [], result_lib.Result(
                token_ids=self._host.output[row, :slot.shown].tolist(), seconds=time.perf_counter() - slot.prefilled,
                compile_seconds=self.programs.compile_seconds, stats=stats[row],
                first_token_seconds=slot.first_token_seconds, finish_seconds=time.perf_counter() - self.began)))
        if stopped:
            self._state = stop_rows(self._state, self._host.done, stopped)
        return events

    def _refill(self) -> None:
        """One prefill and one insert call fill every free slot from the queue."""
        free = [row for row, slot in enumerate(self._slots) if slot is None]
        starting = [(row, self._queue.popleft()) for row in free[:len(self._queue)]]
        if not starting:
            return
        now = time.perf_counter()
        programs = self.programs
        inputs = _prefill_inputs([prompt for _, (_, prompt, _) in starting], [budget for _, (_, _, budget) in starting],
                                 [row for row, _ in starting], programs.batch_size, programs.widths)
        key = jax.random.fold_in(self._prefill_rng, starting[0][1][0])
        rows = self.calls.timed("prefill_seconds", programs.prefill, *inputs, key)
        take = np.zeros(programs.batch_size, bool)
        for row, (request_id, prompt, budget) in starting:
            take[row] = True
            self._steps[row] = 0
            self._slots[row] = Slot(request_id, len(prompt), budget, now)
        self._state = self.calls.timed("prefill_seconds", programs.insert, self._state, rows, take)
        self.calls.prefill_calls += 1
        self.calls.insert_calls += 1


def generate(programs: programs_lib.SlotPrograms, prompts: Sequence[np.ndarray], budgets: Sequence[int],
             rng: jax.Array, on_tokens: Callable[[int, list[int]], None] | None = None,
             began: float | None = None, refill_at: int = 1,
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
        on_result: called as `on_result(prompt_index, result)` as each prompt finishes (its
            `calls` left empty: they count the whole call).
    """
    loop_began = time.perf_counter()
    loop = SlotLoop(programs, rng, refill_at, began)
    for prompt, budget in zip(prompts, budgets):
        loop.add(prompt, budget)  # ids 0, 1, ...: the prompts' indices
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


def generate_static(programs: programs_lib.BatchPrograms, num_rows: int,
                    on_tokens: Callable[[int, list[int]], None] | None = None,
                    began: float | None = None) -> list[result_lib.Result]:
    """One static batch: prefill, then step (donating the state) until every row is done.

    Args:
        num_rows: the batch's prompts (its first rows); the rest are idle padding.
        on_tokens: called as `on_tokens(row, new_ids)` after prefill and each device call.
        began: `time.perf_counter()` at the caller's start, which the rows' times count from;
            default now.
    """
    prefilled = time.perf_counter()
    began = prefilled if began is None else began
    calls = CallCounts(prefill_calls=1)
    state = calls.timed("prefill_seconds", programs.prefill)
    shown = np.zeros(num_rows, np.int64)
    first_token = None
    finish = np.full(num_rows, np.nan)
    steps = np.zeros(num_rows, np.int64)  # num_steps as of the last fetch (prefill: none)
    while True:
        counts, done, num_steps = calls.fetch((state.num_generated, state.done, state.num_steps))
        calls.run_steps += int(np.max(num_steps[:num_rows] - steps))
        steps = num_steps[:num_rows]
        if on_tokens is not None:  # only streaming needs the tokens before the batch ends
            _stream(calls.fetch(state.output), counts, shown, list(range(num_rows)), on_tokens)
        now = time.perf_counter() - began
        first_token = now if first_token is None else first_token  # prefill emits every row's first token
        finish[np.isnan(finish) & done[:num_rows]] = now
        if np.all(done):
            break
        running = [(programs.prompt_lengths[row], programs.opts.max_new_tokens, counts[row])
                   for row in range(num_rows) if not done[row]]
        state = calls.timed("run_seconds", programs.step, state, attend_length(
            tuple(programs.runs), programs.opts, programs.steps_per_call, running))
        calls.run_calls += 1
    output, counts = calls.fetch((state.output, state.num_generated))
    seconds = time.perf_counter() - prefilled
    stats = speculative.stats(state, programs.opts)
    calls.host_seconds = time.perf_counter() - prefilled - calls.sync_seconds
    return [result_lib.Result(token_ids=output[row, :counts[row]].tolist(), seconds=seconds,
                              compile_seconds=programs.compile_seconds, stats=stats[row],
                              first_token_seconds=first_token, finish_seconds=float(finish[row]), calls=calls.as_dict())
            for row in range(num_rows)]


def stop_rows(state: speculative.DecodeState, done: np.ndarray, rows: Sequence[int]) -> speculative.DecodeState:
    """`state` with `rows` marked done, from `done`, the host copy of the last fetch (no device call
    has changed the state since): a new [B] bool array put where the state keeps `done`, rather
    than an update traced on the device, which would compile at a server's first cancel."""
    mask = np.array(done, bool)
    mask[list(rows)] = True
    return state.replace(done=jax.device_put(mask, state.done.sharding))


def _stream(output: np.ndarray, counts: np.ndarray, shown: np.ndarray, owner: Sequence[int | None],
            on_tokens: Callable[[int, list[int]], None]) -> None:
    """Sends each owned row's tokens past `shown` to `on_tokens(owner[row], ids)`; advances `shown`."""
    for row, index in enumerate(owner):
        if index is not None and counts[row] > shown[row]:
            on_tokens(index, output[row, shown[row]:counts[row]].tolist())
            shown[row] = counts[row]


def attend_length(lengths: Sequence[int], opts: speculative.Options, steps_per_call: int,
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


def _prefill_inputs(prompts: Sequence[np.ndarray], budgets: Sequence[int], slots: Sequence[int], batch_size: int,
                    widths: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The slots' prefill inputs: prompt i in row slots[i], padded to the narrowest bucket that
    holds the longest; the other rows hold one token and a budget of one (`insert` skips them)."""
    width = next(w for w in widths if w >= max(len(prompt) for prompt in prompts))
    tokens = np.zeros((batch_size, width), np.int32)
    lengths = np.ones((batch_size,), np.int32)
    row_budgets = np.ones((batch_size,), np.int32)
    for prompt, budget, slot in zip(prompts, budgets, slots):
        tokens[slot, :len(prompt)] = prompt
        lengths[slot], row_budgets[slot] = len(prompt), budget
    return tokens, lengths, row_budgets
