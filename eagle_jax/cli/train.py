"""`eagle-jax-train` (or `python -m eagle_jax.train`): trains an EAGLE head on a target.

Reads training rows (`eagle-jax-prepare-data`, `eagle-jax-distill`), trains a new head or
continues an exported one (`--init-head`), resumes from the checkpoints in `--output`, exports
the head in the public HF layout to `--output/head` and evaluates it on MT-Bench. A problem the
user can fix (bad data, a diverged run, a damaged checkpoint) is one `error:` line, status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import jax
import numpy as np

from eagle_jax.cli import errors
from eagle_jax.io import models
from eagle_jax.io import tokenization
from eagle_jax.model import eagle
from eagle_jax.train import data as data_lib
from eagle_jax.train import draft_vocabulary
from eagle_jax.train import head_growth
from eagle_jax.train import objective as train_objective
from eagle_jax.train import trainer as trainer_lib


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle-jax-train", description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=["eagle", "eagle3"], default="eagle3")
    parser.add_argument("--model", help="target (HF dir, converted dir or .gguf; default SmolLM2-135M-Instruct)")
    parser.add_argument("--data", required=True, help="npz from eagle-jax-prepare-data or eagle-jax-distill, "
                                                      "or a directory of such parts")
    parser.add_argument("--output", required=True, help="run directory: checkpoints/, head/, metrics.json")
    parser.add_argument("--dtype", choices=sorted(models.DTYPES), default="bfloat16")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--learning-rate", type=float, default=5e-4)
    parser.add_argument("--warmup-steps", type=int, default=100)
    parser.add_argument("--unroll", type=int, help="training-time-test steps (default: 1 eagle, 7 eagle3)")
    parser.add_argument("--draft-vocab-size", type=int,
                        help="EAGLE-3 draft vocabulary (default: an --init-head's, else 8192); larger than an "
                             "--init-head's, that head's is extended with the most frequent other tokens "
                             "(`extend_draft_vocabulary`)")
    parser.add_argument("--attention", choices=["auto", "xla", "cudnn"], default="auto",
                        help="attention of the train step: XLA einsums, or cuDNN's fused kernel (GPU, bf16/fp16; "
                             "1.7x faster steps on an H200); auto picks cuDNN where it runs")
    parser.add_argument("--train-tokens", type=int,
                        help="train on random whole rows holding this many generated tokens (data-scaling runs)")
    parser.add_argument("--head-intermediate-size", type=int,
                        help="MLP width of a new head (default: the target's); a wider head costs little at "
                             "inference, where the head's step is a small part of a speculative step. With "
                             "--init-head, that head's MLP is widened to it (`widen_mlp`)")
    parser.add_argument("--head-layers", type=int,
                        help="EAGLE-3: decoder layers of a new head (default 1); more than an --init-head's, "
                             "layers that start as the identity are added to it (`add_layers`)")
    parser.add_argument("--init-head", help="start from this exported head (public layout) instead of random "
                                            "weights; a fresh optimiser and schedule (ignored when resuming)")
    parser.add_argument("--max-seconds", type=float, help="stop (and checkpoint) after this much training time")
    parser.add_argument("--eval-prompts", type=int, default=80, help="MT-Bench first turns for the final check")
    parser.add_argument("--eval-k", type=int, default=5)
    parser.add_argument("--eval-max-new-tokens", type=int, default=256)
    return parser


def initial_head(parser: argparse.ArgumentParser, args: argparse.Namespace, target, dataset: dict[str, np.ndarray]):
    """`--init-head` loaded and grown to the requested vocabulary, width and depth, and the draft
    vocabulary size to train at; (None, that size) for a new head."""
    draft_vocab_size = args.draft_vocab_size or trainer_lib.TrainConfig.draft_vocab_size
    if not args.init_head:
        return None, draft_vocab_size
    head = models.load_head(args.init_head, target, args.dtype, param_dtype="float32")
    kind = "eagle3" if isinstance(head, eagle.Eagle3Head) else "eagle"
    if kind != args.method:
        parser.error(f"--init-head {args.init_head} is an {kind} head, not {args.method}")
    if kind == "eagle3":  # by default the head keeps its vocabulary
        draft_vocab_size = args.draft_vocab_size or head.config.draft_vocab_size
    if kind == "eagle3" and head.config.draft_vocab_size > draft_vocab_size:
        parser.error(f"--init-head {args.init_head} has a {head.config.draft_vocab_size}-token draft vocabulary, "
                     f"more than --draft-vocab-size {draft_vocab_size} (a vocabulary extends, never shrinks)")
    width = head.config.layer.intermediate_size
    if args.head_intermediate_size and args.head_intermediate_size < width:
        parser.error(f"--init-head {args.init_head} has an MLP {width} wide, more than --head-intermediate-size "
                     f"{args.head_intermediate_size} (a head widens, never narrows)")
    if args.head_intermediate_size and args.head_intermediate_size > width:
        head = head_growth.widen_mlp(head, args.head_intermediate_size)
    if args.head_layers and args.head_layers < head.config.num_layers:
        parser.error(f"--init-head {args.init_head} has {head.config.num_layers} layers, more than --head-layers "
                     f"{args.head_layers} (a head deepens, never loses layers)")
    if args.head_layers and args.head_layers > head.config.num_layers:
        head = head_growth.add_layers(head, args.head_layers)
    if kind == "eagle3" and head.config.draft_vocab_size < draft_vocab_size:
        counts = draft_vocabulary.token_counts(dataset, target.config.vocab_size)
        head = draft_vocabulary.extend_draft_vocabulary(head, counts, draft_vocab_size,
                                                        np.asarray(target.output_embedding()))
    return head, draft_vocab_size


def train_head(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.head_layers is not None and (args.head_layers < 1 or (args.method == "eagle" and args.head_layers != 1)):
        parser.error(f"--head-layers {args.head_layers}: an EAGLE-3 head has 1 or more layers, an EAGLE-1 head one")
    if not (math.isfinite(args.learning_rate) and args.learning_rate > 0):
        parser.error(f"--learning-rate {args.learning_rate}: a learning rate is a positive finite number")
    # Read before training, so a missing MT-Bench file fails at once rather than after the run.
    questions = data_lib.load_mtbench()[:args.eval_prompts] if args.eval_prompts else []

    target, tokenizer_dir = models.load_target(args.model, args.dtype)
    dataset = data_lib.load_dataset(args.data, vocab_size=target.config.vocab_size)
    if args.train_tokens:
        dataset = data_lib.subset_by_tokens(dataset, args.train_tokens)
    output = Path(args.output)
    head, draft_vocab_size = initial_head(parser, args, target, dataset)
    unroll = args.unroll or (1 if args.method == "eagle" else 7)
    attention = trainer_lib.attention_implementation(args.attention, args.dtype)
    cfg = trainer_lib.TrainConfig(method=args.method, steps=args.steps, batch_size=args.batch_size,
                                  learning_rate=args.learning_rate, warmup_steps=args.warmup_steps,
                                  draft_vocab_size=draft_vocab_size, head_intermediate_size=args.head_intermediate_size,
                                  head_layers=args.head_layers or 1,
                                  objective=train_objective.Objective(num_steps=unroll, attention=attention))
    began = time.perf_counter()
    trainer, log = trainer_lib.train(target, dataset, cfg, output, head=head, max_seconds=args.max_seconds)
    seconds = time.perf_counter() - began
    head = trainer.checked_head()  # never export a non-finite head
    models.export_head(head, target.config, output / "head")
    summary = dict(method=args.method, steps=trainer.step, train_seconds=seconds, final=log[-1] if log else None,
                   device=jax.devices()[0].device_kind, jax_version=jax.__version__, config=repr(cfg),
                   num_sequences=len(dataset["input_ids"]), sequence_length=int(dataset["input_ids"].shape[1]),
                   num_trained_tokens=int(dataset["loss_mask"].sum()))
    if args.method == "eagle3":  # how much of the trained text the draft vocabulary can express
        counts = draft_vocabulary.token_counts(dataset, target.config.vocab_size)
        chosen = np.arange(cfg.draft_vocab_size) + np.asarray(head.d2t[...])  # the head's own (an extended one's too)
        summary["draft_vocab_coverage"] = float(counts[chosen].sum() / counts.sum())
    if args.eval_prompts:
        tokenizer = tokenization.load(tokenizer_dir)
        prompts = [np.asarray(tokenization.encode(tokenizer, q["turns"][0], chat=True)) for q in questions]
        exported = models.load_head(output / "head", target, args.dtype)
        summary["eval"] = trainer_lib.acceptance_length(target, exported, prompts, args.eval_k,
                                                        args.eval_max_new_tokens)
        print(f"MT-Bench acceptance length at k={args.eval_k}: {summary['eval']['acceptance_length']:.3f}")
    (output / "metrics.json").write_text(json.dumps(dict(summary, log=log), indent=2))
    return 0


def main(argv=None) -> int:
    """Runs the command line; a user error is one `error:` line and status 2 (`errors.run`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    return errors.run(lambda: train_head(parser, args))


if __name__ == "__main__":
    sys.exit(main())
