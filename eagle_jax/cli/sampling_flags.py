"""The generate CLI's sampling and stopping flags, its --messages-file, and what they change in its output.

Flags follow vLLM's names (`--top-k`, `--min-p`, `--repetition-penalty`, `--presence-penalty`,
`--frequency-penalty`, `--logprobs`, `--stop`, `--stop-token-ids`, `--min-tokens`, `--n`); their
values are checked by `sampling.Sampling`, whose message is reported with the flag's name.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.io import tokenization
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import text as text_lib

# Sampling field -> the flag that sets it (--temperature, --top-p and --ignore-eos are generate.py's
# own flags; its --seed keys the whole call, not a request).
FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
         "repetition_penalty": "--repetition-penalty", "presence_penalty": "--presence-penalty",
         "frequency_penalty": "--frequency-penalty", "logprobs": "--logprobs", "stop": "--stop",
         "stop_token_ids": "--stop-token-ids", "ignore_eos": "--ignore-eos", "min_tokens": "--min-tokens", "n": "--n"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `sampling` reads, beside generate.py's --temperature, --top-p, --seed and --ignore-eos."""
    group = parser.add_argument_group("sampling and stopping (vLLM's names; each prompt gets the same)")
    group.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: off)")
    group.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p times the most likely's "
                                                                "probability (0: off)")
    group.add_argument("--repetition-penalty", type=float, default=1.0,
                       help="divide positive logits (multiply negative ones) of prompt and output tokens (1: off)")
    group.add_argument("--presence-penalty", type=float, default=0.0, help="subtract from tokens already output, "
                                                                           "in [-2, 2]")
    group.add_argument("--frequency-penalty", type=float, default=0.0, help="subtract per time a token was output, "
                                                                            "in [-2, 2]")
    group.add_argument("--logprobs", type=int, help=f"report each token's log-probability and this many "
                                                    f"alternatives (0..{sampling_lib.MAX_LOGPROBS}; --json)")
    group.add_argument("--stop", action="append", default=[], help="a string that ends the output, cut before it "
                                                                   "(repeatable)")
    group.add_argument("--stop-token-ids", type=_ids, default=(), metavar="ID[,ID...]",
                       help=f"token ids that end the output (at most {sampling_lib.MAX_STOP_TOKEN_IDS})")
    group.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop token id before this many tokens")
    group.add_argument("--n", type=int, default=1, help="samples per prompt (each prints its own output)")
    group.add_argument("--messages-file", help="JSONL: per line, an OpenAI-style list of {role, content} messages "
                                               "(or {\"messages\": [...]}), fed through the chat template")


def _ids(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def sampling(args) -> sampling_lib.Sampling:
    """The `Sampling` the flags ask for.

    Raises:
        config.InputError: the first bad value, named by its flag.
    """
    values = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                  repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                  frequency_penalty=args.frequency_penalty, logprobs=args.logprobs, stop=tuple(args.stop),
                  stop_token_ids=tuple(args.stop_token_ids), ignore_eos=args.ignore_eos, min_tokens=args.min_tokens,
                  n=args.n)
    try:
        return sampling_lib.Sampling(**values)
    except ValueError as error:  # Sampling names the field first: name the flag instead
        field, _, rest = str(error).partition(" must ")
        raise config_lib.InputError(f"{FLAGS.get(field, field)} must {rest}" if rest else str(error)) from None


def read_messages(path: str) -> list[list[dict]]:
    """The conversations of a --messages-file, each checked (`tokenization.check_messages`).

    Raises:
        config.InputError: naming the file, the line and what is wrong with it.
    """
    conversations = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise config_lib.InputError(f"{path}: unreadable ({error})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            messages = record["messages"] if isinstance(record, dict) and "messages" in record else record
            conversations.append(tokenization.check_messages(messages))
        except (json.JSONDecodeError, ValueError) as error:
            raise config_lib.InputError(f"{path}:{number}: {error}") from None
    if not conversations:
        raise config_lib.InputError(f"{path}: no conversations (one JSON list of messages per line)")
    return conversations


def encode(tokenizer, prompt: str | list[dict], chat: bool) -> list[int]:
    """Token ids of a --prompt text, or of a --messages-file conversation (always through the template)."""
    if isinstance(prompt, list):
        return tokenization.encode_messages(tokenizer, prompt)
    return tokenization.encode(tokenizer, prompt, chat)


def shown(prompt: str | list[dict]) -> str:
    """How a prompt is printed: a conversation as its last message."""
    return prompt[-1]["content"] if isinstance(prompt, list) else prompt


def per_sample(items: list, settings: sampling_lib.Sampling) -> list:
    """Each item once per sample: results come n to a prompt (`Engine.generate`)."""
    return [item for item in items for _ in range(settings.n)]


def streamer(tokenizer, settings: sampling_lib.Sampling):
    """(on_tokens, finish) for streaming one prompt's text to stdout, cut before a stop string."""
    stream = text_lib.TextStream(tokenizer, stop=settings.stop, stop_token_ids=settings.stop_token_ids)

    def on_tokens(_, new_ids):
        print(stream.push(new_ids), end="", flush=True)

    return on_tokens, lambda: print(stream.finish(), end="", flush=True)


def json_fields(result) -> dict:
    """What the sampling flags add to a --json record: why it ended, and the logprobs when asked."""
    fields = dict(finish_reason=result.finish_reason, stop_reason=result.stop_reason)
    if result.logprobs is not None:
        fields["logprobs"] = result.logprobs
    return fields
