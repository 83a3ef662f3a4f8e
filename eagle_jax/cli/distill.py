"""`eagle-jax-distill`: the target answers the training prompts itself (self-distillation).

    eagle-jax-distill --prompts prompts.jsonl --out data.npz
    eagle-jax-distill --turns turns.npz --rounds 3 --temperatures 0,0.8,1.0 --out distilled/

`--prompts` writes one npz of prompt + answer rows, the loss on the answer; `--turns` (from
`eagle-jax-prepare-data --distill-turns-out`) writes one part per user turn and temperature
into a directory, each kept as soon as it is done, so a rerun resumes (`eagle_jax.train.distill`).
`eagle-jax-train --data` reads either.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from eagle_jax.cli import errors
from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.io import models
from eagle_jax.io import tokenization
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib
from eagle_jax.train import data as data_lib
from eagle_jax.train import distill as distill_lib


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle-jax-distill", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="target (default SmolLM2-135M-Instruct)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts", help="JSONL with a 'prompt' field (eagle-jax-prepare-data "
                                          "--distill-prompts-out), or an npz of chat-templated ids "
                                          "(`eagle_jax.train.distill.tokenize_prompts`)")
    source.add_argument("--turns", help="npz of conversation turns (eagle-jax-prepare-data --distill-turns-out): "
                                        "every round and temperature, one part file each")
    parser.add_argument("--out", required=True, help="npz (--prompts) or a directory of parts (--turns)")
    parser.add_argument("--limit", type=int)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="with --prompts")
    parser.add_argument("--temperatures", default="0", help="with --turns: comma list, greedy (0) first")
    parser.add_argument("--rounds", type=int, default=1, help="with --turns: user turns per conversation")
    parser.add_argument("--max-seconds", type=float, help="with --turns: start no new part after this long")
    parser.add_argument("--seed", type=int, default=0,
                        help="sampling seed: another seed answers the same prompts anew (parts named -s<seed>)")
    parser.add_argument("--dtype", choices=sorted(models.DTYPES), default="bfloat16")
    return parser


def distill_prompts(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    began = time.time()
    target, tokenizer_dir = models.load_target(args.model, args.dtype)
    tokenizer = tokenization.load(tokenizer_dir)
    pad_id = tokenizer.pad_token_id or 0
    sequence_length = args.max_prompt_tokens + args.max_new_tokens
    # One prefill width (max_length // 2) and one cache length: two compiled programs in all.
    max_length = max(2 * args.max_prompt_tokens, sequence_length + 1)
    engine = engine_lib.Engine(target, None, config_lib.EngineConfig(batch_size=args.batch_size, max_length=max_length,
                                                                    fixed_shapes=True))
    if args.turns:
        if not target.config.eos_token_ids:
            parser.error("--turns needs a target with an end-of-turn (eos) token to close answers")
        with np.load(args.turns) as packed:
            conversations = distill_lib.unpack_turns(dict(packed))[:args.limit]
        conversations = [turns for turns in conversations if len(turns[0]) <= args.max_prompt_tokens]
        temperatures = [float(t) for t in args.temperatures.split(",")]
        deadline = began + args.max_seconds if args.max_seconds else float("inf")
        parts = distill_lib.distill_conversations(engine, conversations, temperatures, args.rounds,
                                                  args.max_prompt_tokens, args.max_new_tokens, pad_id,
                                                  target.config.eos_token_ids[0], Path(args.out), deadline,
                                                  seed=args.seed)
        # These parts only: the directory may hold others (another temperature's run, parts copied
        # in from elsewhere), which would be counted as if this run had written them.
        masks = [data_lib.load_dataset(part)["loss_mask"] for part in parts]
        print(f"{len(parts)} parts, {sum(len(mask) for mask in masks)} sequences, "
              f"{sum(int(mask.sum()) for mask in masks)} generated tokens in {args.out} ({time.time() - began:.0f} s)",
              file=sys.stderr)
        return 0
    if args.prompts.endswith(".npz"):
        packed = data_lib.load_dataset(args.prompts, vocab_size=target.config.vocab_size)
        prompts = [row[:length] for row, length in zip(packed["input_ids"], packed["lengths"])][:args.limit]
    else:
        lines = Path(args.prompts).read_text().splitlines()[:args.limit]
        prompts = distill_lib.tokenize_prompts(tokenizer, [json.loads(line)["prompt"] for line in lines])
    prompts = [p for p in prompts if len(p) <= args.max_prompt_tokens]
    arrays = distill_lib.distill(engine, prompts, args.max_new_tokens, sequence_length, pad_id=pad_id,
                                 sampling=sampling_lib.Sampling(temperature=args.temperature), seed=args.seed)
    data_lib.save_dataset(arrays, args.out)
    print(f"{len(arrays['input_ids'])} sequences, {int(arrays['loss_mask'].sum())} generated tokens -> {args.out}",
          file=sys.stderr)
    return 0


def main(argv=None) -> int:
    """Runs the command line; a user error is one `error:` line and status 2 (`errors.run`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return errors.run(lambda: distill_prompts(parser, args))


if __name__ == "__main__":
    sys.exit(main())
