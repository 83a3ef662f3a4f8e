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
from eagle_jax.model import llama
from eagle_jax.serve import compile_cache as compile_cache_lib
from eagle_jax.serve import compiler as compiler_lib
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import inputs
from eagle_jax.serve import outputs as outputs_lib
from eagle_jax.serve import programs as programs_lib
from eagle_jax.serve import result as result_lib
from eagle_jax.serve import scheduler as scheduler_lib
from eagle_jax.serve import static_batch
from eagle_jax.decode import state as state_lib


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

    def options(self, **settings) -> state_lib.Options:
        """The step options for these settings (sampling_mode, max_new_tokens, ...), with this engine's drafting and kernels."""
        return state_lib.Options(k=self.k, tree=self.config.tree,
                                 disable_by_batch_size=self.config.speculative_disable_by_batch_size,
                                 decode_kernels=self.kernels.decode_kernels,
                                 attention_tiling=self.kernels.attention_tiling,
                                 unroll_draft=self.config.unroll_draft, **settings)

    def check_prompts(self, prompts: Sequence[Sequence[int]], max_new_tokens: int | Sequence[int]) -> list[np.ndarray]:
        """The prompts as int32 arrays, each checked to be in the vocabulary and to fit the cache (`inputs`)."""
        return inputs.check_prompts(prompts, inputs.budgets(max_new_tokens, len(prompts)),
                                    self.model_config.vocab_size, self.max_length, self.config)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int | Sequence[int] = 128,
                 sampling: sampling_lib.Sampling | Sequence[sampling_lib.Sampling] = sampling_lib.Sampling(),
                 seed: int = 0, ignore_eos: bool = False, eos_ids: Sequence[int] | None = None, tokenizer=None,
                 on_tokens: Callable[[int, list[int]], None] | None = None,
                 on_result: Callable[[int, result_lib.Result], None] | None = None) -> list[result_lib.Result]:
        """Generates for each prompt (lists or arrays of token ids, any integer dtype).

        Every row of a batch samples with its own settings in the same compiled programs; which
        programs a call runs is its sampling mode (`EngineConfig.sampling_mode`: fixed, or the
        smallest covering the call's requests).

        Args:
            max_new_tokens: one budget for all prompts, or (continuous scheduler only) one per prompt.
            sampling: one `Sampling` for all prompts, or one each. A prompt whose `n` > 1 gives n
                rows (samples), each drawing with its own key.
            seed: the key of the rows without a seed of their own.
            eos_ids: the ids that end a row; None: the model's. ignore_eos: none end a row (a
                request's own `ignore_eos` does this for its rows).
            tokenizer: decodes each result's `text` and finds stop strings (needed for those).
            on_tokens: called as `on_tokens(row, new_ids)` after each device call, for
                streaming (a smaller `steps_per_call` streams more smoothly).
            on_result: called as `on_result(row, result)` as soon as a row is done (static batches:
                at the end of its batch, in input order; continuous: in the order they finish,
                without the `calls` counters, which cover the whole call), so a caller can write
                each result before the others finish.

        Returns:
            One `Result` per row, in input order: a prompt with n samples gives n consecutive
            results (`row` in `on_tokens` counts the same way).

        Raises:
            config.InputError: naming the first bad prompt, token id, budget or setting.
        """
        began = time.perf_counter()
        eos = inputs.eos_ids(() if ignore_eos else (self.model_config.eos_token_ids if eos_ids is None else eos_ids))
        continuous = self.config.scheduler == "continuous"
        if not continuous and not isinstance(max_new_tokens, (int, np.integer)):
            raise config_lib.InputError("per-prompt max_new_tokens needs scheduler='continuous'")
        budgets = inputs.budgets(max_new_tokens, len(prompts))
        prompts = inputs.check_prompts(prompts, budgets, self.model_config.vocab_size, self.max_length, self.config)
        settings = inputs.samplings(sampling, len(prompts), self.model_config.vocab_size, tokenizer)
        mode = self.config.mode_for(settings)
        # The rows: each prompt once per sample, its samples next to each other.
        rows = [(index, sample) for index, setting in enumerate(settings) for sample in range(setting.n)]
        row_prompts = [prompts[index] for index, _ in rows]
        row_settings = [settings[index] for index, _ in rows]
        if continuous:
            programs = self.compiler.slot_programs(mode)
            return scheduler_lib.generate(programs, row_prompts, [budgets[index] for index, _ in rows],
                                          jax.random.key(seed), on_tokens, began, self.config.resolved_refill_at,
                                          row_settings, [sample for _, sample in rows], eos, tokenizer, on_result)
        opts = self.options(sampling_mode=mode, max_new_tokens=int(max_new_tokens))
        results, rng, size = [], jax.random.key(seed), self.config.batch_size
        for first in range(0, len(rows), size):
            rng, batch_rng = jax.random.split(rng)
            batch = row_prompts[first:first + size]
            batch_settings = row_settings[first:first + size]
            seeds = [setting.sample_seed(sample) for setting, (_, sample) in zip(batch_settings, rows[first:first + size])]
            pad = size - len(batch)  # idle rows: neutral settings
            params = sampling_lib.SamplingParams.stack(batch_settings + [sampling_lib.Sampling()] * pad, mode, eos,
                                                       sampling_lib.STOP_WIDTH, seeds + [None] * pad)
            emit = None if on_tokens is None else (lambda row, ids, first=first: on_tokens(first + row, ids))
            cache_length = self.max_length if self.config.fixed_shapes else inputs.bucket_length(
                max(len(p) for p in batch) + opts.max_new_tokens + self.headroom, self.max_length)
            programs = self.compiler.batch_programs(batch, batch_rng, opts.replace(cache_length=cache_length),
                                                    params=params)
            row_outputs = [outputs_lib.RowOutput(setting, setting.stop_ids(eos), tokenizer) for setting in batch_settings]
            results += static_batch.generate_static(programs, row_outputs, emit, began)
            if on_result is not None:
                for row in range(first, len(results)):
                    on_result(row, results[row])
        return results

    def slot_programs(self, sampling_mode: sampling_lib.SamplingMode = sampling_lib.SamplingMode(),
                      steps_per_call: int | None = None) -> programs_lib.SlotPrograms:
        """The continuous scheduler's programs for this sampling mode, compiled once (`Compiler.slot_programs`)."""
        return self.compiler.slot_programs(sampling_mode, steps_per_call)

    def batch_programs(self, prompts: Sequence[np.ndarray], rng: jax.Array, opts: state_lib.Options,
                       steps_per_call: int | None = None,
                       params: sampling_lib.SamplingParams | None = None) -> programs_lib.BatchPrograms:
        """One static batch's programs, compiled once (`Compiler.batch_programs`); profiling runs them."""
        return self.compiler.batch_programs(prompts, rng, opts, steps_per_call, params)
