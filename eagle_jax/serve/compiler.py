"""`Compiler`: the engine's device programs, compiled ahead of time for fixed shapes.

It holds the (placed) target and head as parameters plus graph definitions, lowers the pure
functions of `decode.speculative` and `programs` over them, and compiles each once, through the
persistent `compile_cache` (so generation timings exclude compilation, and compile counts are
observable). `Engine` asks it for the programs of a static batch or of the decode slots.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import time
import warnings
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.decode import speculative
from eagle_jax.model import llama
from eagle_jax.serve import compile_cache as compile_cache_lib
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import inputs
from eagle_jax.serve import program_identity
from eagle_jax.serve import programs as programs_lib
from eagle_jax.serve import sharding as sharding_lib
from eagle_jax.decode import state as state_lib


# Threads compiling the slot programs at once: XLA's compile releases the GIL, and a server's
# start-up compiles some fifty programs (every prefill row and width bucket).
COMPILE_THREADS = min(8, os.cpu_count() or 1)


class Pending:
    """A program loading or compiling on a worker thread (`Compiler.compiling`): called, it waits for it.

    Args:
        future: the executable, or None where a stored entry failed to load.
        lowered: the lowered program being compiled; None while loading.
        rebuild: lowers and compiles on the calling thread, for an entry that failed to load.
    """

    def __init__(self, future: concurrent.futures.Future, lowered=None, rebuild: Callable | None = None):
        self.future, self.lowered, self.rebuild = future, lowered, rebuild
        self._compiled = None

    def result(self):
        if self._compiled is None:
            self._compiled = self.future.result() or self.rebuild()
        return self._compiled

    @property
    def out_info(self):
        return self.lowered.out_info if self.lowered is not None else self.result().out_info

    def __call__(self, *args):
        return self.result()(*args)


def _spec(tree):
    """The tree with each array as its shape, dtype and sharding: what a program is traced for."""
    return jax.tree.map(lambda x: (x.shape, x.dtype, getattr(x, "sharding", None)) if hasattr(x, "shape") else x, tree)


def _bare(shape):
    """Shapes and dtypes alone. A program's output shapes carry shardings and layouts once it is
    compiled or loaded, not while it is only lowered; without them, the programs built on them
    (and their cache keys) are the same on a cold start and a warm one."""
    return jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), shape)


@jax.tree_util.register_pytree_node_class
class Packed:
    """A pytree flattened once: its leaves and structure.

    Every call of a compiled program flattens its arguments, and flattening an nnx.State calls
    Python for each Variable: 0.5 ms for SmolLM2's target, paid by every device call of a host
    loop. Packed, the parameters flatten as one node. Its repr is the tree's, so program keys
    read as before.
    """

    def __init__(self, leaves, treedef):
        self.leaves, self.treedef = tuple(leaves), treedef

    @classmethod
    def of(cls, tree) -> "Packed":
        return cls(*jax.tree.flatten(tree))

    def unpack(self):
        return jax.tree.unflatten(self.treedef, self.leaves)

    def tree_flatten(self):
        return self.leaves, self.treedef

    @classmethod
    def tree_unflatten(cls, treedef, leaves):
        return cls(leaves, treedef)

    def __repr__(self):
        return repr(self.unpack())


class Compiler:
    """Compiles the programs of one target and head for one `EngineConfig`.

    Args:
        target: the Llama target; split over `config.tensor_parallel_size` devices (`sharding`),
            the head replicated or split too. The modules given are unchanged.
        head: the EAGLE head, or None for plain decoding.
        options: builds the step options of these programs (`Engine.options`).
    """

    def __init__(self, target: llama.Llama, head, config: config_lib.EngineConfig, max_length: int,
                 options: Callable[..., state_lib.Options]):
        self.config, self.max_length, self.options = config, max_length, options
        self.model_config = target.config
        self.head_config = head.config if head is not None else None
        self.headroom = config.cache_headroom
        self.mesh = sharding_lib.make_mesh(config.tensor_parallel_size) if config.tensor_parallel_size > 1 else None
        if self.mesh is not None:
            target = sharding_lib.shard_target(target, self.mesh)
            if head is not None:
                head = (sharding_lib.shard_head(head, self.mesh) if config.draft_tensor_parallel_size > 1
                        else sharding_lib.replicate(head, self.mesh))
        self._target_def, target_params = nnx.split(target)
        self._head_def, head_params = nnx.split(head) if head is not None else (None, None)
        self.target_params, self.head_params = Packed.of(target_params), Packed.of(head_params)
        code = program_identity.code_identity(target, head) if config.cache_dir is not None else None
        if config.cache_dir is not None and code is None:
            warnings.warn("compilation cache: a model class's source file cannot be read, so saved programs "
                          "could not be told apart from its changed versions; compiling in memory only")
        self.compile_cache = compile_cache_lib.CompileCache(config.cache_dir, self.mesh, code=code)
        self.compiled: dict = {}
        self.compile_seconds = 0.0
        self.lowering_seconds = 0.0  # of compile_seconds: tracing and lowering, one program after another
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # set inside `compiling`

    def slot_programs(self, sampling_mode: sampling_lib.SamplingMode = sampling_lib.SamplingMode(),
                      steps_per_call: int | None = None) -> programs_lib.SlotPrograms:
        """Compiles (once per engine and sampling mode) the continuous scheduler's prefill, insert and run.

        Shapes depend on the engine alone: prefills of R rows (`inputs.row_buckets`: powers of 4
        below batch_size, and batch_size) in power-of-two widths w up to max_length // 2, each with
        caches of w slots (all that a prefill writes), one insert per (R, w) scattering those w
        slots into the slots' caches of max_length, an output buffer for the largest budget, and
        one run program per attention length (`_run_programs`); all compiled here, so none
        compiles mid-run. Each row's settings and stop ids are data (`sampling.SamplingParams`,
        `sampling.STOP_WIDTH` ids a row), written at its prefill: any mix of requests that
        `sampling_mode` covers runs on them. They compile on `COMPILE_THREADS` threads at once.
        """
        compile_before = self.compile_seconds
        with self.compiling():
            programs = self._slot_programs(sampling_mode, steps_per_call or self.config.steps_per_call)
        return dataclasses.replace(programs, compile_seconds=self.compile_seconds - compile_before)

    @contextlib.contextmanager
    def compiling(self, threads: int = COMPILE_THREADS):
        """Programs asked for inside are lowered here and compiled (or loaded) on `threads` worker
        threads; all are ready on exit. The wall time inside counts as compile time."""
        began = time.perf_counter()
        pending = lambda: [key for key, program in self.compiled.items() if isinstance(program, Pending)]
        try:
            with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="eagle_jax-compile") as pool:
                self._pool = pool
                try:
                    yield
                finally:
                    self._pool = None  # leaving the pool's block waits for every compilation
            for key in pending():
                self.compiled[key] = self.compiled[key].result()  # raises a compilation's error
        except BaseException:
            for key in pending():  # asked for again, each compiles anew
                del self.compiled[key]
            raise
        finally:
            self.compile_seconds += time.perf_counter() - began

    def _slot_programs(self, sampling_mode: sampling_lib.SamplingMode, steps_per_call: int) -> programs_lib.SlotPrograms:
        opts = self.options(sampling_mode=sampling_mode, max_new_tokens=self.max_length - self.headroom - 1,
                            cache_length=self.max_length)
        params, slots = (self.target_params, self.head_params), self.config.batch_size
        row_counts = inputs.row_buckets(slots)

        def row_args(rows, w):
            neutral = jax.device_get(sampling_lib.SamplingParams.neutral(rows, sampling_lib.STOP_WIDTH))
            return params + programs_lib.idle_rows(rows, w) + (neutral, jax.random.key(0))

        width = self.max_length // 2
        widths = sorted({inputs.bucket_length(length, width) for length in range(1, width + 1)})
        row_opts = {w: opts.replace(cache_length=w) for w in widths}  # `speculative.start` writes slots [0, w)
        shapes = [(rows, w) for rows in row_counts for w in widths]
        prefills = {(rows, w): self._program("prefill-slots", self._start_rows, row_args(rows, w),
                                             dict(opts=row_opts[w]), (rows, w))
                    for rows, w in shapes}

        def row_shape(rows, w):  # the compiled prefill knows its output shapes: no second trace of the model
            if self.config.eager:
                return jax.eval_shape(functools.partial(self._start_rows, opts=row_opts[w]), *row_args(rows, w))
            return _bare(prefills[rows, w].out_info)

        key = jax.random.key(0)
        make_empty = functools.partial(self._empty, shape=programs_lib.slot_shape(row_shape(slots, width),
                                                                                  self.max_length))
        # The state's leaves follow the sampling mode (token counts, logprobs): part of these keys.
        empty = self._program("empty", make_empty, (key,), {}, 0, mode=sampling_mode)
        state_shape = self._state_shape(jax.eval_shape(make_empty, key))
        inserts = {(rows, w): self._program("insert", self._insert, (state_shape, self._state_shape(row_shape(rows, w)),
                                                                     np.zeros((rows,), np.int32)), {}, (rows, w),
                                            donate=("state",), mode=sampling_mode)
                   for rows, w in shapes}
        # While every running row is greedy with no processor (the common case), a call runs the
        # argmax step on the same state: processing every row (a vocabulary sort for top-p, the
        # penalties) cost a 16-slot EAGLE-3 step 2.3x on an H100 (docs/serving.md). Token counts
        # and logprob buffers ride along untouched: no row of such a call reads them, and a
        # penalised row counts from its own prefill (`commit.commit`'s count_tokens).
        argmax_mode = sampling_lib.SamplingMode()
        modes = {False: opts, True: opts.replace(sampling_mode=argmax_mode)}
        if sampling_mode == argmax_mode:
            modes = {False: opts}
        # One set per row bucket: while R slots or fewer hold requests, a call runs those rows
        # alone (`programs.take_rows`), so a lone request's step costs one row's, not every slot's.
        # Its own name: a static batch would lower the same step for the prefill's output types.
        # A call's step limit is an argument too (`steps`): the host lengthens calls while every
        # slot is held and requests wait (`scheduler.SlotLoop`), without a second set of programs.
        # Each bucket drafts its own k (`EngineConfig.k_for_rows`) on the one state, sized for k.
        runs = {(argmax, rows): self._run_programs("slots-run", state_shape, None, self._drafting(mode, rows),
                                                   (np.int32(1), np.int32(steps_per_call)),
                                                   rows=None if rows == slots else rows, stop_on_finish=True)
                for argmax, mode in modes.items() for rows in row_counts}

        def run(state, attend_length, refill_at, argmax=False, slot_ids=None, steps=None):
            program = runs[argmax and True in modes, slots if slot_ids is None else len(slot_ids)][attend_length]
            row_args = () if slot_ids is None else (slot_ids,)
            return program(*params, state, refill_at, np.int32(steps or steps_per_call), *row_args)

        return programs_lib.SlotPrograms(
            prefill=lambda tokens, *args: prefills[tokens.shape](*params, tokens, *args),
            insert=lambda state, new, slot_ids: inserts[len(slot_ids), new.cache.max_length](state, new, slot_ids),
            run=run, empty=empty,
            batch_size=slots, row_counts=row_counts, widths=tuple(widths),
            attend_lengths={rows: tuple(runs[False, rows]) for rows in row_counts},
            steps_per_call=steps_per_call, compile_seconds=0.0, opts=opts)

    def batch_programs(self, prompts: Sequence[np.ndarray], rng: jax.Array, opts: state_lib.Options,
                       steps_per_call: int | None = None,
                       params: sampling_lib.SamplingParams | None = None) -> programs_lib.BatchPrograms:
        """Compiles (once) the prefill and step programs for one batch of validated int32 prompts.

        `opts.cache_length` must already be set. Profiling uses this to run the exact programs
        that `generate` runs. `params`: the batch_size rows' settings and stop ids
        (`sampling.STOP_WIDTH` wide); None: greedy rows that stop at their budget only.
        """
        steps_per_call = steps_per_call or self.config.steps_per_call
        longest, rows = max(len(p) for p in prompts), self.config.batch_size
        width = inputs.bucket_length(longest, self.max_length)
        if self.config.fixed_shapes:
            if longest > self.max_length // 2:
                raise config_lib.InputError(f"with fixed_shapes, prompts may have up to {self.max_length // 2} "
                                            f"tokens, got {longest}")
            width = self.max_length // 2
        tokens = np.zeros((rows, width), np.int32)
        lengths = np.ones((rows,), np.int32)  # idle padding rows hold one token
        for row, prompt in enumerate(prompts):
            tokens[row, :len(prompt)], lengths[row] = prompt, len(prompt)
        if params is None:
            params = sampling_lib.SamplingParams.neutral(rows, sampling_lib.STOP_WIDTH)
        args = (self.target_params, self.head_params, jnp.asarray(tokens), jnp.asarray(lengths), rng, params)
        compile_before = self.compile_seconds
        start = self._program("start", self._start, args, dict(opts=opts), width)
        # The step programs serve every prefill width, lowered for the state `start` returns.
        state_shape = None if self.config.eager else self._state_shape(start.out_info)
        runs = self._run_programs("run", state_shape, steps_per_call, opts)
        return programs_lib.BatchPrograms(start=start, runs=runs, start_args=args, prompt_lengths=lengths,
                                          idle=np.arange(rows) >= len(prompts), steps_per_call=steps_per_call,
                                          compile_seconds=self.compile_seconds - compile_before, opts=opts)

    def _drafting(self, opts: state_lib.Options, rows: int) -> state_lib.Options:
        """opts for a run call over `rows` rows: its chain drafts `k_for_rows(rows)` tokens a step."""
        if opts.tree is not None or not opts.k:
            return opts
        k = self.config.k_for_rows(rows)
        return opts if k == opts.k else opts.replace(step_k=k)

    def _run_programs(self, name: str, state_shape, steps_per_call: int | None, opts: state_lib.Options,
                      extra_args: tuple = (), rows: int | None = None, **static) -> dict[int, Callable]:
        """The device loop compiled for a quarter, half and all of the cache as attention's reach
        (`Options.attend_length`), keyed by that length, ascending.

        Attention costs what it reads: the host picks, per call, the shortest length that covers
        its rows (`scheduler.attend_length`). One row reads mostly weights, so a batch of one
        compiles the whole-cache program alone, as do trees. `rows`: the program runs only that
        many of the state's rows, named by one more argument, their [rows] int32 slot ids
        (`_run_rows`); None: every row. Those few rows' attention reads little, so they too take
        the whole-cache program alone (fewer programs to compile at start-up). `steps_per_call`:
        the steps a call takes, compiled in; None: each call's limit is an argument, after
        min_finished in `extra_args` (`_run`'s `steps`).
        """
        cache = opts.cache_length
        if self.config.tree is not None or self.config.batch_size == 1 or rows is not None:
            lengths = [cache]
        else:
            lengths = sorted({max(cache // 4, inputs.MIN_BUCKET), max(cache // 2, inputs.MIN_BUCKET), cache})
        args = (self.target_params, self.head_params, state_shape) + extra_args
        function = self._run
        if rows is not None:
            args, function = args + (np.zeros((rows,), np.int32),), self._run_rows
        return {length: self._program(name, function, args, dict(
                    num_steps=steps_per_call, opts=opts if length == cache else opts.replace(attend_length=length),
                    **static), rows or 0, donate=("state",))
                for length in lengths}

    def _program(self, name: str, function, args, static: dict, bucket, donate: tuple[str, ...] = (),
                 mode: sampling_lib.SamplingMode | None = None):
        """The compiled program for this prefill bucket (a width, or rows and width) and static
        settings, compiled once.

        The in-memory key is cheap (parameters and batch size are fixed per engine); the
        persistent cache key, built only on a miss, spells out every argument shape (the kernel
        choice is in `opts`, a static argument). `mode`: the sampling mode of a program without
        `opts` whose state follows it.
        """
        if self.config.eager:
            def op_by_op(*a):
                with jax.disable_jit():
                    return function(*a, **static)
            return op_by_op
        key = (name, bucket, tuple(sorted(static.items())), mode)
        if key not in self.compiled:
            # With the code (`program_identity`), this text determines the program: its entry
            # in the persistent cache is found without tracing it.
            description = repr((name, self._function_text(function), donate, _spec(args), sorted(static.items()),
                                self.model_config, self.head_config, self.max_length, self.config.steps_per_check,
                                mode))
            module = programs_lib.module_name(name, static.get("opts"), self.head_config)
            jitted = jax.jit(function, static_argnames=tuple(static), donate_argnames=donate)
            self.compiled[key] = self._build(module, description, functools.partial(self._lower, jitted, args, static))
        return self.compiled[key]

    def _function_text(self, function) -> str:
        """A program's function as description text: one of this compiler's methods, or a
        functools.partial of one with its bound arguments' shapes. Anything else could close over
        values the description would miss, so it is refused."""
        bound = function.func if isinstance(function, functools.partial) else function
        if getattr(bound, "__self__", None) is not self:
            raise TypeError(f"a compiled program's function must be a method of its Compiler, got {function!r}")
        if isinstance(function, functools.partial):
            return repr((bound.__name__, _spec(function.args), _spec(function.keywords)))
        return bound.__name__

    def _lower(self, jitted, args, static):
        began = time.perf_counter()
        lowered = jitted.lower(*args, **static)
        self.lowering_seconds += time.perf_counter() - began
        return lowered

    def _build(self, module: str, description: str, lower: Callable):
        """Loads the program from the persistent cache or lowers and compiles it: on the pool's
        threads inside `compiling` (lowering stays on this thread), here otherwise."""
        cache = self.compile_cache
        if self._pool is None:
            compiled, seconds = cache.load_or_compile(module, description, lower)
            self.compile_seconds += seconds
            return compiled
        if cache.stored(module, description):
            return Pending(self._pool.submit(cache.load, module, description),
                           rebuild=lambda: cache.compile(module, description, lower()))
        lowered = lower()
        return Pending(self._pool.submit(cache.compile, module, description, lowered), lowered=lowered)

    # Pure functions of (params, inputs): the jit boundary merges modules inside.
    def _modules(self, target_params: Packed, head_params: Packed):
        target = nnx.merge(self._target_def, target_params.unpack())
        return target, nnx.merge(self._head_def, head_params.unpack()) if self._head_def is not None else None

    def _place(self, state):
        return sharding_lib.pin_state(state, self.model_config, self.mesh)

    def _state_shape(self, shape):
        return sharding_lib.abstract_state(_bare(shape), self.model_config, self.mesh)

    def _start(self, target_params, head_params, tokens, lengths, rng, params, opts):
        target, head = self._modules(target_params, head_params)
        return self._place(speculative.start(target, head, tokens, lengths, rng, opts, params=params))

    def _start_rows(self, target_params, head_params, tokens, lengths, budgets, params, rng, opts):
        target, head = self._modules(target_params, head_params)
        return self._place(speculative.start(target, head, tokens, lengths, rng, opts, budgets, params))

    def _run(self, target_params, head_params, state, min_finished=1, steps=None, *, num_steps, opts,
             stop_on_finish=False):
        """Up to num_steps steps (static), or up to `steps` (an int32 scalar, traced) when num_steps is None."""
        target, head = self._modules(target_params, head_params)
        return self._place(speculative.run_steps(target, head, state, steps if num_steps is None else num_steps,
                                                 opts, self.config.steps_per_check, stop_on_finish, min_finished))

    def _run_rows(self, target_params, head_params, state, min_finished, steps, slot_ids, *, num_steps, opts,
                  stop_on_finish=False):
        """`_run` on the rows `slot_ids` of `state` alone (`programs.take_rows`), put back in place."""
        rows = self._run(target_params, head_params, programs_lib.take_rows(state, slot_ids), min_finished, steps,
                         num_steps=num_steps, opts=opts, stop_on_finish=stop_on_finish)
        return self._place(programs_lib.insert(state, rows, slot_ids).replace(rng=rows.rng))

    def _insert(self, state, rows, slot_ids):
        return self._place(programs_lib.insert(state, rows, slot_ids))

    def _empty(self, rng, *, shape):
        return self._place(programs_lib.empty_state(shape, rng))
