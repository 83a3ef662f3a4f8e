"""Greedy chain acceptance replayed offline from the target's own outputs, and what the draft vocabulary costs.

    python benchmarks/replay_acceptance.py --generate 80 --outputs mtbench_outputs.jsonl   # writes them first
    python benchmarks/replay_acceptance.py --outputs mtbench_outputs.jsonl --k 5 \
        --train-data run/distill --vocab-sizes 16384,32768 --out replay.json

`--outputs` is a JSONL of the target's greedy answers, one record per prompt with `prompt_ids`,
`output_ids` and `category`. `--generate N` first writes it for the first turns of N MT-Bench
questions, taken round robin over the categories, with plain greedy decoding (`engine.Engine`);
records already in the file are kept, and replayed too.

The target runs once over each prompt + answer, and the head (`--draft`, EAGLE-3 or EAGLE-1;
default the shipped EAGLE-3 head) is unrolled k steps from every position on the target's true
features: `train_objective.unrolled_head`, the training-time test, whose step j sees exactly what
the j-th draft step of a speculative decode sees while its chain is being accepted. Greedy
decoding is then replayed: from the first answer token, a step accepts the leading drafts that
equal the answer's next tokens and moves on by those plus one (the correction or bonus token).
The counts are the engine's (tests/test_replay_acceptance.py checks them against `engine.Engine`):
on MT-Bench the run-10 head replayed to 3.121 at k = 5 where the H200 measured 3.12.

Replaying is one forward per prompt instead of a decode, and the accept rule can be changed after
the fact. For an EAGLE-3 head it reports how much of the answers its draft vocabulary covers, the
share of rejections whose target token lies outside it, and the "full vocabulary upper bound":
the acceptance if every such token were drafted right. With `--train-data` (distilled .npz parts,
as `eagle_jax.train --data` reads them) and `--vocab-sizes`, the same upper bound for a draft
vocabulary of the N most frequent trained tokens (`draft_vocabulary.draft_vocabulary`): tokens it adds
drafted right, tokens it drops always missed, the rest as the head drafts them.
Float32; prints a summary and, with `--out`, writes it as a JSON object.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
from pathlib import Path

try:
    import eagle_jax  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
import tqdm
from flax import nnx

from eagle_jax.train import data as data_lib
from eagle_jax.model import eagle
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib
from eagle_jax.serve import inputs
from eagle_jax import heads
from eagle_jax.io import models
from eagle_jax.io import tokenization
from eagle_jax.train import draft_vocabulary as draft_vocabulary_lib
from eagle_jax.train import objective as train_objective
from eagle_jax.cli import errors as script_errors

PAD_TO = 128  # sequence widths are padded to a multiple of this: a few compiled shapes, little padding


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--outputs", required=True, help="JSONL of target greedy outputs (prompt_ids, output_ids, "
                                                         "category); written first with --generate")
    parser.add_argument("--generate", type=int, metavar="N",
                        help="first write the target's greedy answers to N MT-Bench first turns to --outputs")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="with --generate")
    parser.add_argument("--model", help="target (HF dir, converted dir or .gguf; default SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", help="EAGLE-1 or EAGLE-3 head directory (default: the shipped EAGLE-3 head)")
    parser.add_argument("--k", type=int, default=5, help="drafts per step (a chain)")
    parser.add_argument("--train-data", help="distilled .npz part or folder, for --vocab-sizes")
    parser.add_argument("--vocab-sizes", default="", help="comma list of top-N draft vocabularies to bound")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--out", help="write the summary here as JSON")
    args = parser.parse_args(argv)
    args.vocab_sizes = [int(size) for size in args.vocab_sizes.split(",") if size.strip()]
    if args.vocab_sizes and not args.train_data:
        parser.error("--vocab-sizes needs --train-data (the token counts that rank the vocabulary)")
    if args.k < 1:
        parser.error(f"--k must be >= 1, got {args.k}")
    return args


# ---- target outputs ---------------------------------------------------------------------------

def read_outputs(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def generate_outputs(target, tokenizer_dir: Path, path: Path, num_prompts: int, max_new_tokens: int,
                     batch_size: int) -> None:
    """Appends the target's greedy answers to MT-Bench first turns to `path`, skipping questions it holds."""
    by_category = collections.defaultdict(list)
    for question in data_lib.load_mtbench():
        by_category[question["category"]].append(question)
    # Round robin over the categories (the file is sorted by them), so a few prompts cover all eight.
    order = [questions[i] for i in range(max(map(len, by_category.values())))
             for questions in by_category.values() if i < len(questions)][:num_prompts]
    done = {record["question_id"] for record in read_outputs(path)} if path.exists() else set()
    todo = [question for question in order if question["question_id"] not in done]
    if not todo:
        return
    tokenizer = tokenization.load(tokenizer_dir)
    prompts = [tokenization.encode(tokenizer, question["turns"][0], chat=True) for question in todo]
    # One prefill width and cache length for every batch (headroom 1: plain decoding): two compiled programs.
    max_length = inputs.fixed_max_length(max(map(len, prompts)), max_new_tokens, 1,
                                         target.config.max_position_embeddings)
    engine = engine_lib.Engine(target, config=config_lib.EngineConfig(max_length=max_length, batch_size=batch_size,
                                                                      fixed_shapes=True))
    for start in tqdm.trange(0, len(todo), batch_size, desc="generating", unit="batch", file=sys.stderr):
        batch = slice(start, start + batch_size)
        results = engine.generate(prompts[batch], max_new_tokens=max_new_tokens)
        with path.open("a") as file:  # per batch: an interrupted run keeps what it finished
            for question, prompt, result in zip(todo[batch], prompts[batch], results):
                file.write(json.dumps(dict(question_id=question["question_id"], category=question["category"],
                                           prompt_ids=list(map(int, prompt)), output_ids=result.token_ids)) + "\n")


