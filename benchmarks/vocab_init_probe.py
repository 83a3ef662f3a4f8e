"""Where should the columns of a draft-vocabulary extension start? An offline check, no training.

    python benchmarks/vocab_init_probe.py --head eagle_jax/heads/smollm2-135m-instruct-eagle3 \
        --smaller-head OLD_HEAD_DIR --data run/distill/round1-t0.npz --counts run/distill --out docs/results/cpu.json

`--head` is an EAGLE-3 head whose draft vocabulary extended `--smaller-head`'s (`train
--draft-vocab-size` with `--init-head`) and was trained on. Its lm_head columns of the added tokens
are replaced by each start `draft_vocabulary.extend_draft_vocabulary` could give them, the rest of the trained
head kept, and every variant drafts on --rows sequences of distilled tokens with the target's own
features (teacher-forced, 3 unrolled steps): the share of positions where the draft's top-1 token
is the target's (over the whole vocabulary). Variants: "trained" (the head as it is), "mean"
(added columns at the trained columns' mean), "embedding" (the least-squares placement from the
target's output embedding and the token counts, the one `extend_draft_vocabulary` uses), and the
smaller head itself; with --extend-to N,..., also --head extended by that rule to N tokens, untrained
(what a larger vocabulary would add before any training). Float32 on the CPU; one row per
variant appended to --out.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import sys
from pathlib import Path

try:
    import eagle_jax  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from eagle_jax.train import data as data_lib
from eagle_jax.io import models
from eagle_jax.train import draft_vocabulary
from eagle_jax.train import objective as train_objective
from eagle_jax.cli import errors as script_errors
from results_file import append_rows


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", help="target (default: the default model)")
    parser.add_argument("--head", required=True, help="the extended, trained EAGLE-3 head")
    parser.add_argument("--smaller-head", required=True, help="the head it was extended from")
    parser.add_argument("--data", required=True, help="distilled tokens (.npz part or folder) to draft on")
    parser.add_argument("--counts", required=True, help="distilled tokens (part or folder) to count tokens in")
    parser.add_argument("--rows", type=int, default=6, help="sequences drafted on (random, seed 0)")
    parser.add_argument("--extend-to", default="", help="comma list of larger draft vocabularies to try untrained")
    parser.add_argument("--out", default="docs/results/cpu.json")
    return parser.parse_args(argv)


def agreement(head, target, tokens: jax.Array, loss_mask: jax.Array, teacher: tuple, steps: int = 3) -> list[float]:
    """Per unrolled step, the share of the target's tokens whose top-1 the head drafts. `teacher`:
    the target's (captured features, logits) on `tokens`, computed once for every variant."""
    captured, logits = teacher
    n = tokens.shape[1] - 1
    shares = []
    for step, (_, draft_logits) in enumerate(train_objective.unrolled_head(
            head, target, tokens, head.project(captured[:, :n]), steps)):
        counted = np.asarray(train_objective._shift(loss_mask, 2 + step, n, fill=False))
        wanted = np.asarray(jnp.argmax(train_objective._shift(logits, 1 + step, n), -1))
        drafted = np.asarray(head.to_target_ids(jnp.argmax(draft_logits, -1)))
        shares.append(round(float((drafted == wanted)[counted].mean()), 4))
    return shares


def main(argv=None) -> int:
    args = parse_args(argv)
    target, _ = models.load_target(args.model, "float32")
    head = models.load_head(args.head, target, "float32")
    smaller = models.load_head(args.smaller_head, target, "float32")
    counts = draft_vocabulary.token_counts(data_lib.load_dataset(args.counts), target.config.vocab_size)
    dataset = data_lib.load_dataset(args.data)
    rows = np.random.default_rng(0).choice(len(dataset["input_ids"]), min(args.rows, len(dataset["input_ids"])),
                                           replace=False)
    tokens, loss_mask = jnp.asarray(dataset["input_ids"][rows], jnp.int32), jnp.asarray(dataset["loss_mask"][rows])
    embedding = np.asarray(target.output_embedding())
    # The smaller head extended again, by the rule under test, then given the trained head's other columns.
    placed = draft_vocabulary.extend_draft_vocabulary(smaller, counts, head.config.draft_vocab_size, embedding)
    if not np.array_equal(np.asarray(placed.d2t[...]), np.asarray(head.d2t[...])):
        raise SystemExit("error: --head's draft vocabulary is not --smaller-head's extended by these counts")
    # Extensions keep the head's feature layers, so every variant reads the same target outputs.
    _, captured, logits = train_objective.target_outputs(target, tokens, head.config.feature_layers)
    measure = lambda variant: agreement(variant, target, tokens, loss_mask, (captured, logits))
    ids = np.asarray(head.to_target_ids(jnp.arange(head.config.draft_vocab_size)))
    added = ~np.isin(ids, np.asarray(smaller.to_target_ids(jnp.arange(smaller.config.draft_vocab_size))))
    trained = np.asarray(head.lm_head.kernel[...])
    starts = {"trained": trained,
              "mean": np.where(added, trained[:, ~added].mean(1, keepdims=True), trained),
              "embedding": np.where(added, np.asarray(placed.lm_head.kernel[...]), trained)}
    common = dict(kind="vocab_init_probe", head=args.head, smaller_head=args.smaller_head, data=args.data,
                  rows=len(rows), added_tokens=int(added.sum()), device=jax.devices()[0].device_kind,
                  jax_version=jax.__version__, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command="python benchmarks/vocab_init_probe.py " + shlex.join(sys.argv[1:]))
    results = []
    for name, kernel in starts.items():
        head.lm_head.kernel[...] = jnp.asarray(kernel)
        results.append(dict(common, variant=name, top1_agreement_by_step=measure(head)))
    head.lm_head.kernel[...] = jnp.asarray(trained)
    for size in [int(size) for size in args.extend_to.split(",") if size.strip()]:
        extended = draft_vocabulary.extend_draft_vocabulary(head, counts, size, embedding)
        results.append(dict(common, variant=f"extended to {size}, untrained", top1_agreement_by_step=measure(extended)))
    results.append(dict(common, variant="smaller head", top1_agreement_by_step=measure(smaller)))
    for row in results:
        print(f"{row['variant']:>30}: top-1 agreement by unrolled step {row['top1_agreement_by_step']}")
    append_rows(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(script_errors.run(main))
