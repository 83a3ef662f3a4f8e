"""The EAGLE heads shipped for the default model, SmolLM2-135M-Instruct, and how the CLI picks one.

Each head is a directory in the public HF layout (config.json + model.safetensors), loadable by
vLLM and SGLang too. `defaults.json` records the measured best k per head (docs/TRAINING.md).
"""

from __future__ import annotations

import json
from pathlib import Path

HEADS_DIR = Path(__file__).parent
SHIPPED = {"eagle": "smollm2-135m-instruct-eagle", "eagle3": "smollm2-135m-instruct-eagle3"}
DEFAULT_METHOD = "eagle3"


def shipped_head(method: str) -> Path | None:
    path = HEADS_DIR / SHIPPED[method]
    return path if (path / "config.json").is_file() else None


def best_k(method: str | None) -> int:
    """The measured best k for a shipped head (3 for other heads, a common sweet spot)."""
    defaults = HEADS_DIR / "defaults.json"
    if method and defaults.is_file():
        return int(json.loads(defaults.read_text()).get(method, {}).get("num_speculative_tokens", 3))
    return 3


def choose_draft(model: str | None, draft: str | None, method: str | None) -> tuple[Path | None, str]:
    """(head directory or None, method) from the CLI's --model, --draft and --method."""
    if draft is not None and draft.lower() == "none":
        return None, "none"
    if draft is not None:
        path = Path(draft).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"draft path {path} does not exist")
        return path, method or ("eagle3" if _is_eagle3(path) else "eagle")
    if model is not None:  # shipped heads only fit the default model
        return None, "none"
    method = method or DEFAULT_METHOD
    head = shipped_head(method)
    return (head, method) if head is not None else (None, "none")


def _is_eagle3(path: Path) -> bool:
    config = path / "config.json" if path.is_dir() else path.parent / "config.json"
    try:
        return "Eagle3" in " ".join(json.loads(config.read_text()).get("architectures") or [])
    except (OSError, ValueError):
        return False
