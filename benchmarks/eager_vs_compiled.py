"""Eager vs compiled, token by token: do the two modes decode the same text?

The seed's check compares acceptance lengths of eager (op by op) and compiled runs on a few
prompts. Acceptance is only comparable when both score the head on the same text, so this script
decodes the first MT-Bench turns plainly and with the head, in both modes and each dtype, and
prints each run's acceptance length and whether its tokens equal compiled plain decoding's and
plain decoding's in the same mode:

    python benchmarks/eager_vs_compiled.py --draft eagle_jax/heads/smollm2-135m-instruct-eagle3 \\
        --dtypes bfloat16,float32 --num_prompts 2 --max_new_tokens 32 --k 3

In float32 every run should decode the same tokens. In bf16 two things round differently: op by op
every op's output is rounded to bf16 where XLA's fusions keep float32 inside a kernel, and a
verify of k + 1 tokens sums in another order than a one-token step, so greedy texts may part.
"""

from __future__ import annotations

import argparse

from eagle_jax.train import data
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib
from eagle_jax.serve import result as result_lib
from eagle_jax import heads
from eagle_jax.io import models
from eagle_jax.io import tokenization


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token, or None when the sequences are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(runs: list[list[int]], references: list[list[int]]) -> str:
    """Per prompt: "yes", or where the run first leaves the reference."""
    return ", ".join("yes" if first_difference(run, ref) is None else f"no (token {first_difference(run, ref)})"
                     for run, ref in zip(runs, references))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="target (default: the default model)")
    parser.add_argument("--draft", help="EAGLE head directory (default: the shipped EAGLE-3 head)")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--num_prompts", type=int, default=2)
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--k", type=int, default=3)
    args = parser.parse_args(argv)
    questions = data.load_mtbench()[:args.num_prompts]
    print(f"{'dtype':<9} {'method':<7} {'mode':<9} {'accept len':>10} {'drafts':>6}  "
          "tokens equal: compiled plain | plain decoding of the same mode")
    for dtype in args.dtypes.split(","):
        target, tokenizer_dir = models.load_target(args.model, dtype)
        tokenizer = tokenization.load(tokenizer_dir)
        prompts = [tokenization.encode(tokenizer, q["turns"][0], chat=True) for q in questions]
        head = models.load_head(args.draft or heads.shipped_head("eagle3"), target, dtype)
        plain = {}  # mode -> plain decoding's tokens (plain runs first)
        for method, k in (("none", 0), (head.config.method, args.k)):
            for mode in ("compiled", "eager"):
                engine = engine_lib.Engine(target, head if k else None, config_lib.EngineConfig(
                    max_length=512, batch_size=1, eager=mode == "eager", num_speculative_tokens=k, fixed_shapes=True))
                results = [engine.generate([p], max_new_tokens=args.max_new_tokens)[0] for p in prompts]
                tokens = [list(map(int, r.token_ids)) for r in results]
                plain.setdefault(mode, tokens)
                stats = result_lib.pooled_stats(results, k)
                print(f"{dtype:<9} {method:<7} {mode:<9} {stats['acceptance_length']:>10.4f} {stats['num_drafts']:>6}  "
                      f"{agreement(tokens, plain['compiled'])} | {agreement(tokens, plain[mode])}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
