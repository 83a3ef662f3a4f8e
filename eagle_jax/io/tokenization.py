"""A model directory's tokenizer, and a user message turned into prompt token ids.

No code from a model directory ever runs: transformers is always called with
`trust_remote_code=False` (so it never asks on stdin either), and a directory whose tokenizer
names its own Python classes (`auto_map`) is refused up front, naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle_jax.io import hf_files

# Classes that add nothing to the tokenizer.json they wrap (transformers 5 names the fast
# class TokenizersBackend). For these, AutoTokenizer would pick the same class anyway.
_GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def load(directory: str | Path):
    """The tokenizer saved in `directory`.

    A generic fast tokenizer is built from its class directly: AutoTokenizer first reads the
    model config through modules that import torch when it is installed, ~3.5 s of a warm
    start on a small CPU. Any other class (a sentencepiece model, a model-specific subclass)
    goes through AutoTokenizer as usual.

    Raises:
        hf_files.CheckpointError: the tokenizer needs code from the directory, or its
            tokenizer_config.json is unreadable.
    """
    import transformers  # heavy; only the CLI and scripts need a tokenizer

    directory = Path(directory)
    config = _json_if_present(directory / "tokenizer_config.json")
    _refuse_remote_code(directory, config)
    if config.get("tokenizer_class") in _GENERIC_CLASSES and (directory / "tokenizer.json").is_file():
        return transformers.PreTrainedTokenizerFast.from_pretrained(str(directory), trust_remote_code=False)
    try:
        return transformers.AutoTokenizer.from_pretrained(str(directory), trust_remote_code=False)
    except ValueError as error:
        if "trust_remote_code" not in str(error):
            raise
        # Code referenced somewhere else than an auto_map above: transformers' advice (to pass
        # trust_remote_code=True) is exactly what is not done here.
        raise RemoteCodeError(directory, "transformers refused to load it without running that code") from None


def _json_if_present(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise hf_files.CheckpointError(f"{path}: unreadable ({error})") from None
    return value if isinstance(value, dict) else {}


def _refuse_remote_code(directory: Path, tokenizer_config: dict) -> None:
    """Raises if loading this tokenizer would need a Python file from `directory`."""
    model_map = _json_if_present(directory / "config.json").get("auto_map")
    # tokenizer_config.json's auto_map names tokenizer classes only; config.json's names model
    # classes too, which no tokenizer needs.
    for path, entry in ((directory / "tokenizer_config.json", tokenizer_config.get("auto_map")),
                        (directory / "config.json", model_map.get("AutoTokenizer") if isinstance(model_map, dict)
                         else None)):
        if names := _strings(entry):
            modules = sorted({name.split("--")[-1].rsplit(".", 1)[0] + ".py" for name in names})
            raise RemoteCodeError(path, f"auto_map names {', '.join(names)}, in {', '.join(modules)}")


class RemoteCodeError(hf_files.CheckpointError):
    """A tokenizer that only code from its model directory could build."""

    def __init__(self, path: Path, detail: str):
        super().__init__(f"{path}: the tokenizer needs code from the model directory ({detail}); eagle_jax never "
                         "runs code from a model directory. Use one whose tokenizer is a tokenizer.json or a class "
                         "that transformers ships")


def _strings(entry) -> list[str]:
    if isinstance(entry, str):
        return [entry]
    values = entry.values() if isinstance(entry, dict) else entry if isinstance(entry, list) else []
    return [name for value in values for name in _strings(value)]


ROLES = ("system", "developer", "user", "assistant", "tool")


def encode(tokenizer, text: str, chat: bool) -> list[int]:
    """Prompt ids for one user message, through the chat template when asked and there is one.

    Raises:
        ChatTemplateError: the template raised; the message names the file it came from.
    """
    if chat and tokenizer.chat_template:
        try:
            return encode_messages(tokenizer, [{"role": "user", "content": text}])
        except ChatTemplateError as error:
            raise ChatTemplateError(f"{template_file(tokenizer)}: {error}") from None
    return tokenizer(text)["input_ids"]


class ChatTemplateError(ValueError):
    """A chat template that raised while rendering: a jinja error, its own `raise_exception`, a
    recursive macro that ran out of stack (jinja has no unbounded loop, only recursion)."""


def template_file(tokenizer) -> str:
    """The file in the tokenizer's directory that holds its chat template, for error messages."""
    directory = Path(tokenizer.name_or_path or ".")
    for name in ("chat_template.jinja", "chat_template.json", "tokenizer_config.json"):
        if (directory / name).is_file():
            return str(directory / name)
    return str(directory)


def check_messages(messages) -> list[dict]:
    """OpenAI-style messages as a list of {"role", "content": str} dicts, or a ValueError saying what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} objects, got {messages!r:.80}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) - {"role", "content", "name"} or "role" not in message:
            raise ValueError(f"message {index} must be an object with 'role' and 'content', got {message!r:.80}")
        if message["role"] not in ROLES:
            raise ValueError(f"message {index} has role {message['role']!r}; roles are {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"message {index}'s content must be a string, got {message.get('content')!r:.80}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def encode_messages(tokenizer, messages) -> list[int]:
    """Prompt ids for a conversation (system, user and assistant turns) through the chat template.

    The template's generation prompt is added, so the model answers as the assistant next. A
    tokenizer without a template joins the contents with newlines.
    """
    messages = check_messages(messages)
    if not tokenizer.chat_template:
        return tokenizer("\n".join(m["content"] for m in messages))["input_ids"]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as error:  # a template that raises (a jinja error, a role it refuses) is the input's fault
        # No path in the message: the server sends it to its clients (`encode` adds the file).
        raise ChatTemplateError(f"the chat template failed on these messages ({type(error).__name__}: "
                                f"{error})") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]
