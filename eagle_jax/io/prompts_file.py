"""Prompts from a JSONL file: one object a line with a `prompt` string, or MT-Bench's `turns`.

Everything wrong with the file is a `PromptsFileError` naming the file and, where there is one,
the line, so a command can print it as its one `error:` line: a directory or a missing or
unreadable file, bytes that are not UTF-8, a line that is not a JSON object or has no prompt, a
file with no prompt at all. A UTF-8 byte order mark (what Windows editors write) is skipped.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

BOM = b"\xef\xbb\xbf"
JSON_KINDS = {list: "array", str: "string", int: "number", float: "number", bool: "boolean", type(None): "null"}


class PromptsFileError(ValueError):
    """A prompts file that cannot be read as prompts; the message names the file (and line)."""


def read(path: str | Path) -> list[str]:
    """The first user turn of every line of `path`, in file order.

    A line's prompt is its `prompt` field, else the first of its `turns` (a list of strings, as
    in MT-Bench's question.jsonl, or one string: a single turn). Blank lines are skipped.

    Raises:
        PromptsFileError: naming the file and line, as the module docstring lists.
    """
    prompts = [first_turn(record, path, number) for number, record in records(path)]
    if not prompts:
        raise PromptsFileError(f"{path}: no prompts in the file")
    return prompts


def records(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number from 1, the line's JSON object) for every non-blank line of `path`.

    Lines are split at "\\n" only: JSON strings may hold U+2028 and other characters that
    `str.splitlines` would break a line at.
    """
    try:
        data = Path(path).read_bytes()
    except IsADirectoryError:
        raise PromptsFileError(f"{path}: is a directory, not a prompts file") from None
    except OSError as error:
        raise PromptsFileError(f"{path}: cannot be read ({error.strerror or error})") from None
    if data.startswith(BOM):
        data = data[len(BOM):]
    for number, raw in enumerate(data.split(b"\n"), 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise PromptsFileError(f"{path}:{number}: not UTF-8 text (byte 0x{raw[error.start]:02x} at column "
                                   f"{error.start + 1})") from None
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise PromptsFileError(f"{path}:{number}: expected JSON with 'prompt' or 'turns' ({error.msg} at "
                                   f"column {error.colno})") from None
        if not isinstance(record, dict):
            kind = JSON_KINDS.get(type(record), type(record).__name__)
            raise PromptsFileError(f"{path}:{number}: expected JSON with 'prompt' or 'turns', got a JSON {kind}")
        yield number, record


def first_turn(record: dict, path: str | Path, number: int) -> str:
    """`record`'s prompt (see `read`), or a `PromptsFileError` naming `path`:`number`."""
    where = f"{path}:{number}"
    if "prompt" in record:
        prompt = record["prompt"]
        if not isinstance(prompt, str):
            raise PromptsFileError(f"{where}: 'prompt' must be a string, got {json.dumps(prompt)[:60]}")
    elif "turns" in record:
        turns = turns_of(record["turns"])
        if turns is None:
            raise PromptsFileError(f"{where}: 'turns' must be a string or a non-empty list of strings, got "
                                   f"{json.dumps(record['turns'])[:60]}")
        prompt = turns[0]
    else:
        raise PromptsFileError(f"{where}: expected JSON with 'prompt' or 'turns', got the keys "
                               f"{', '.join(map(repr, record)) or 'none'}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as error:  # a JSON \ud800-\udfff escape; the tokenizer would raise a TypeError
        raise PromptsFileError(f"{where}: the prompt holds a lone surrogate U+{ord(prompt[error.start]):04X}, "
                               "not a character") from None
    return prompt


def questions(path: str | Path) -> list[dict]:
    """MT-Bench questions (question.jsonl): each line's object, its `turns` a list of strings.

    Raises:
        PromptsFileError: as `records`, or a question without `question_id`, `category` or
            usable `turns`, naming the file and line.
    """
    result = []
    for number, question in records(path):
        missing = {"question_id", "category", "turns"} - question.keys()
        if missing:
            raise PromptsFileError(f"{path}:{number}: question without {sorted(missing)}: {question}")
        turns = turns_of(question["turns"])
        if turns is None:
            raise PromptsFileError(f"{path}:{number}: 'turns' must be a string or a non-empty list of strings")
        result.append(dict(question, turns=turns))
    return result


def turns_of(value) -> list[str] | None:
    """MT-Bench `turns` as a list of strings: one string is one turn; None if it is neither.

    Indexing a string would take its first character for the first turn, silently.
    """
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(turn, str) for turn in value):
        return value
    return None
