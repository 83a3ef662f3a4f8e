"""Batching on the host: static batches, or continuous batching over fixed decode slots.

Static (`generate_static`): one batch decodes until its longest row finishes.

Continuous (`generate`): rows refill from a queue as they finish, after JetStream's
prefill / insert / generate split. The device holds one `DecodeState` of
`batch_size` rows (slots) with one cache length, so no program recompiles across prompts:

* prefill: the ordinary `speculative.start` on one prompt (batch 1, one fixed width), with
  the prompt's own budget of new tokens;
* insert: writes that batch-1 state into a free slot of the big state (donated);
* run: the ordinary `speculative.run_steps` on all slots; idle slots are `done` and change
  nothing.

The host loop alternates run calls with harvesting finished rows and refilling their slots.
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

from eagle_jax import speculative


def insert(state: speculative.DecodeState, row: speculative.DecodeState, slot: jax.Array) -> speculative.DecodeState:
    """Writes the batch-1 state `row` into slot `slot` of `state`.

    Every leaf but `rng` has batch as axis 0 (the caches' per-layer keys and values and their
    lengths, the per-row counters, outputs, budgets and pending draft pairs), so one tree map
    covers them all. `rng` is one key for the whole batch: the big state's is kept.
    """
    put = lambda big, small: jax.lax.dynamic_update_slice_in_dim(big, small.astype(big.dtype), slot, axis=0)
    merged = jax.tree.map(put, state.replace(rng=None), row.replace(rng=None))
    return merged.replace(rng=state.rng)


def empty_state(row_shape: speculative.DecodeState, batch_size: int, rng: jax.Array) -> speculative.DecodeState:
    """`batch_size` idle slots shaped like a batch-1 state (arrays or ShapeDtypeStructs).

    Built from host zeros (no device program): idle rows are `done`, so steps leave them as
    they are; `pending_count` is 1 so an idle row's draft reads a real pending slot.
    """
    zeros = lambda leaf: np.zeros((batch_size,) + tuple(leaf.shape[1:]), leaf.dtype)
    state = jax.tree.map(zeros, row_shape.replace(rng=None))
    state = state.replace(done=np.ones((batch_size,), bool))
    if state.pending_count is not None:
        state = state.replace(pending_count=np.ones((batch_size,), np.int32))
    return jax.device_put(state).replace(rng=rng)


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

    prefill: Callable  # prefill(tokens [1, w], lengths [1], budgets [1], rng) -> batch-1 DecodeState, w in widths
    insert: Callable  # insert(state, row, slot) -> state; `state` is donated
    # run(state, attend_length) -> state after up to steps_per_call steps, attention reading cache
    # slots below attend_length (one of attend_lengths); `state` is donated.
    run: Callable
    empty: Callable  # empty(rng) -> a state of idle slots
    batch_size: int
    widths: tuple[int, ...]  # the prefill buckets, ascending; the last is the longest prompt a slot takes
    attend_lengths: tuple[int, ...]  # ascending; the last is the whole cache
    steps_per_call: int
    compile_seconds: float
    opts: speculative.Options  # what the programs were compiled for


@dataclasses.dataclass
class Finished:
    """One prompt's generation, as harvested from its slot.

    `first_token_seconds` and `finish_seconds` count host wall-clock time from `began` (the
    caller's start) to the harvest point (a host sync after prefill or after a device call) at
    which the loop first held the prompt's first token, and its last: their resolution is one
    device call of steps_per_call steps. Continuous batching first syncs a new row after the run
    call that follows its prefill, which is also when it could first stream its tokens.
    """

    token_ids: list[int]
    seconds: float  # static: its batch's wall time; continuous: from its prefill to its harvest
    stats: dict
    first_token_seconds: float
    finish_seconds: float


def generate(programs: SlotPrograms, prompts: Sequence[np.ndarray], budgets: Sequence[int], rng: jax.Array,
             on_tokens: Callable[[int, list[int]], None] | None = None,
             began: float | None = None) -> list[Finished]:
    """Generates for every prompt through the slots; results in input order.

    Args:
        prompts: int32 prompts, each at most `programs.widths[-1]` tokens.
        budgets: each prompt's max_new_tokens.
        rng: the seed key. Prompt i's prefill uses `fold_in(prefill key, i)`; the steps share
            the state's key, so sampled outputs are reproducible for a seed, batch size and
            steps_per_call (greedy outputs do not depend on them).
        on_tokens: called as `on_tokens(prompt_index, new_ids)` after each device call.
        began: `time.perf_counter()` at the caller's start, which every prompt's times count
            from (as if all arrived then); default now.
    """
    began = time.perf_counter() if began is None else began
    state_rng, prefill_rng = jax.random.split(rng)
    state = programs.empty(state_rng)
    queue = collections.deque(range(len(prompts)))
    owner: list[int | None] = [None] * programs.batch_size  # prompt index held by each slot
    prefilled = [0.0] * programs.batch_size
    first_token: list[float | None] = [None] * programs.batch_size
    shown = np.zeros(programs.batch_size, np.int64)
    generated = np.zeros(programs.batch_size, np.int64)  # per slot, as of the last harvest
    finished: list[Finished | None] = [None] * len(prompts)
    while True:
        for slot in range(programs.batch_size):
            if owner[slot] is None and queue:
                index = queue.popleft()
                prefilled[slot], first_token[slot] = time.perf_counter(), None
                row = programs.prefill(*_prefill_inputs(prompts[index], budgets[index], programs.widths),
                                       jax.random.fold_in(prefill_rng, index))
                state = programs.insert(state, row, np.int32(slot))
                owner[slot], shown[slot], generated[slot] = index, 0, 1  # prefill emitted one token
        if all(index is None for index in owner):
            return finished
        running = [(len(prompts[index]), budgets[index], generated[slot]) for slot, index in enumerate(owner)
                   if index is not None]
        state = programs.run(state, attend_length(programs.attend_lengths, programs.opts, programs.steps_per_call,
                                                  running))
        output, counts, done = jax.device_get((state.output, state.num_generated, state.done))
        generated[:] = counts
        now = time.perf_counter()
        harvest = [slot for slot, index in enumerate(owner) if index is not None and done[slot]]
        for slot, index in enumerate(owner):
            if index is not None and first_token[slot] is None:  # prefill emitted it
                first_token[slot] = now - began
        if on_tokens is not None:
            _stream(output, counts, shown, owner, on_tokens)
        if harvest:
            stats = speculative.stats(state, programs.opts)
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
    state = programs.prefill()
    shown = np.zeros(num_rows, np.int64)
    first_token = None
    finish = np.full(num_rows, np.nan)
    while True:
        counts, done = jax.device_get((state.num_generated, state.done))
        if on_tokens is not None:  # only streaming needs the tokens before the batch ends
            _stream(jax.device_get(state.output), counts, shown, list(range(num_rows)), on_tokens)
        now = time.perf_counter() - began
        first_token = now if first_token is None else first_token  # prefill emits every row's first token
        finish[np.isnan(finish) & done[:num_rows]] = now
        if np.all(done):
            break
        running = [(programs.prompt_lengths[row], programs.opts.max_new_tokens, counts[row])
                   for row in range(num_rows) if not done[row]]
        state = programs.step(state, attend_length(tuple(programs.runs), programs.opts, programs.steps_per_call,
                                                   running))
    output, counts = jax.device_get((state.output, state.num_generated))
    seconds = time.perf_counter() - prefilled
    stats = speculative.stats(state, programs.opts)
    return [Finished(token_ids=output[row, :counts[row]].tolist(), seconds=seconds, stats=stats[row],
                     first_token_seconds=first_token, finish_seconds=float(finish[row]))
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


def _prefill_inputs(prompt: np.ndarray, budget: int, widths: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The batch-1 prefill's inputs, padded to the narrowest bucket that holds the prompt."""
    width = next(w for w in widths if w >= len(prompt))
    tokens = np.zeros((1, width), np.int32)
    tokens[0, :len(prompt)] = prompt
    return tokens, np.array([len(prompt)], np.int32), np.array([budget], np.int32)
