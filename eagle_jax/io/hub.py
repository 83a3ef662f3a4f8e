"""Hugging Face hub ids where a path is expected: `org/name` resolves to a local snapshot.

`huggingface_hub` (a dependency of transformers) downloads into its usual cache, or finds a
snapshot there when offline (`HF_HUB_OFFLINE=1`). Only weights, configs and tokenizer files are
fetched: no Python file of a repository is downloaded, let alone run.
"""

from __future__ import annotations

import re
from pathlib import Path

from eagle_jax.io import hf_files

# `org/name`, as the hub spells repository ids (no leading dot, no `..`).
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
_FILES = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "merges.txt", "vocab.txt"]
# Fetched only for a repository without safetensors: many EAGLE heads are pytorch_model.bin.
_TORCH_FILES = ["*.json", "pytorch_model*.bin"]


def looks_like_repo_id(text: str) -> bool:
    """Whether `text` reads as a hub repository id rather than a filesystem path."""
    return bool(_REPO_ID.fullmatch(text)) and ".." not in text and not text.endswith(".gguf")


def snapshot(repo_id: str, what: str = "model") -> Path:
    """The local snapshot directory of hub repository `repo_id`, downloading what is missing.

    Args:
        repo_id: `org/name`.
        what: what the id names, for the message ("model", "draft head").

    Raises:
        hf_files.CheckpointError: the repository is neither in the local cache nor reachable
            (offline, not found, gated, no network), in one line naming the id.
    """
    import huggingface_hub  # lazily: only hub ids need it

    try:
        directory = Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=_FILES))
        if not any(directory.glob("*.safetensors")):
            directory = Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=_TORCH_FILES))
    except Exception as error:  # the hub client raises many types (HTTP, offline, validation, OS)
        raise hf_files.CheckpointError(
            f"{what} {repo_id!r} is not a local path, and was not found locally nor reachable on the Hugging "
            f"Face Hub ({type(error).__name__})") from None
    return directory
