"""Where an EAGLE training step's time goes: throughput and a `jax.profiler` trace of a few steps.

    python benchmarks/profile_train.py --method eagle3 --batch-size 64 --sequence-length 640 --steps 5

The head trained at ~57 k trained tokens/s on an H200 on 2026-11-30 (commit b4c89e9,
`python -m eagle_jax.train --method eagle3 --batch-size 64`), ~225 ms for a
64 x 640 EAGLE-3 step whose arithmetic should take well under 100 ms. This script times
`--timed-steps` untraced steps, then traces `--steps` more and summarises the kernels with
`step_trace.summarize` (kernels and busy time per step, the heaviest kernels and kinds). The
batches are random tokens with half the positions in the loss: the step's cost does not depend
on the data. One row (`kind: "train_trace"`) is appended to `--out`.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
import tempfile
import time
from pathlib import Path

try:
    import eagle_jax  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import numpy as np

from eagle_jax.cli import errors as script_errors
import step_trace
from eagle_jax.io import models
from eagle_jax.train import trainer as train
from eagle_jax.train import objective as train_objective
from results_file import append_rows


def random_batch(rng: np.random.Generator, batch_size: int, length: int, vocab_size: int):
    tokens = rng.integers(0, vocab_size, (batch_size, length), dtype=np.int32)
    return tokens, rng.random((batch_size, length)) < 0.5


def profile(trainer: train.Trainer, vocab_size: int, batch_size: int, length: int, timed_steps: int,
            traced_steps: int, device: str = "auto") -> dict:
    """Times untraced steps, then traces more; returns throughput and the trace summary."""
    rng = np.random.default_rng(0)
    batches = [random_batch(rng, batch_size, length, vocab_size) for _ in range(2)]
    jax.block_until_ready(trainer.train_step(*batches[0]))  # compile
    began = time.perf_counter()
    for step in range(timed_steps):
        metrics = trainer.train_step(*batches[step % 2])
    jax.block_until_ready(metrics)
    step_seconds = (time.perf_counter() - began) / timed_steps
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            for step in range(traced_steps):
                metrics = trainer.train_step(*batches[step % 2])
            jax.block_until_ready(metrics)
        summary = step_trace.summarize(step_trace.load_trace(step_trace.find_trace_file(log_dir)), traced_steps,
                                       device)
    return dict(step_ms=round(step_seconds * 1e3, 2),
                trained_tokens_per_second=round(float(np.mean([m.sum() for _, m in batches])) / step_seconds, 1),
                **summary)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=["eagle", "eagle3"], default="eagle3")
    parser.add_argument("--model", help="target (default SmolLM2-135M-Instruct)")
    parser.add_argument("--random-target", metavar="CONFIG_JSON",
                        help="a randomly initialised target of this HF config.json (no weights to load)")
    parser.add_argument("--dtype", choices=sorted(models.DTYPES), default="bfloat16")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--sequence-length", type=int, default=640)
    parser.add_argument("--unroll", type=int, help="training-time-test steps (default: 1 eagle, 7 eagle3)")
    parser.add_argument("--draft-vocab-size", type=int, default=8192)
    parser.add_argument("--attention", choices=["xla", "cudnn"], default="xla", help="train step attention")
    parser.add_argument("--timed-steps", type=int, default=10)
    parser.add_argument("--steps", type=int, default=5, help="traced steps")
    parser.add_argument("--trace-device", choices=step_trace.DEVICES, default="auto")
    parser.add_argument("--label", help="free text saved in the row (e.g. the lever tried)")
    parser.add_argument("--out", default="docs/results/profile_h200.json")
    args = parser.parse_args(argv)
    target, _ = models.target_or_random(args.model, args.random_target, args.dtype)
    unroll = args.unroll or (1 if args.method == "eagle" else 7)
    cfg = train.TrainConfig(method=args.method, batch_size=args.batch_size, draft_vocab_size=args.draft_vocab_size,
                            objective=train_objective.Objective(num_steps=unroll, attention=args.attention))
    counts = np.ones((target.config.vocab_size,), np.int64)  # any draft vocabulary costs the same
    head = train.new_head(target.config, cfg, counts, dtype=target.embed_tokens.embedding[...].dtype)
    measured = profile(train.Trainer(target, head, cfg), target.config.vocab_size, args.batch_size, args.sequence_length, args.timed_steps,
                       args.steps, args.trace_device)
    device = jax.devices()[0]
    row = dict(kind="train_trace", method=args.method, unroll=unroll, batch_size=args.batch_size,
               sequence_length=args.sequence_length, draft_vocab_size=args.draft_vocab_size, dtype=args.dtype,
               attention=args.attention, random_target=args.random_target,
               label=args.label, **measured, device=device.device_kind, platform=device.platform,
               jax_version=jax.__version__, command="python " + shlex.join(sys.argv),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    append_rows(args.out, [{key: value for key, value in row.items() if value is not None}])
    print(f"{args.method} ({args.attention}) unroll {unroll}, {args.batch_size} x {args.sequence_length}: {row['step_ms']} ms a step, "
          f"{row['trained_tokens_per_second']:.0f} trained tokens/s; {row['kernels_per_step']:.0f} kernels, "
          f"busy {row['busy_us_per_step'] / 1e3:.1f} ms a step")
    for kind in row["top_kinds"][:8]:
        print(f"  {kind}")
    return 0


if __name__ == "__main__":
    sys.exit(script_errors.run(main))