# ---- drafts: the head unrolled over the target's outputs --------------------------------------

@functools.partial(jax.jit, static_argnums=(0, 2, 5))
def _unrolled_drafts(target_def, target_state, head_def, head_state, tokens, k):
    """[B, T] tokens -> (target greedy ids [B, T], drafts [B, T - 1, k] in target ids from every base position)."""
    target, head = nnx.merge(target_def, target_state), nnx.merge(head_def, head_state)
    hidden, captured, logits = train_objective.target_outputs(target, tokens, eagle.capture_layers(head))
    n = tokens.shape[1] - 1
    features = eagle.target_features(head, hidden, captured)[:, :n]  # the stream the head reads at inference
    steps = train_objective.unrolled_head(head, target, tokens, features, k)
    drafts = [head.to_target_ids(jnp.argmax(step_logits, -1).astype(jnp.int32)) for _, step_logits in steps]
    return jnp.argmax(logits, -1).astype(jnp.int32), jnp.stack(drafts, -1)


def unrolled_drafts(target, head, records: list[dict], k: int, batch_size: int = 4):
    """Per record, the k drafts from each answer position, and how often the target's recomputed greedy
    token equals the recorded one.

    Returns:
        (drafts: per record an int array [G - 1, k], row r drafted after answer tokens 0..r were
        emitted and predicting answer tokens r+1..r+k; number of answer tokens whose recomputed
        greedy token agrees).
    """
    target_split, head_split = nnx.split(target), nnx.split(head)
    drafts, agreeing = [None] * len(records), 0
    order = sorted(range(len(records)), key=lambda i: len(records[i]["prompt_ids"]) + len(records[i]["output_ids"]))
    for start in tqdm.trange(0, len(order), batch_size, desc="replaying", unit="batch", file=sys.stderr):
        batch = order[start:start + batch_size]  # by length: records of one batch pad alike
        sequences = [records[i]["prompt_ids"] + records[i]["output_ids"] for i in batch]
        width = -(-max(map(len, sequences)) // PAD_TO) * PAD_TO
        tokens = np.zeros((batch_size, width), np.int32)  # right padding: causal positions never see it
        for row, sequence in enumerate(sequences):
            tokens[row, :len(sequence)] = sequence
        greedy, batch_drafts = map(np.asarray, _unrolled_drafts(*target_split, *head_split, jnp.asarray(tokens), k))
        for row, i in enumerate(batch):
            prompt_length, output = len(records[i]["prompt_ids"]), records[i]["output_ids"]
            # Base position i reads (t_{i+1}, f_i): the first answer token t_P pairs with f_{P-1}.
            drafts[i] = batch_drafts[row, prompt_length - 1:prompt_length + len(output) - 2]
            agreeing += int(np.sum(greedy[row, prompt_length - 1:prompt_length - 1 + len(output)] == output))
    return drafts, agreeing


# ---- the replay ---------------------------------------------------------------------------------

def wanted(output: np.ndarray, k: int) -> np.ndarray:
    """[G - 1, k]: row r holds answer tokens r+1..r+k, the ones its drafts predict; -1 past the end."""
    padded = np.concatenate([output, np.full(k, -1)])
    return np.stack([padded[1 + j:len(output) + j] for j in range(k)], -1)


def replay(hits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Greedy decoding over one answer: (base rows of its steps, drafts each step accepted).

    hits[r, j]: whether the draft from row r at depth j equals the answer token it predicts (False
    past the answer's end, so a step cut by EOS or the budget counts only the drafts it emitted).
    """
    bases, accepted, row = [], [], 0
    while row < len(hits):  # row r: answer tokens 0..r emitted, r + 1 is the next one to draft
        leading = int(np.cumprod(hits[row]).sum())
        bases.append(row)
        accepted.append(leading)
        row += leading + 1
    return np.asarray(bases, int), np.asarray(accepted, int)


def acceptance(replays: list, k: int) -> dict:
    """vLLM's pooled counters (as `engine.pooled_stats`) over `replay_all`'s replays."""
    accepted = np.concatenate([accepted for _, accepted, _ in replays] or [np.zeros(0, int)])
    return dict(acceptance_length=round(1 + float(accepted.mean()), 4) if accepted.size else 1.0,
                num_drafts=int(accepted.size), num_accepted_tokens=int(accepted.sum()),
                acceptance_rate_per_position=[round(float(np.mean(accepted > j)), 4) if accepted.size else 0.0
                                              for j in range(k)])


def replay_all(records: list[dict], drafts: list[np.ndarray], k: int, vocabulary: np.ndarray | None = None,
               draft_vocabulary: np.ndarray | None = None) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Replays every record; returns per record (bases, accepted, wanted) as `replay` and `wanted` give them.

    vocabulary (bool [V]): a hypothetical draft vocabulary. Its tokens the head cannot draft
    (outside `draft_vocabulary`) count as drafted right, tokens outside it as missed, the rest as
    drafted: an upper bound on what a head with that vocabulary accepts. None: the head as it is.
    """
    replays = []
    for record, record_drafts in zip(records, drafts):
        want = wanted(np.asarray(record["output_ids"]), k)
        hits = record_drafts == want
        if vocabulary is not None:
            token = np.maximum(want, 0)  # -1 (past the end) indexes harmlessly; it is no hit either way
            hits = np.where(draft_vocabulary[token], hits, True) & vocabulary[token] & (want >= 0)
        replays.append((*replay(hits), want))
    return replays


def summarise(records: list[dict], drafts: list[np.ndarray], k: int, draft_vocabulary: np.ndarray | None = None,
              train_counts: np.ndarray | None = None, vocab_sizes=()) -> dict:
    """Acceptance overall and by category, and with a draft vocabulary (bool [V], EAGLE-3) what it costs."""
    replays = replay_all(records, drafts, k)
    summary = dict(k=k, num_prompts=len(records), num_output_tokens=sum(len(r["output_ids"]) for r in records),
                   **acceptance(replays, k))
    categories = collections.defaultdict(list)
    for record, replayed in zip(records, replays):
        categories[record.get("category", "")].append(replayed)
    summary["by_category"] = {name: acceptance(group, k) for name, group in sorted(categories.items())}
    if draft_vocabulary is not None:
        summary["draft_vocabulary"] = vocabulary_costs(records, drafts, k, replays, draft_vocabulary, train_counts,
                                                       vocab_sizes)
    return summary


def vocabulary_costs(records, drafts, k, replays, draft_vocabulary, train_counts=None, vocab_sizes=()) -> dict:
    """The draft vocabulary's coverage of the outputs (and of the trained tokens), the share of
    rejections that wanted a token outside it, and acceptance upper bounds (`replay_all`) with the
    full vocabulary and with the `vocab_sizes` most frequent trained tokens."""
    outputs = np.concatenate([r["output_ids"] for r in records])
    covers = lambda vocabulary: round(float(vocabulary[outputs].mean()), 6)
    trained = lambda vocabulary: round(float(train_counts[vocabulary].sum() / train_counts.sum()), 6)
    base = acceptance(replays, k)["acceptance_length"]

    def bound(vocabulary):
        stats = acceptance(replay_all(records, drafts, k, vocabulary, draft_vocabulary), k)
        return dict(stats, gain=round(stats["acceptance_length"] - base, 4))

    # A rejection wanted the first answer token its step did not accept. A step that accepted all k
    # drafts, or all the answer had left, rejected nothing: -1 in the padded column, or past the end.
    rejected = np.concatenate([np.pad(want, ((0, 0), (0, 1)), constant_values=-1)[bases, accepted]
                               for bases, accepted, want in replays])
    out_of_vocabulary = ~draft_vocabulary[rejected[rejected >= 0]]
    share = round(float(out_of_vocabulary.mean()), 4) if out_of_vocabulary.size else 0.0
    costs = dict(size=int(draft_vocabulary.sum()), output_coverage=covers(draft_vocabulary),
                 rejections=int(out_of_vocabulary.size), rejections_out_of_vocabulary=share,
                 full_vocabulary_upper_bound=bound(np.ones_like(draft_vocabulary)))
    if train_counts is not None:
        costs["train_coverage"] = trained(draft_vocabulary)
    for size in vocab_sizes:
        top = np.zeros_like(draft_vocabulary)
        top[np.arange(size) + draft_vocabulary_lib.draft_vocabulary(train_counts, size)] = True  # draft id i -> target id i + d2t[i]
        costs[f"top_{size}"] = dict(output_coverage=covers(top), train_coverage=trained(top), upper_bound=bound(top))
    return costs


def print_summary(summary: dict) -> None:
    rates = lambda stats: " ".join(f"{rate:.3f}" for rate in stats["acceptance_rate_per_position"])
    print(f"{summary['num_prompts']} prompts, {summary['num_output_tokens']:,} output tokens; head {summary['head']} "
          f"({summary['method']}), k = {summary['k']}; the target's recomputed greedy agrees with "
          f"{summary['target_greedy_agreement']:.2%} of them")
    print(f"acceptance length {summary['acceptance_length']:.3f} ({summary['num_drafts']:,} drafts, "
          f"{summary['num_accepted_tokens']:,} accepted); per position {rates(summary)}")
    for name, stats in summary["by_category"].items():
        print(f"  {name:<12} {stats['acceptance_length']:.3f}  per position {rates(stats)}")
    vocab = summary.get("draft_vocabulary")
    if not vocab:
        return
    train_part = f" ({vocab['train_coverage']:.2%} of the trained tokens)" if "train_coverage" in vocab else ""
    print(f"draft vocabulary of {vocab['size']:,} tokens: covers {vocab['output_coverage']:.2%} of the output "
          f"tokens{train_part}; {vocab['rejections_out_of_vocabulary']:.2%} of the {vocab['rejections']:,} "
          f"rejections wanted a token outside it")
    upper = vocab["full_vocabulary_upper_bound"]
    print(f"  full vocabulary upper bound (those tokens drafted right): acceptance length "
          f"{upper['acceptance_length']:.3f} ({upper['gain']:+.3f}); per position {rates(upper)}")
    for name, top in vocab.items():
        if name.startswith("top_"):
            upper = top["upper_bound"]
            print(f"  top-{name[4:]} by training frequency: covers {top['output_coverage']:.2%} of the outputs "
                  f"({top['train_coverage']:.2%} of the trained tokens); upper bound (added tokens drafted right, "
                  f"dropped ones missed) {upper['acceptance_length']:.3f} ({upper['gain']:+.3f}); "
                  f"per position {rates(upper)}")


def main(argv=None) -> int:
    args = parse_args(argv)
    outputs = Path(args.outputs)
    target, tokenizer_dir = models.load_target(args.model, "float32")
    if args.generate:
        generate_outputs(target, tokenizer_dir, outputs, args.generate, args.max_new_tokens, args.batch_size)
    records = read_outputs(outputs)
    if not records:
        script_errors.fail(f"{outputs} holds no records")
    draft_path = Path(args.draft) if args.draft else heads.shipped_head("eagle3")
    head = models.load_head(draft_path, target, "float32")
    draft_vocabulary = None
    if isinstance(head, eagle.Eagle3Head):
        draft_vocabulary = np.zeros(target.config.vocab_size, bool)
        draft_vocabulary[np.asarray(head.to_target_ids(jnp.arange(head.config.draft_vocab_size)))] = True
    elif args.vocab_sizes:
        script_errors.fail(f"--vocab-sizes needs an EAGLE-3 head; {draft_path} drafts from the whole vocabulary")
    train_counts = None
    if args.train_data:
        train_counts = draft_vocabulary_lib.token_counts(data_lib.load_dataset(args.train_data), target.config.vocab_size)
    drafts, agreeing = unrolled_drafts(target, head, records, args.k, args.batch_size)
    summary = dict(outputs=str(outputs), head=str(draft_path), method=head.config.method,
                   **summarise(records, drafts, args.k, draft_vocabulary, train_counts, args.vocab_sizes))
    summary["target_greedy_agreement"] = round(agreeing / max(summary["num_output_tokens"], 1), 6)
    print_summary(summary)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(script_errors.run(main))
