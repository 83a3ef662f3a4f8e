"""Host side of generation: input checks, prefill buckets, compilation, results.

The device programs live in `speculative`; this module compiles them ahead of time (so
generation timings exclude compilation and compile counts are observable), feeds them
int32 arrays of fixed shapes, and turns the final state into per-prompt results. The host
loops (static batches, continuous batching over decode slots) live in `scheduler`.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.serve import compile_cache as compile_cache_lib
from eagle_jax.model import layers
from eagle_jax.model import llama
from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.serve import scheduler as scheduler_lib
from eagle_jax.serve import sharding as sharding_lib
from eagle_jax.decode import speculative
from eagle_jax.decode import tree as tree_lib
from eagle_jax.kernels import decode_attention

MIN_BUCKET = 16


class InputError(ValueError):
    """Bad user input (token ids, lengths, settings): reported without a traceback by the CLI."""


def as_token_ids(ids, vocab_size: int) -> np.ndarray:
    """Validates one prompt's token ids and returns them as int32.

    int64 ids (what `argmax` or a tokenizer returns) are range-checked, then cast: feeding
    them unchecked to an int32 program would wrap silently.
    """
    array = np.asarray(ids)
    if array.ndim != 1 or array.size == 0:
        raise InputError(f"a prompt must be a non-empty 1-D sequence of token ids, got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.integer):
        raise InputError(f"token ids must be integers, got dtype {array.dtype}")
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise InputError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return array.astype(np.int32)


def bucket_length(length: int, max_length: int) -> int:
    """Power-of-two width (>= MIN_BUCKET) for prefill and cache, capped at max_length."""
    return min(max(MIN_BUCKET, 1 << (length - 1).bit_length()), max_length)


def fixed_max_length(longest_prompt: int, max_new_tokens: int, headroom: int, limit: int) -> int:
    """The smallest power-of-two `max_length` (capped at `limit`) whose fixed shapes take these prompts.

    Fixed shapes (`fixed_shapes=True` and the continuous scheduler) prefill max_length // 2
    tokens and keep a max_length cache for every prompt; attention reads the whole cache, so a
    cache sized to the request rather than to `limit` is cheaper at every step. `headroom` is
    the cache slots one step may write past the committed length (`Options.cache_headroom`:
    k + 1 for a chain of k drafts).
    """
    return bucket_length(max(longest_prompt + max_new_tokens + headroom, 2 * longest_prompt), limit)


@dataclasses.dataclass
class Result:
    """One prompt's generation."""

    token_ids: list[int]
    seconds: float  # wall time of its batch (continuous: from its prefill to its harvest), excluding compilation
    compile_seconds: float
    stats: dict
    # Host wall-clock seconds from the start of the `generate` call (every prompt arriving then)
    # to its first and its last token, compilation inside the call included. Both are read where
    # the host loop syncs (after prefill or a device call), so they resolve one device call of
    # steps_per_call steps (`scheduler.Finished`).
    first_token_seconds: float
    finish_seconds: float
    # What the host loop that produced it asked of the device (`scheduler.CallCounts.as_dict()`:
    # run, prefill and insert calls, syncs, sync and host seconds), shared by the prompts of one
    # continuous call or one static batch.
    calls: dict = dataclasses.field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0


def pooled_stats(results: Sequence[Result], k: int) -> dict:
    """Acceptance over many results, pooled over all drafts (vLLM's convention, not a mean of means)."""
    drafts = sum(r.stats["num_drafts"] for r in results)
    accepted = sum(r.stats["num_accepted_tokens"] for r in results)
    per_position = np.zeros(k)
    for result in results:
        per_position += np.asarray(result.stats["acceptance_rate_per_position"][:k], float) * result.stats["num_drafts"]
    return dict(acceptance_length=1 + accepted / drafts if drafts else 1.0, num_drafts=drafts,
                num_accepted_tokens=accepted, acceptance_rate_per_position=(per_position / max(drafts, 1)).tolist())


