"""The JSON result files under docs/results/: lists of rows that every benchmark script appends to."""

from __future__ import annotations

import json
import os
from pathlib import Path


def append_rows(path: str | Path, rows: list[dict]) -> None:
    """Appends rows to a JSON list file (created if missing), replacing it atomically."""
    path = Path(path)
    existing = json.loads(path.read_text()) if path.is_file() and path.read_text().strip() else []
    if not isinstance(existing, list):
        raise ValueError(f"{path} does not hold a JSON list")
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(json.dumps(existing + rows, indent=1) + "\n")
    os.replace(temporary, path)


def error_field(error: BaseException) -> str:
    """A row's `error`: what a setting that failed raised, short enough for a table."""
    return f"{type(error).__name__}: {error}"[:400]
