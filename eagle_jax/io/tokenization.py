"""A model directory's tokenizer, and a user message turned into prompt token ids."""

from __future__ import annotations

import json
from pathlib import Path

# Classes that add nothing to the tokenizer.json they wrap (transformers 5 names the fast
# class TokenizersBackend). For these, AutoTokenizer would pick the same class anyway.
_GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load(directory: str | Path):
    """The tokenizer saved in `directory`.

    A generic fast tokenizer is built from its class directly: AutoTokenizer first reads the
    model config through modules that import torch when it is installed, ~3.5 s of a warm
    start on a small CPU. Any other class (a sentencepiece model, a model-specific subclass)
    goes through AutoTokenizer as usual.
    """
    import transformers  # heavy; only the CLI and scripts need a tokenizer

    directory = Path(directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    if config.get("tokenizer_class") in _GENERIC_CLASSES and (directory / "tokenizer.json").is_file():
        return transformers.PreTrainedTokenizerFast.from_pretrained(str(directory))
    return transformers.AutoTokenizer.from_pretrained(str(directory))


def encode(tokenizer, text: str, chat: bool) -> list[int]:
    """Prompt ids for one user message, through the chat template when asked and there is one."""
    if chat and tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(text)["input_ids"]