def choose_decode_kernels(backend: str, mesh) -> str:
    """What decode_kernels="auto" runs: "pallas" where it measured faster, else "xla".

    H200, bf16, MT-Bench 80 x 256, one GPU (docs/BENCHMARKS.md). EAGLE-3 chains ran faster with
    them wherever one lease measured both: 31,586 against 22,007 tokens/s at 64 rows and 14,209
    against 13,064 at 16 (k = 5, continuous scheduler, lease 16), and, since the token-block
    attention kernel, 2,078 against 1,914 at batch 1 (k = 6, lease 19), where XLA's had led.
    Plain decoding: 942 against 785 tokens/s at batch 1 (lease 6); at 16 and 64 rows the Pallas
    runs (lease 11) beat XLA's of lease 7 by 8-31%. Trees (measured at batch 1 only) ran slower
    on them until the attention kernel's few-row tiling (`Tiling.for_rows`): tree 4/5/16 1,802
    against XLA's 2,050 (lease 21), then 2,321 against 2,120 (lease 22). The kernels run on one
    device, and interpret slowly off a GPU.
    """
    return "pallas" if backend == "gpu" and mesh is None else "xla"


class Engine:
    """Compiles and runs (speculative) generation for one target and optional EAGLE head.

    Args:
        target: the Llama target.
        head: an EAGLE head, or None for plain decoding.
        num_speculative_tokens: k, a chain of k drafts per step; 0 means plain decoding.
        tree: draft an EAGLE-2 tree per step instead of a chain (`tree.TreeOptions`: topk,
            num_steps, num_draft_tokens); excludes num_speculative_tokens.
        max_length: the largest KV cache (prompt + new tokens + the step's headroom, k + 1 for a
            chain, `TreeOptions.cache_headroom` for a tree, must fit). Each batch
            uses the power-of-two cache length its request needs, up to this: attention reads
            the whole cache, so a right-sized one is up to 7x faster on CPU.
        batch_size: rows per compiled program; shorter batches are padded with idle rows.
        eager: run the same functions op by op, without jit (for comparison only: slow).
        cache_dir: persistent compilation cache root; None compiles in memory only. Compiling
            raises `compile_cache.CompileCacheError` if others could write to it.
        fixed_shapes: use one prefill width (max_length // 2) and one cache length
            (max_length) for every batch: two programs in all instead of one per bucket.
        steps_per_check: steps between the device loop's "all rows done" tests
            (`speculative.run_steps`); 1 tests after every step.
        scheduler: "static" runs batches of `batch_size` prompts until each batch's longest row
            ends; "continuous" keeps `batch_size` decode slots and refills a slot as soon as its
            row finishes (`scheduler`), with prefills in power-of-two widths up to max_length // 2
            and one cache length (max_length), all compiled up front, so nothing recompiles
            across prompts or budgets.
        refill_at: the continuous scheduler's device call returns (to refill slots) once this many
            of its rows have finished, or as many as there are prompts left to start if fewer;
            with none left, a call runs its steps_per_call steps (or until every row is done).
            Each return is a device-to-host round trip; waiting for more rows costs idle
            row-steps instead: with rows of ~L steps finishing at random, about (refill_at - 1) / (2
            x batch_size) of the slots idle. Default: a quarter of the slots, at least 1 (on the
            H200 at 16 slots it made 22 run calls for MT-Bench's 80 prompts, their fetches 0.02 s
            of 2.2 s; other values not yet measured; docs/BENCHMARKS.md).
        speculative_disable_by_batch_size: while more rows than this are active, steps decode
            plainly (vLLM's flag of this name): a large batch fills the device without drafts.
            The switch happens inside the compiled step, both ways; greedy outputs are the same.
            None speculates at every step.
        decode_kernels: "auto" (default), "xla", "pallas" or "pallas_linear". "pallas": fused
            Pallas kernels for the norms, projections and attention (a tree's verify too, not its
            drafting) of decode steps of up to 32 rows, and the attention kernel alone in larger
            ones, in target and head; "pallas_linear": the same fused norms and projections with
            XLA's attention (`layers.with_decode_kernels`). The engine uses copies, the modules
            given are unchanged. "auto" picks them where they measured faster
            (`choose_decode_kernels`), XLA elsewhere; `self.decode_kernels` holds the choice.
        attention_tiling: the Pallas attention kernel's block size and launch settings, in target
            and head (`decode_attention.Tiling`; needs decode_kernels "pallas", or "auto" choosing it).
            None (default): the kernel's own choice for the batch (`Tiling.for_rows`).
        mesh: a `jax.sharding.Mesh` with a "tensor" axis (`sharding.make_mesh`): the target is
            split over it Megatron-style and the head replicated, or split too (below; `sharding`);
            XLA SPMD places the collectives inside the same compiled programs. None runs on one device.
        draft_tensor_parallel_size: vLLM's name: 1 (or None) keeps the head whole on every
            device; the mesh's size splits its MLPs and draft vocabulary too (`sharding.shard_head`).
    """

    def __init__(self, target: llama.Llama, head=None, *, num_speculative_tokens: int = 0,
                 tree: tree_lib.TreeOptions | None = None, max_length: int = 2048, batch_size: int = 1,
                 eager: bool = False, cache_dir=None, fixed_shapes: bool = False, steps_per_check: int = 1,
                 scheduler: str = "static", speculative_disable_by_batch_size: int | None = None,
                 decode_kernels: str = "auto", mesh: jax.sharding.Mesh | None = None, refill_at: int | None = None,
                 draft_tensor_parallel_size: int | None = None,
                 attention_tiling: decode_attention.Tiling | None = None):
        if num_speculative_tokens < 0:
            raise InputError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        if (num_speculative_tokens or tree is not None) and head is None:
            raise InputError("num_speculative_tokens > 0 or a tree needs a draft head")
        if num_speculative_tokens and tree is not None:
            raise InputError("num_speculative_tokens (a chain) and tree exclude each other")
        self.config = target.config
        self.tree = tree
        self.k = tree.num_steps if tree is not None else (num_speculative_tokens if head is not None else 0)
        self.max_length = min(max_length, self.config.max_position_embeddings)
        self.batch_size = batch_size
        self.eager = eager
        self.fixed_shapes = fixed_shapes
        if steps_per_check < 1:
            raise InputError(f"steps_per_check must be >= 1, got {steps_per_check}")
        self.steps_per_check = steps_per_check
        if scheduler not in ("static", "continuous"):
            raise InputError(f"scheduler must be 'static' or 'continuous', got {scheduler!r}")
        self.scheduler = scheduler
        if refill_at is not None and refill_at < 1:
            raise InputError(f"refill_at must be >= 1, got {refill_at}")
        self.refill_at = min(refill_at or max(1, batch_size // 4), batch_size)
        if speculative_disable_by_batch_size is not None and speculative_disable_by_batch_size < 1:
            raise InputError(f"speculative_disable_by_batch_size must be >= 1, got {speculative_disable_by_batch_size}")
        self.speculative_disable_by_batch_size = speculative_disable_by_batch_size
        if decode_kernels not in ("auto",) + layers.DECODE_KERNELS:
            raise InputError(f"decode_kernels must be one of {('auto',) + layers.DECODE_KERNELS}, got {decode_kernels!r}")
        if decode_kernels == "auto":
            decode_kernels = choose_decode_kernels(jax.default_backend(), mesh)
        if mesh is not None and decode_kernels != "xla":
            raise InputError(f"decode_kernels={decode_kernels!r} runs on one device; it does not take a mesh")
        if attention_tiling is not None and decode_kernels != "pallas":
            raise InputError(f"attention_tiling sets the Pallas attention kernel; decode_kernels={decode_kernels!r} "
                             "does not run it (pass decode_kernels='pallas')")
        if decode_kernels != "xla":
            target = layers.with_decode_kernels(target, decode_kernels, attention_tiling)
            head = layers.with_decode_kernels(head, decode_kernels, attention_tiling) if head is not None else None
        self.decode_kernels = decode_kernels
        self.attention_tiling = attention_tiling
        self.mesh = mesh
        size = sharding_lib.tensor_parallel_size(mesh)
        if draft_tensor_parallel_size not in (None, 1, size):
            raise InputError(f"draft_tensor_parallel_size must be 1 (the head whole on every device) or the tensor "
                             f"parallel size {size} (split like the target), got {draft_tensor_parallel_size}")
        self.draft_tensor_parallel_size = draft_tensor_parallel_size or 1
        if mesh is not None:
            target = sharding_lib.shard_target(target, mesh)
            if head is not None:
                head = (sharding_lib.shard_head(head, mesh) if self.draft_tensor_parallel_size > 1
                        else sharding_lib.replicate(head, mesh))
        self._target_def, self.target_params = nnx.split(target)
        self._head_def, self.head_params = nnx.split(head) if head is not None else (None, None)
        self.head_config = head.config if head is not None else None
        self.compile_cache = compile_cache_lib.CompileCache(cache_dir, mesh)
        self._compiled: dict = {}
        self.compile_seconds = 0.0

    def options(self, **settings) -> speculative.Options:
        """The step options for these settings (sampling, eos_ids, ...), with this engine's drafting."""
        return speculative.Options(k=self.k, tree=self.tree,
                                   disable_by_batch_size=self.speculative_disable_by_batch_size, **settings)

    @property
    def headroom(self) -> int:
        """Cache slots past a row's committed length that one step may write."""
        return self.options().cache_headroom

    @property
    def num_compilations(self) -> int:
        """XLA compilations this engine ran (persistent-cache hits excluded)."""
        return self.compile_cache.misses

    def module_name(self, program: str, opts: speculative.Options | None) -> str:
        if opts is None:
            return program
        method = self.head_config.method if self.head_config is not None and opts.k else "plain"
        if program in ("start", "prefill-slots"):
            return f"prefill-{method}"
        if opts.tree is not None:
            tree = opts.tree
            return f"speculative-{method}-topk{tree.topk}-steps{tree.num_steps}-draft{tree.num_draft_tokens}"
        return f"speculative-{method}-k{opts.k}" if opts.k else "decode"

    @property
    def tensor_parallel_size(self) -> int:
        return sharding_lib.tensor_parallel_size(self.mesh)

    def _place(self, state):
        return sharding_lib.pin_state(state, self.config, self.mesh)

    def _state_shape(self, shape):
        return sharding_lib.abstract_state(shape, self.config, self.mesh)

    # Pure functions of (params, inputs): the jit boundary merges modules inside.
    def _modules(self, target_params, head_params):
        target = nnx.merge(self._target_def, target_params)
        head = nnx.merge(self._head_def, head_params) if self._head_def is not None else None
        return target, head

    def _start(self, target_params, head_params, tokens, lengths, rng, opts):
        target, head = self._modules(target_params, head_params)
        return self._place(speculative.start(target, head, tokens, lengths, rng, opts))

    def _start_rows(self, target_params, head_params, tokens, lengths, budgets, rng, opts):
        target, head = self._modules(target_params, head_params)
        return self._place(speculative.start(target, head, tokens, lengths, rng, opts, budgets))

    def _run(self, target_params, head_params, state, min_finished=1, *, num_steps, opts, stop_on_finish=False):
        target, head = self._modules(target_params, head_params)
        return self._place(speculative.run_steps(target, head, state, num_steps, opts, self.steps_per_check,
                                                 stop_on_finish, min_finished))

    def _insert(self, state, rows, take):
        return self._place(scheduler_lib.insert(state, rows, take))

    def _empty(self, rng, *, shape):
        return self._place(scheduler_lib.empty_state(shape, rng))

    def _program(self, name: str, function, args, static: dict, width: int, donate: tuple[str, ...] = ()):
        """The compiled program for this prefill width and static settings, compiled once.

        The in-memory key is cheap (parameters and batch size are fixed per engine); the
        persistent cache key, built only on a miss, spells out every argument shape.
        """
        if self.eager:
            def op_by_op(*a):
                with jax.disable_jit():
                    return function(*a, **static)
            return op_by_op
        key = (name, width, tuple(sorted(static.items())))
        if key not in self._compiled:
            shapes = jax.tree.map(lambda x: (x.shape, x.dtype) if hasattr(x, "shape") else x, args)
            # decode_kernels and attention_tiling change the program text, which names the entry
            # anyway; keyed here too.
            description = repr((name, shapes, sorted(static.items()), self.config, self.head_config, self.max_length,
                                self.steps_per_check, self.decode_kernels, self.attention_tiling))
            jitted = jax.jit(function, static_argnames=tuple(static), donate_argnames=donate)
            lowered = jitted.lower(*args, **static)
            module = self.module_name(name, static.get("opts"))
            self._compiled[key], seconds = self.compile_cache.compile(module, description, lowered)
            self.compile_seconds += seconds
        return self._compiled[key]

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int] = 128,
                 sampling: sampling_lib.Sampling = sampling_lib.Sampling(), seed: int = 0, ignore_eos: bool = False,
                 eos_ids: Sequence[int] | None = None, steps_per_call: int = 64,
                 on_tokens: Callable[[int, list[int]], None] | None = None) -> list[Result]:
        """Generates for each prompt (lists or arrays of token ids, any integer dtype).

        Args:
            max_new_tokens: one budget for all prompts, or (continuous scheduler only) one per prompt.
            on_tokens: called as `on_tokens(prompt_index, new_ids)` after each device call,
                for streaming. Smaller `steps_per_call` streams more smoothly.
        """
        began = time.perf_counter()
        eos = () if ignore_eos else tuple(self.config.eos_token_ids if eos_ids is None else eos_ids)
        if self.scheduler == "continuous":
            return self._generate_continuous(prompts, max_new_tokens, sampling, seed, eos, steps_per_call, on_tokens,
                                             began)
        if not isinstance(max_new_tokens, (int, np.integer)):
            raise InputError("per-prompt max_new_tokens needs scheduler='continuous'")
        prompts = self.check_prompts(prompts, max_new_tokens)
        opts = self.options(sampling=sampling, eos_ids=eos, max_new_tokens=max_new_tokens)
        extra = max_new_tokens + self.headroom
        results: list[Result] = []
        rng = jax.random.key(seed)
        for first in range(0, len(prompts), self.batch_size):
            rng, batch_rng = jax.random.split(rng)
            batch = prompts[first:first + self.batch_size]
            emit = None if on_tokens is None else (lambda row, ids, first=first: on_tokens(first + row, ids))
            cache_length = self.max_length if self.fixed_shapes else bucket_length(
                max(len(p) for p in batch) + extra, self.max_length)
            batch_opts = dataclasses.replace(opts, cache_length=cache_length)
            results += self._generate_batch(batch, batch_rng, batch_opts, steps_per_call, emit, began)
        return results

    def check_prompts(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]) -> list[np.ndarray]:
        """The prompts as int32 arrays, once each is checked to be in the vocabulary and to fit the cache.

        Args:
            max_new_tokens: one budget, or one per prompt.

        Raises:
            InputError: naming the first bad prompt or token id.
        """
        budgets = self._budgets(max_new_tokens, len(prompts))
        prompts = [as_token_ids(p, self.config.vocab_size) for p in prompts]
        for index, (prompt, max_new_tokens) in enumerate(zip(prompts, budgets)):
            needed = len(prompt) + max_new_tokens + self.headroom
            if needed > self.max_length:
                drafting = f"k={self.k}" if self.tree is None else f"a {self.headroom}-slot tree step"
                raise InputError(f"prompt {index} has {len(prompt)} tokens; with {max_new_tokens} new tokens and {drafting} "
                                 f"it needs {needed} cache slots, more than max_length={self.max_length}")
            if self.scheduler == "continuous" and len(prompt) > self.max_length // 2:
                raise InputError(f"prompt {index} has {len(prompt)} tokens; the continuous scheduler takes up to "
                                 f"max_length // 2 = {self.max_length // 2}")
        return prompts

    @staticmethod
    def _budgets(max_new_tokens: int | Sequence[int], num_prompts: int) -> list[int]:
        if isinstance(max_new_tokens, (int, np.integer)):
            budgets = [int(max_new_tokens)] * num_prompts
        else:
            budgets = [int(b) for b in max_new_tokens]
            if len(budgets) != num_prompts:
                raise InputError(f"{len(budgets)} max_new_tokens values for {num_prompts} prompts")
        for budget in budgets:
            if budget < 1:
                raise InputError(f"max_new_tokens must be >= 1, got {budget}")
        return budgets

    def _generate_continuous(self, prompts, max_new_tokens, sampling, seed, eos, steps_per_call, on_tokens,
                             began) -> list[Result]:
        budgets = self._budgets(max_new_tokens, len(prompts))
        prompts = self.check_prompts(prompts, budgets)
        compile_before = self.compile_seconds
        programs = self.slot_programs(sampling, eos, steps_per_call)
        finished = scheduler_lib.generate(programs, prompts, budgets, jax.random.key(seed), on_tokens, began,
                                          self.refill_at)
        return [_result(f, self.compile_seconds - compile_before) for f in finished]

    def slot_programs(self, sampling: sampling_lib.Sampling, eos_ids: tuple[int, ...],
                      steps_per_call: int) -> scheduler_lib.SlotPrograms:
        """Compiles (once per engine and settings) the continuous scheduler's prefill, insert and run.

        Shapes depend on the engine alone: prefills of all batch_size slots at once (each free
        slot's row holds its next prompt, so one call refills every freed slot) in power-of-two
        widths w up to max_length // 2, each with caches of w slots (all that a prefill writes), and
        one insert per width writing those w slots into the slots' caches of max_length (all
        compiled here so that none compiles mid-run); an output buffer for the largest budget any
        prompt could have; budgets are per row. `empty` builds the idle slots on the device. Run
        programs: one per attention length (a quarter, half and all of the cache,
        `Options.attend_length`); the scheduler picks the shortest that covers every slot its
        active rows can reach in the call, and how many rows must finish before the call returns
        (`refill_at`, an argument, not a constant of the program).
        """
        opts = self.options(sampling=sampling, eos_ids=eos_ids, max_new_tokens=self.max_length - self.headroom - 1,
                            cache_length=self.max_length)
        compile_before = self.compile_seconds
        params = (self.target_params, self.head_params)
        rows = self.batch_size
        row_args = lambda w: params + (np.zeros((rows, w), np.int32), np.ones((rows,), np.int32),
                                       np.ones((rows,), np.int32), jax.random.key(0))
        width = self.max_length // 2
        widths = sorted({bucket_length(length, width) for length in range(1, width + 1)})
        # `speculative.start` writes cache slots [0, w) only: its caches need no more.
        row_opts = {w: opts.replace(cache_length=w) for w in widths}
        prefills = {w: self._program("prefill-slots", self._start_rows, row_args(w), dict(opts=row_opts[w]), w)
                    for w in widths}

        def row_shape(w):  # the compiled prefill knows its output shapes: no second trace of the model
            if self.eager:
                return jax.eval_shape(functools.partial(self._start_rows, opts=row_opts[w]), *row_args(w))
            return prefills[w].out_info

        key = jax.random.key(0)
        make_empty = functools.partial(self._empty, shape=scheduler_lib.slot_shape(row_shape(width), self.max_length))
        empty = self._program("empty", make_empty, (key,), {}, 0)
        state_shape = self._state_shape(jax.eval_shape(make_empty, key))
        inserts = {w: self._program("insert", self._insert, (state_shape, self._state_shape(row_shape(w)),
                                                             np.zeros((rows,), bool)), {}, w, donate=("state",))
                   for w in widths}
        # Its own name: a static batch with the same options would lower the same step, but for
        # the prefill's output types rather than these (weak types may differ).
        runs = self._run_programs("slots-run", state_shape, steps_per_call, opts, (np.int32(1),), stop_on_finish=True)
        return scheduler_lib.SlotPrograms(
            prefill=lambda tokens, *inputs: prefills[tokens.shape[1]](*params, tokens, *inputs),
            insert=lambda state, new, take: inserts[new.cache.max_length](state, new, take),
            run=lambda state, attend_length, refill_at: runs[attend_length](*params, state, refill_at), empty=empty,
            batch_size=self.batch_size, widths=tuple(widths), attend_lengths=tuple(runs),
            steps_per_call=steps_per_call, compile_seconds=self.compile_seconds - compile_before, opts=opts)

    def _run_programs(self, name: str, state_shape, steps_per_call: int, opts: speculative.Options,
                      extra_args: tuple = (), **static) -> dict[int, Callable]:
        """The device loop compiled for a quarter, half and all of the cache as attention's reach
        (`Options.attend_length`), keyed by that length, ascending.

        Attention costs what it reads: the host picks, per call, the shortest length that covers
        its rows (`scheduler.attend_length`), so a cache sized for the longest request is not
        read whole at every step. All are compiled here, so none compiles mid-generation. One
        row reads mostly weights (at 1,024 slots SmolLM2's cache is 24 MB a row, its weights
        270 MB), so a batch of one compiles the whole-cache program alone, as do trees.
        """
        cache = opts.cache_length
        if self.tree is not None or self.batch_size == 1:
            lengths = [cache]
        else:
            lengths = sorted({max(cache // 4, MIN_BUCKET), max(cache // 2, MIN_BUCKET), cache})
        args = (self.target_params, self.head_params, state_shape) + extra_args
        return {length: self._program(name, self._run, args, dict(
                    num_steps=steps_per_call, opts=opts if length == cache else opts.replace(attend_length=length),
                    **static), 0, donate=("state",))
                for length in lengths}

    def batch_programs(self, prompts: Sequence[np.ndarray], rng: jax.Array, opts: speculative.Options,
                       steps_per_call: int) -> scheduler_lib.BatchPrograms:
        """Compiles (once) the prefill and step programs for one batch of validated int32 prompts.

        `opts.cache_length` must already be set. Profiling uses this to run the exact programs
        that `generate` runs.
        """
        longest = max(len(p) for p in prompts)
        width = bucket_length(longest, self.max_length)
        if self.fixed_shapes:
            if longest > self.max_length // 2:
                raise InputError(f"with fixed_shapes, prompts may have up to {self.max_length // 2} tokens, got {longest}")
            width = self.max_length // 2
        tokens = np.zeros((self.batch_size, width), np.int32)
        lengths = np.ones((self.batch_size,), np.int32)  # idle padding rows hold one token
        for row, prompt in enumerate(prompts):
            tokens[row, :len(prompt)] = prompt
            lengths[row] = len(prompt)
        args = (self.target_params, self.head_params, jnp.asarray(tokens), jnp.asarray(lengths), rng)
        compile_before = self.compile_seconds
        start = self._program("start", self._start, args, dict(opts=opts), width)
        # The step program is lowered for the state that `start` returns: the compiled prefill
        # knows its output shapes (tracing the 30-layer prefill again would cost seconds).
        state_shape = None if self.eager else self._state_shape(start.out_info)
        # The step programs do not depend on the prefill width: they serve every bucket.
        runs = self._run_programs("run", state_shape, steps_per_call, opts)
        return scheduler_lib.BatchPrograms(start=start, runs=runs, start_args=args, prompt_lengths=lengths,
                                           idle=np.arange(self.batch_size) >= len(prompts),
                                           steps_per_call=steps_per_call,
                                           compile_seconds=self.compile_seconds - compile_before, opts=opts)

    def _generate_batch(self, prompts, rng, opts, steps_per_call, emit, began) -> list[Result]:
        programs = self.batch_programs(prompts, rng, opts, steps_per_call)
        finished = scheduler_lib.generate_static(programs, len(prompts), emit, began)
        return [_result(f, programs.compile_seconds) for f in finished]


def _result(finished: scheduler_lib.Finished, compile_seconds: float) -> Result:
    return Result(token_ids=finished.token_ids, seconds=finished.seconds, compile_seconds=compile_seconds,
                  stats=finished.stats, first_token_seconds=finished.first_token_seconds,
                  finish_seconds=finished.finish_seconds, calls=finished.calls)
