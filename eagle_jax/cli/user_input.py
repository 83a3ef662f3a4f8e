"""What the generate command takes from its user that argparse's types do not check: the
prompts (`--prompt`, `--prompts-file`) and the seed. Each problem is a `config.InputError` (or a
`prompts_file.PromptsFileError`), printed as one `error:` line before anything is loaded.
"""

from __future__ import annotations

from eagle_jax.io import prompts_file
from eagle_jax.serve import config as config_lib

DEFAULT_PROMPT = "Write a short poem about the sea."

# jax.random.key takes a seed that fits an int64 (it keeps the low 32 bits without x64).
SEED_RANGE = (-2**63, 2**63)


def prompts(given: list[str], path: str | None) -> list[str]:
    """The `--prompt`s, then the file's prompts; the default prompt when there are neither.

    Raises:
        config.InputError: a `--prompt` that is not UTF-8 text.
        prompts_file.PromptsFileError: the file cannot be read as prompts (`prompts_file.read`).
    """
    for number, text in enumerate(given, 1):
        check_text(text, f"--prompt number {number}")
    texts = list(given)
    if path is not None:
        texts += prompts_file.read(path)
    return texts or [DEFAULT_PROMPT]


def check_text(text: str, name: str) -> None:
    """Raises unless `text` is Unicode text the tokenizer can take.

    Python decodes argv bytes that are not UTF-8 into lone surrogates (surrogateescape), and a
    JSON "\\udcff" escape makes one too; the tokenizer refuses them with a TypeError.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raw = text.encode("utf-8", "surrogateescape") if _escaped_bytes(text) else None
        if raw is not None:
            bad = len(text[:error.start].encode("utf-8", "surrogateescape"))
            detail = f"byte 0x{raw[bad]:02x} at byte {bad + 1}"
        else:
            detail = f"a lone surrogate U+{ord(text[error.start]):04X} at character {error.start + 1}"
        raise config_lib.InputError(f"{name} is not UTF-8 text ({detail})") from None


def _escaped_bytes(text: str) -> bool:
    """Whether every surrogate in `text` stands for one undecodable byte (U+DC80..U+DCFF)."""
    return all(0xDC80 <= ord(char) <= 0xDCFF for char in text if 0xD800 <= ord(char) <= 0xDFFF)


def check_seed(seed: int) -> None:
    low, high = SEED_RANGE
    if not low <= seed < high:
        raise config_lib.InputError(f"--seed must be an integer from -2^63 to 2^63 - 1, got {seed}")


def prompt_seed(seed: int, index: int) -> int:
    """The seed of the `index`-th prompt decoded on its own: `seed + index`, wrapped into the int64 range."""
    low, high = SEED_RANGE
    return (seed + index - low) % (high - low) + low
