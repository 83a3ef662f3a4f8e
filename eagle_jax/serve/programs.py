"""The compiled programs the host loops drive, and the device-side slot helpers they use.

`Engine.batch_programs` compiles a `BatchPrograms` (one static batch), `Engine.slot_programs`
a `SlotPrograms` (continuous batching: prefill, insert into slots, run); `scheduler` drives
them. `insert`, `take_rows`, `slot_shape` and `empty_state` are traced into the slot programs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.decode import state as state_lib


def insert(state: state_lib.DecodeState, rows: state_lib.DecodeState, slots: jax.Array) -> state_lib.DecodeState:
    """Slot `slots[i]` of `state` becomes row i of `rows` ([R] int32 slot ids, R the prefill's rows);
    an id of `batch_size` or more (a padding row) is dropped, and the other slots stay as they are.

    Every leaf but `rng` has batch as axis 0 (the caches' per-layer keys and values and their
    lengths, the per-row counters, outputs, budgets, sampling settings, token counts, logprobs and
    pending draft pairs), so one tree map covers them all. `rng` is one key for the whole batch: the big state's is kept.

    A leaf of `rows` may be shorter than the state's along other axes (the prefill's caches,
    `KVCache` [R, w, K, H], against the slots' [B, S, K, H]): only that leading block of each
    slot is written; with `state` donated, XLA scatters it in place. A slot keeps its old row's
    entries past w, which its new row never reads: a query sees only the slots up to its position
    (`layers.Attention.attend`, `kernels.decode_attention`, `attention_ops.visible_slots`), and every
    forward writes its new keys from its cache's `lengths` on (a new row's: its prompt) before it
    attends, so each slot a query sees holds the prompt or this row's own writes.
    """
    def put(big, new):
        block = (slots,) + tuple(slice(0, size) for size in new.shape[1:])
        return big.at[block].set(new.astype(big.dtype), mode="drop")

    merged = jax.tree.map(put, state.replace(rng=None), rows.replace(rng=None))
    return merged.replace(rng=state.rng)


def idle_rows(rows: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A prefill's tokens [rows, width], lengths and budgets for idle rows (host arrays): one token
    (id 0) and a budget of one each. A refill pads its rows with these and fills its requests in;
    the compiler lowers the prefill on them and the warm-up runs it on them."""
    return np.zeros((rows, width), np.int32), np.ones((rows,), np.int32), np.ones((rows,), np.int32)


def take_rows(state: state_lib.DecodeState, slots: jax.Array) -> state_lib.DecodeState:
    """Rows `slots` of `state` ([R] int32 ids, each below batch_size) as an R-row state.

    A run over the rows alone (then `insert` back) costs R rows' steps instead of batch_size's,
    as a vLLM CUDA graph captured for R requests does; the gather and the scatter back copy R
    rows' caches (SmolLM2: 47 MB a row at 2,048 slots, some 30 us each way on an H100). Every
    leaf but `rng` has batch as axis 0 (`insert`).
    """
    rows = jax.tree.map(lambda leaf: leaf[slots], state.replace(rng=None))
    return rows.replace(rng=state.rng)


def slot_shape(row_shape: state_lib.DecodeState, cache_length: int) -> state_lib.DecodeState:
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


