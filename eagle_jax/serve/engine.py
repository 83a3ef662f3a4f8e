"""`Engine`: compiles the device programs for one target (and head) and generates with them.

The device programs live in `decode.speculative`; the engine compiles them ahead of time (so
generation timings exclude compilation and compile counts are observable) for the shapes its
`EngineConfig` asks, and hands them to the host loops of `scheduler` (static batches, or
continuous batching over decode slots). Input checks live in `inputs`.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import jax
import numpy as np

from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.decode import speculative
from eagle_jax.model import llama
from eagle_jax.serve import compile_cache as compile_cache_lib
from eagle_jax.serve import compiler as compiler_lib
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import inputs
from eagle_jax.serve import programs as programs_lib
from eagle_jax.serve import result as result_lib
from eagle_jax.serve import scheduler as scheduler_lib


class Engine:
    """Compiles and runs (speculative) generation for one target and optional EAGLE head.

    Args:
        target: the Llama target.
        head: an EAGLE head; needed when `config` drafts (a chain or a tree).
        config: every setting (`EngineConfig`). The target is split over
            `config.tensor_parallel_size` devices and the head replicated or split too
            (`sharding`, in `compiler.Compiler`); the modules given are unchanged.

    Raises:
        config.InputError: speculation asked without a head.
    """

    def __init__(self, target: llama.Llama, head=None, config: config_lib.EngineConfig = config_lib.EngineConfig()):
        if config.speculative and head is None:
            raise config_lib.InputError("num_speculative_tokens > 0 or a tree needs a draft head")
        self.config = config
        self.model_config = target.config
        self.max_length = min(config.max_length, target.config.max_position_embeddings)
        self.kernels = config.kernels(jax.default_backend())
        self.compiler = compiler_lib.Compiler(target, head if config.speculative else None, config, self.max_length,
                                              self.options)
        self.head_config = self.compiler.head_config

    @property
    def compile_cache(self) -> compile_cache_lib.CompileCache:
        return self.compiler.compile_cache

    @property
    def compile_seconds(self) -> float:
        """Seconds this engine spent compiling (persistent-cache loads included)."""
        return self.compiler.compile_seconds

    @property
    def k(self) -> int:
        return self.config.k

    @property
    def headroom(self) -> int:
        """Cache slots past a row's committed length that one step may write."""
        return self.config.cache_headroom

    @property
    def num_compilations(self) -> int:
        """XLA compilations this engine ran (persistent-cache hits excluded)."""
        return self.compiler.compile_cache.misses

    def options(self, **settings) -> speculative.Options:
        """The step options for these settings (sampling, eos_ids, ...), with this engine's drafting and kernels."""
        return speculative.Options(k=self.k, tree=self.config.tree,
                                   disable_by_batch_size=self.config.speculative_disable_by_batch_size,
                                   decode_kernels=self.kernels.decode_kernels,
                                   attention_tiling=self.kernels.attention_tiling,
                                   unroll_draft=self.config.unroll_draft, **settings)

    def check_prompts(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]) -> list[np.ndarray]:
        """The prompts as int32 arrays, each checked to be in the vocabulary and to fit the cache (`inputs`)."""
        return inputs.check_prompts(prompts, inputs.budgets(max_new_tokens, len(prompts)),
                                    self.model_config.vocab_size, self.max_length, self.config)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int] = 128,
                 sampling: sampling_lib.Sampling = sampling_lib.Sampling(), seed: int = 0, ignore_eos: bool = False,
                 eos_ids: Sequence[int] | None = None,
                 on_tokens: Callable[[int, list[int]], None] | None = None,
                 on_result: Callable[[int, result_lib.Result], None] | None = None) -> list[result_lib.Result]:
        """Generates for each prompt (lists or arrays of token ids, any integer dtype); results in input order.

        Args:
            max_new_tokens: one budget for all prompts, or (continuous scheduler only) one per prompt.
            eos_ids: the ids that end a row; None: the model's. ignore_eos: none end a row.
            on_tokens: called as `on_tokens(prompt_index, new_ids)` after each device call, for
                streaming (a smaller `steps_per_call` streams more smoothly).
            on_result: called as `on_result(prompt_index, result)` as soon as a prompt is done
                (static batches: at the end of its batch, in input order; continuous: in the order
                they finish, without the `calls` counters, which cover the whole call), so a
                caller can write each result before the others finish.

        Raises:
            config.InputError: naming the first bad prompt, token id or budget.
        """
        began = time.perf_counter()
        eos = () if ignore_eos else tuple(self.model_config.eos_token_ids if eos_ids is None else eos_ids)
        continuous = self.config.scheduler == "continuous"
        if not continuous and not isinstance(max_new_tokens, (int, np.integer)):
            raise config_lib.InputError("per-prompt max_new_tokens needs scheduler='continuous'")
        budgets = inputs.budgets(max_new_tokens, len(prompts))
        prompts = inputs.check_prompts(prompts, budgets, self.model_config.vocab_size, self.max_length, self.config)
        if continuous:
            programs = self.compiler.slot_programs(sampling, eos)
            return scheduler_lib.generate(programs, prompts, budgets, jax.random.key(seed), on_tokens, began,
                                          self.config.resolved_refill_at, on_result)
        opts = self.options(sampling=sampling, eos_ids=eos, max_new_tokens=int(max_new_tokens))
        results, rng, rows = [], jax.random.key(seed), self.config.batch_size
        for first in range(0, len(prompts), rows):
            rng, batch_rng = jax.random.split(rng)
            batch = prompts[first:first + rows]
            emit = None if on_tokens is None else (lambda row, ids, first=first: on_tokens(first + row, ids))
            cache_length = self.max_length if self.config.fixed_shapes else inputs.bucket_length(
                max(len(p) for p in batch) + opts.max_new_tokens + self.headroom, self.max_length)
            programs = self.compiler.batch_programs(batch, batch_rng, opts.replace(cache_length=cache_length))
            results += scheduler_lib.generate_static(programs, len(batch), emit, began)
            for index in range(first, len(results)):
                if on_result is not None:
                    on_result(index, results[index])
        return results

    def slot_programs(self, sampling: sampling_lib.Sampling, eos_ids: tuple[int, ...],
                      steps_per_call: int | None = None) -> programs_lib.SlotPrograms:
        """The continuous scheduler's programs for these settings, compiled once (`Compiler.slot_programs`)."""
        return self.compiler.slot_programs(sampling, eos_ids, steps_per_call)

    def batch_programs(self, prompts: Sequence[np.ndarray], rng: jax.Array, opts: speculative.Options,
                       steps_per_call: int | None = None) -> programs_lib.BatchPrograms:
        """One static batch's programs, compiled once (`Compiler.batch_programs`); profiling runs them."""
        return self.compiler.batch_programs(prompts, rng, opts, steps_per_call)
