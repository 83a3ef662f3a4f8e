"""Self-distillation data: the target answers the training prompts itself.

An EAGLE head is asked to predict the target's own continuations, so training on the target's
answers (rather than ShareGPT's GPT-3.5 answers) matches what it will see at inference.
`python -m eagle_jax.distill --prompts prompts.jsonl --out data.npz` writes the same arrays as
`data.build_dataset` (input_ids, loss_mask on the generated tokens, lengths).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import tqdm

from eagle_jax import data as data_lib
from eagle_jax import engine as engine_lib
from eagle_jax import sampling as sampling_lib
from eagle_jax import tokenization


def distill(engine: engine_lib.Engine, prompts: list[np.ndarray], max_new_tokens: int, sequence_length: int,
            pad_id: int, sampling: sampling_lib.Sampling = sampling_lib.Sampling(), chunk: int | None = None,
            progress: bool = True) -> dict[str, np.ndarray]:
    """Generates an answer per prompt and packs prompt + answer rows, the loss on the answer.

    Prompts are processed shortest first so each batch pads little.
    """
    order = np.argsort([len(p) for p in prompts], kind="stable")
    chunk = chunk or engine.batch_size * 8
    rows = len(prompts)
    input_ids = np.full((rows, sequence_length), pad_id, np.int32)
    loss_mask = np.zeros((rows, sequence_length), bool)
    lengths = np.zeros((rows,), np.int32)
    bar = tqdm.tqdm(total=rows, desc="distill", unit="prompt", disable=not progress)
    for first in range(0, rows, chunk):
        indices = order[first:first + chunk]
        results = engine.generate([prompts[i] for i in indices], max_new_tokens=max_new_tokens, sampling=sampling,
                                  seed=first)
        for index, result in zip(indices, results):
            sequence = np.concatenate([prompts[index], np.asarray(result.token_ids, np.int32)])[:sequence_length]
            input_ids[index, :len(sequence)] = sequence
            loss_mask[index, len(prompts[index]):len(sequence)] = True
            lengths[index] = len(sequence)
        bar.update(len(indices))
        bar.set_postfix(tokens_per_second=f"{sum(r.num_tokens for r in results) / results[0].seconds:.0f}")
    bar.close()
    keep = loss_mask.any(axis=1)
    return {"input_ids": input_ids[keep], "loss_mask": loss_mask[keep], "lengths": lengths[keep]}


def tokenize_prompts(tokenizer, texts: list[str]) -> list[np.ndarray]:
    """Chat-templated int32 ids of single-turn user prompts."""
    return [np.asarray(tokenization.encode(tokenizer, text, chat=True), np.int32) for text in texts]


def pack_prompts(prompts: list[np.ndarray], pad_id: int = 0) -> dict[str, np.ndarray]:
    """Prompts as padded rows + lengths, the layout `data.save_dataset` stores compactly."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = prompt
    return {"input_ids": ids, "loss_mask": ids >= 0, "lengths": np.asarray([len(p) for p in prompts], np.int32)}


def main(argv=None) -> int:
    from eagle_jax import models

    parser = argparse.ArgumentParser(prog="python -m eagle_jax.distill", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="target (default SmolLM2-135M-Instruct)")
    parser.add_argument("--prompts", required=True, help="JSONL with a 'prompt' field (examples/prepare_data.py), "
                                                         "or an npz of chat-templated ids from `tokenize_prompts`")
    parser.add_argument("--out", required=True)
    parser.add_argument("--limit", type=int)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", choices=sorted(models.DTYPES), default="bfloat16")
    args = parser.parse_args(argv)
    target, tokenizer_dir = models.load_target(args.model, args.dtype)
    tokenizer = tokenization.load(tokenizer_dir)
    if args.prompts.endswith(".npz"):
        packed = data_lib.load_dataset(args.prompts)
        prompts = [row[:length] for row, length in zip(packed["input_ids"], packed["lengths"])][:args.limit]
    else:
        lines = Path(args.prompts).read_text().splitlines()[:args.limit]
        prompts = tokenize_prompts(tokenizer, [json.loads(line)["prompt"] for line in lines])
    prompts = [p for p in prompts if len(p) <= args.max_prompt_tokens]
    sequence_length = args.max_prompt_tokens + args.max_new_tokens
    engine = engine_lib.Engine(target, batch_size=args.batch_size, max_length=sequence_length + 1)
    arrays = distill(engine, prompts, args.max_new_tokens, sequence_length, pad_id=tokenizer.pad_token_id or 0,
                     sampling=sampling_lib.Sampling(temperature=args.temperature))
    data_lib.save_dataset(arrays, args.out)
    print(f"{len(arrays['input_ids'])} sequences, {int(arrays['loss_mask'].sum())} generated tokens -> {args.out}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