def empty_state(shape: state_lib.DecodeState, rng: jax.Array) -> state_lib.DecodeState:
    """Idle slots of `shape` (ShapeDtypeStructs, `slot_shape`), built where it is traced: inside a
    program, on the device, so no state-sized buffer crosses from the host.

    Idle rows are `done`, so steps leave them as they are; `pending_count` is 1 so an idle row's
    draft reads a real pending slot; their sampling settings are neutral (greedy, penalties of 1),
    so that the processors compute nothing undefined on them.
    """
    state = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), shape.replace(rng=None))
    batch, stop_width = shape.params.stop_ids.shape
    state = state.replace(done=jnp.ones(state.done.shape, bool),
                          params=sampling_lib.SamplingParams.neutral(batch, stop_width))
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
    start_args: tuple  # (target_params, head_params, tokens [B, W], lengths [B], rng, sampling params)
    prompt_lengths: np.ndarray  # [B] host copy of start_args' lengths
    idle: np.ndarray  # [B] bool: padding rows, marked done after prefill
    steps_per_call: int
    compile_seconds: float
    opts: state_lib.Options  # what the programs were compiled for

    def prefill(self) -> state_lib.DecodeState:
        state = self.start(*self.start_args)
        if self.idle.any():
            state = state.replace(done=jnp.asarray(np.asarray(state.done) | self.idle))
        return state

    def step(self, state: state_lib.DecodeState, attend_length: int | None = None) -> state_lib.DecodeState:
        """Up to steps_per_call steps; `state` is donated. attend_length: a key of `runs` (None: the whole cache)."""
        run = self.runs[max(self.runs) if attend_length is None else attend_length]
        return run(self.start_args[0], self.start_args[1], state)


@dataclasses.dataclass
class SlotPrograms:
    """The compiled programs of one slot layout (see `Engine.slot_programs`)."""

    # prefill(tokens [R, w], lengths [R], budgets [R], params (`sampling.SamplingParams`), rng) ->
    # an R-row DecodeState whose caches are w slots long, R in row_counts, w in widths
    prefill: Callable
    # insert(state, rows, slot_ids [R] int32) -> state, `rows` a prefill's output; row i goes to
    # slot slot_ids[i], ids >= batch_size (padding rows) are dropped; `state` is donated
    insert: Callable
    # run(state, attend_length, refill_at, argmax=False, slot_ids=None, steps=None) -> state after
    # up to `steps` (default steps_per_call; any count, picked per call) steps of the slots
    # `slot_ids` ([R] int32, R in row_counts below batch_size; None: every slot), attending below
    # attend_length (one of attend_lengths[R]); argmax: every running row is greedy and
    # unprocessed; `state` is donated
    run: Callable
    empty: Callable  # empty(rng) -> a state of idle slots, caches the whole cache long, built on the device
    batch_size: int
    row_counts: tuple[int, ...]  # the prefill's row buckets, ascending; the last is batch_size
    widths: tuple[int, ...]  # the prefill's width buckets, ascending; the last is the longest prompt a slot takes
    attend_lengths: dict[int, tuple[int, ...]]  # rows run -> the run's attention reaches, ascending; the last is the whole cache
    steps_per_call: int
    compile_seconds: float
    opts: state_lib.Options  # what the programs were compiled for

    def warm_up(self, rng: jax.Array) -> None:
        """Runs every program once on idle slots, changing none: each prefill bucket (its rows
        inserted nowhere, every slot id a padding id), each run (all rows done: it exits at
        once). On a GPU a program's first execution loads its modules, which a server pays here
        before it is ready rather than in the first requests of each shape."""
        state = self.empty(rng)
        for rows in self.row_counts:
            nowhere = np.full((rows,), self.batch_size, np.int32)
            for width in self.widths:
                new = self.prefill(*idle_rows(rows, width),
                                   sampling_lib.SamplingParams.neutral(rows, sampling_lib.STOP_WIDTH), rng)
                state = self.insert(state, new, nowhere)
            slot_ids = None if rows == self.batch_size else np.arange(rows, dtype=np.int32)
            for length in self.attend_lengths[rows]:
                for argmax in (False, True):
                    state = self.run(state, length, np.int32(1), argmax, slot_ids)
        jax.block_until_ready(state)


def module_name(program: str, opts: state_lib.Options | None, head_config) -> str:
    """The name a compiled program's module (and persistent cache entry) carries: what it runs."""
    if opts is None:
        return program
    method = head_config.method if head_config is not None and opts.k else "plain"
    if program in ("start", "prefill-slots"):
        return f"prefill-{method}"
    if opts.tree is not None:
        tree = opts.tree
        return f"speculative-{method}-topk{tree.topk}-steps{tree.num_steps}-draft{tree.num_draft_tokens}"
    if not opts.k:
        return "decode"
    return f"speculative-{method}-k{opts.k}" + (f"-drafts{opts.step_k}" if opts.step_k is not None else "")
