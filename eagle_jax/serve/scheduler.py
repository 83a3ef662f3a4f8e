"""Batching on the host: static batches, or continuous batching over fixed decode slots.

Static (`generate_static`): one batch decodes until its longest row finishes.

Continuous (`generate`): rows refill from a queue as they finish, after JetStream's
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

The host loop alternates run calls with harvesting finished rows and refilling their slots:
each round is one sync and three device calls, however many slots it refills.
The engine compiles the programs (`Engine.batch_programs`, `Engine.slot_programs`); this module
owns the host loops.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.decode import speculative


def insert(state: speculative.DecodeState, rows: speculative.DecodeState, take: jax.Array) -> speculative.DecodeState:
    """Slot b of `state` becomes row b of `rows` where `take[b]` ([B] bool), and stays elsewhere.

    Every leaf but `rng` has batch as axis 0 (the caches' per-layer keys and values and their
    lengths, the per-row counters, outputs, budgets and pending draft pairs), so one tree map
    covers them all. `rng` is one key for the whole batch: the big state's is kept.

    A leaf of `rows` may be shorter than the state's along other axes (the prefill's caches,
    `KVCache` [B, w, K, H], against the slots' [B, S, K, H]): only that leading block is written;
    with `state` donated, XLA updates it in place. A taken slot keeps its old row's entries past
    w, which its new row never reads: a query sees only the slots up to its position
    (`layers.Attention.attend`, `kernels.decode_attention`, `attention_ops.visible_slots`), and every
    forward writes its new keys from its cache's `lengths` on (a new row's: its prompt) before it
    attends, so each slot a query sees holds the prompt or this row's own writes.
    """
    def pick(big, new):
        corner = (0,) * big.ndim
        old = jax.lax.slice(big, corner, new.shape)
        picked = jnp.where(take.reshape((-1,) + (1,) * (big.ndim - 1)), new.astype(big.dtype), old)
        return jax.lax.dynamic_update_slice(big, picked, corner)

    merged = jax.tree.map(pick, state.replace(rng=None), rows.replace(rng=None))
    return merged.replace(rng=state.rng)


def slot_shape(row_shape: speculative.DecodeState, cache_length: int) -> speculative.DecodeState:
    """The prefill's output shapes (ShapeDtypeStructs) with caches `cache_length` slots long.

    The caches' keys and values ([B, S, K, H], target and head) are the only leaves whose shape
    follows the cache length: the output buffer follows `Options.max_new_tokens`, the pending
    pairs k.
    """
    def lengthen(cache):
        resize = lambda leaf: jax.ShapeDtypeStruct(leaf.shape[:1] + (cache_length,) + leaf.shape[2:], leaf.dtype)
        return None if cache is None else cache.replace(keys=tuple(map(resize, cache.keys)),
                                                        values=tuple(map(resize, cache.values)))

    return row_shape.replace(cache=lengthen(row_shape.cache), draft_cache=lengthen(row_shape.draft_cache))


def empty_state(shape: speculative.DecodeState, rng: jax.Array) -> speculative.DecodeState:
    """Idle slots of `shape` (ShapeDtypeStructs, `slot_shape`), built where it is traced: inside a
    program, on the device, so no state-sized buffer crosses from the host.

    Idle rows are `done`, so steps leave them as they are; `pending_count` is 1 so an idle row's
    draft reads a real pending slot.
    """
    state = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), shape.replace(rng=None))
    state = state.replace(done=jnp.ones(state.done.shape, bool))
    if state.pending_count is not None:
        state = state.replace(pending_count=jnp.ones(state.pending_count.shape, jnp.int32))
    return state.replace(rng=rng)


@dataclasses.dataclass
class BatchPrograms:
    """One batch's compiled programs and the prefill's inputs (see `Engine.batch_programs`), static batching."""

    start: Callable  # start(*start_args) -> DecodeState
    # runs[attend_length](target_params, head_params, state) -> state after up to steps_per_call
    # steps, attention reading cache slots below attend_length (ascending keys; the last is the cache)
    runs: dict[int, Callable]
    start_args: tuple  # (target_params, head_params, tokens [B, W], lengths [B], rng)
    prompt_lengths: np.ndarray  # [B] host copy of start_args' lengths
    idle: np.ndarray  # [B] bool: padding rows, marked done after prefill
    steps_per_call: int
    compile_seconds: float
    opts: speculative.Options  # what the programs were compiled for

    def prefill(self) -> speculative.DecodeState:
        state = self.start(*self.start_args)
        if self.idle.any():
            state = state.replace(done=jnp.asarray(np.asarray(state.done) | self.idle))
        return state

    def step(self, state: speculative.DecodeState, attend_length: int | None = None) -> speculative.DecodeState:
        """Up to steps_per_call steps; `state` is donated. attend_length: a key of `runs` (None: the whole cache)."""
        run = self.runs[max(self.runs) if attend_length is None else attend_length]
        return run(self.start_args[0], self.start_args[1], state)


@dataclasses.dataclass
class SlotPrograms:
    """The compiled programs of one slot layout (see `Engine.slot_programs`)."""

    # prefill(tokens [B, w], lengths [B], budgets [B], rng) -> a B-row DecodeState whose caches
    # are w slots long, w in widths
    prefill: Callable
    # insert(state, rows, take [B] bool) -> state, `rows` a prefill's output (any width); `state`
    # is donated
    insert: Callable
    # run(state, attend_length, refill_at) -> state after up to steps_per_call steps or once
    # refill_at (int32) of the rows running at entry are done, attention reading cache slots
    # below attend_length (one of attend_lengths); `state` is donated.
    run: Callable
    empty: Callable  # empty(rng) -> a state of idle slots, caches the whole cache long, built on the device
    batch_size: int
    widths: tuple[int, ...]  # the prefill buckets, ascending; the last is the longest prompt a slot takes
    attend_lengths: tuple[int, ...]  # ascending; the last is the whole cache
    steps_per_call: int
    compile_seconds: float
    opts: speculative.Options  # what the programs were compiled for


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
class Finished:
    """One prompt's generation, as harvested from its slot.

    `first_token_seconds` and `finish_seconds` count host wall-clock time from `began` (the
    caller's start) to the harvest point (a host sync after prefill or after a device call) at
    which the loop first held the prompt's first token, and its last: their resolution is one
    device call of steps_per_call steps. Continuous batching first syncs a new row after the run
    call that follows its prefill, which is also when it could first stream its tokens; a run
    call returns once `refill_at` rows have finished (or its steps run out), so a row that ends
    early in a call is read when the call ends, still within that one call.
    """

    token_ids: list[int]
    seconds: float  # static: its batch's wall time; continuous: from its prefill to its harvest
    stats: dict
    first_token_seconds: float
    finish_seconds: float
    # `CallCounts.as_dict()` of the host loop that produced it (a continuous call, or a static
    # batch), shared by all its prompts.
    calls: dict = dataclasses.field(default_factory=dict)


def generate(programs: SlotPrograms, prompts: Sequence[np.ndarray], budgets: Sequence[int], rng: jax.Array,
             on_tokens: Callable[[int, list[int]], None] | None = None,
             began: float | None = None, refill_at: int = 1) -> list[Finished]:
    """Generates for every prompt through the slots; results in input order.

    Each round: one prefill call fills every free slot from the queue (one prompt per slot, all
    at the width of the longest), one insert call writes those rows into their slots, one run
    call steps until `refill_at` rows have finished (or the queue's prompts, if fewer; with the
    queue empty, until its steps_per_call steps end or every row is done), then one sync fetches
    what the host harvests and streams.

    Args:
        prompts: int32 prompts, each at most `programs.widths[-1]` tokens.
        budgets: each prompt's max_new_tokens.
        rng: the seed key. A refill's prefill uses `fold_in(prefill key, i)`, i being the first
            prompt it starts; the steps share the state's key, so sampled outputs are reproducible
            for a seed, batch size, steps_per_call and refill_at (greedy outputs do not depend on
            them).
        on_tokens: called as `on_tokens(prompt_index, new_ids)` after each device call.
        began: `time.perf_counter()` at the caller's start, which every prompt's times count
            from (as if all arrived then); default now.
        refill_at: how many rows must finish before a run call returns (1 to batch_size).
    """
    began = time.perf_counter() if began is None else began
    loop_began = time.perf_counter()
    calls = CallCounts()
    state_rng, prefill_rng = jax.random.split(rng)
    state = programs.empty(state_rng)
    queue = collections.deque(range(len(prompts)))
    owner: list[int | None] = [None] * programs.batch_size  # prompt index held by each slot
    prefilled = [0.0] * programs.batch_size
    first_token: list[float | None] = [None] * programs.batch_size
    shown = np.zeros(programs.batch_size, np.int64)
    generated = np.zeros(programs.batch_size, np.int64)  # per slot, as of the last harvest
    finished: list[Finished | None] = [None] * len(prompts)
    steps = np.zeros(programs.batch_size, np.int64)  # per slot, its row's num_steps as of the last harvest
    while True:
        starting = [(slot, queue.popleft()) for slot in range(programs.batch_size) if owner[slot] is None and queue]
        if starting:
            now = time.perf_counter()
            inputs = _prefill_inputs([prompts[index] for _, index in starting], [budgets[index] for _, index in starting],
                                     [slot for slot, _ in starting], programs.batch_size, programs.widths)
            key = jax.random.fold_in(prefill_rng, starting[0][1])
            rows = calls.timed("prefill_seconds", programs.prefill, *inputs, key)
            take = np.zeros(programs.batch_size, bool)
            for slot, index in starting:
                take[slot] = True
                owner[slot], shown[slot], generated[slot], steps[slot] = index, 0, 1, 0  # prefill emitted one token
                prefilled[slot], first_token[slot] = now, None
            state = calls.timed("prefill_seconds", programs.insert, state, rows, take)
            calls.prefill_calls += 1
            calls.insert_calls += 1
        if all(index is None for index in owner):
            calls.host_seconds = time.perf_counter() - loop_began - calls.sync_seconds
            for result in finished:
                result.calls = calls.as_dict()
            return finished
        running = [(len(prompts[index]), budgets[index], generated[slot]) for slot, index in enumerate(owner)
                   if index is not None]
        # Leave the device loop to refill only when slots can be refilled, and as a batch.
        wait_for = min(refill_at, len(queue)) if queue else programs.batch_size + 1
        state = calls.timed("run_seconds", programs.run, state, attend_length(
            programs.attend_lengths, programs.opts, programs.steps_per_call, running), np.int32(wait_for))
        calls.run_calls += 1
        # One fetch: tokens, cursors and the acceptance counters (stats), not the caches.
        host = calls.fetch(state.replace(cache=None, draft_cache=None, pending_tokens=None, pending_features=None,
                                         pending_count=None, next_token=None, rng=None))
        output, counts, done = host.output, host.num_generated, host.done
        generated[:] = counts
        calls.run_steps += int(np.max(host.num_steps - steps))
        steps[:] = host.num_steps
        now = time.perf_counter()
        harvest = [slot for slot, index in enumerate(owner) if index is not None and done[slot]]
        for slot, index in enumerate(owner):
            if index is not None and first_token[slot] is None:  # prefill emitted it
                first_token[slot] = now - began
        if on_tokens is not None:
            _stream(output, counts, shown, owner, on_tokens)
        if harvest:
            stats = speculative.stats(host, programs.opts)
            for slot in harvest:
                finished[owner[slot]] = Finished(token_ids=output[slot, :counts[slot]].tolist(),
                                                 seconds=now - prefilled[slot], stats=stats[slot],
                                                 first_token_seconds=first_token[slot], finish_seconds=now - began)
                owner[slot] = None


def generate_static(programs: BatchPrograms, num_rows: int,
                    on_tokens: Callable[[int, list[int]], None] | None = None,
                    began: float | None = None) -> list[Finished]:
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
    return [Finished(token_ids=output[row, :counts[row]].tolist(), seconds=seconds, stats=stats[row],
                     first_token_seconds=first_token, finish_seconds=float(finish[row]), calls=calls.as_dict())
            for row in range(num_rows)]


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
