"""What `python -m eagle_jax.serve` builds from its flags: the engine and the model id it serves.

A module of its own, not `__main__`, so that the engine process (`engine_process`, started by
`multiprocessing`'s spawn) can import `build` by name.
"""

from __future__ import annotations

import os
import sys


def served_name(args) -> str:
    """The model id clients send."""
    return args.served_model_name or (os.path.basename(os.path.normpath(args.model)) if args.model
                                      else "SmolLM2-135M-Instruct")


def build(args):
    """(OnlineEngine, the tokenizer's directory), with everything loaded but nothing compiled yet."""
    import jax

    from eagle_jax import heads
    from eagle_jax.decode import sampling as sampling_lib
    from eagle_jax.io import models, tokenization
    from eagle_jax.serve import compile_cache, online
    from eagle_jax.serve import config as config_lib
    from eagle_jax.serve import engine as engine_lib
    from eagle_jax.serve import inputs

    defaults = sampling_lib.Sampling(temperature=args.temperature, top_p=args.top_p)
    if not 0 <= args.max_logprobs <= sampling_lib.MAX_LOGPROBS:
        raise ValueError(f"--max-logprobs must be in 0..{sampling_lib.MAX_LOGPROBS}, got {args.max_logprobs}")
    if args.greedy_only and not defaults.greedy:
        raise ValueError("--greedy-only serves temperature 0 only: leave --temperature out")
    target, tokenizer_dir = models.load_target(args.model, args.dtype)
    # One fixed mode, compiled before /health says ready: every processor (top-k up to the whole
    # vocabulary, since top-p sorts it anyway), or none.
    mode = sampling_lib.SamplingMode() if args.greedy_only else sampling_lib.SamplingMode(
        sample=True, penalties=True, min_p=True, top_k=target.config.vocab_size, top_p=True,
        logprobs=args.max_logprobs, min_tokens=True)
    platform = "gpu" if jax.default_backend() == "gpu" else "cpu"
    draft, method, k, note = heads.draft_plan(args.model, args.draft, args.method, args.num_speculative_tokens,
                                              platform, args.batch_size)
    if note:
        print(f"eagle_jax: {note}", file=sys.stderr)
    by_rows = ()
    if draft and args.num_speculative_tokens is None:  # the measured best k for each load, on one state
        by_rows = heads.k_by_batch_size(method, platform, args.batch_size)
        by_rows, k = (by_rows, max(pair[1] for pair in by_rows)) if len(by_rows) > 1 else ((), k)
    head = models.load_head(draft, target, args.dtype) if draft else None
    config = config_lib.EngineConfig(
        num_speculative_tokens=k, max_length=args.max_length, batch_size=args.batch_size, scheduler="continuous",
        speculative_disable_by_batch_size=args.speculative_disable_by_batch_size, speculative_tokens_by_rows=by_rows,
        decode_kernels=args.decode_kernels, steps_per_call=args.steps_per_call, sampling_mode=mode,
        cache_dir=str(args.cache_dir or compile_cache.default_root()))
    if by_rows:  # a run call drafts by its row bucket: the fewest rows that hold the running requests
        buckets = inputs.row_buckets(args.batch_size)
        spans = []
        for low, rows in zip((1,) + tuple(bucket + 1 for bucket in buckets), buckets):
            spans.append(f"{low if low == rows else f'{low}-{rows}'}: {config.k_for_rows(rows)}")
        print(f"eagle_jax: drafts a step by running requests: {', '.join(spans)} (the measured best k; "
              "--num-speculative-tokens fixes one)", file=sys.stderr)
    engine = engine_lib.Engine(target, head, config)
    backend = online.OnlineEngine(engine, tokenization.load(tokenizer_dir), served_name(args), defaults,
                                  args.max_queue, args.seed)
    return backend, tokenizer_dir
