"""The EAGLE heads shipped for the default model, SmolLM2-135M-Instruct, and how the CLI picks one.

Each head is a directory in the public HF layout (config.json + model.safetensors), loadable by
vLLM and SGLang too. `defaults.json` holds numbers only: the measured best k per head and platform,
and, for the platforms where plain decoding measured faster than any speculative setting, the two
rates measured (where they come from: docs/benchmarks.md).

A platform's k is one number, or one per batch size where they were measured apart, keyed by the
batch size as a string: {"gpu": {"1": 5, "16": 3}} gives k = 5 below batch 16 and 3 from 16 on.
"""

from __future__ import annotations

import json
from pathlib import Path

HEADS_DIR = Path(__file__).parent
DEFAULTS_FILE = HEADS_DIR / "defaults.json"
SHIPPED = {"eagle": "smollm2-135m-instruct-eagle", "eagle3": "smollm2-135m-instruct-eagle3"}
DEFAULT_METHOD = "eagle3"


def shipped_head(method: str) -> Path | None:
    path = HEADS_DIR / SHIPPED[method]
    return path if (path / "config.json").is_file() else None


def _defaults() -> dict:
    return json.loads(DEFAULTS_FILE.read_text()) if DEFAULTS_FILE.is_file() else {}


def best_k(method: str | None, platform: str = "gpu", batch_size: int = 1) -> int:
    """The measured best k for a shipped head on `platform` (jax's name: "cpu", "gpu", ...).

    Platforms without a measurement take the GPU's; heads without one, 3 (a common sweet spot).
    Where k was measured per batch size, the largest measured batch size not above `batch_size`
    gives it (the smallest measured one below them all).
    """
    return k_at(k_by_batch_size(method, platform), batch_size)


def k_at(pairs, size: int) -> int:
    """The k of the (size, k) pair with the largest size not above `size` (the smallest size's
    below them all): how a table of k measured per batch size reads between its sizes."""
    pairs = sorted(pairs)
    return max([pair for pair in pairs if pair[0] <= size], default=pairs[0])[1]


def k_by_batch_size(method: str | None, platform: str = "gpu", max_batch_size: int | None = None
                    ) -> tuple[tuple[int, int], ...]:
    """`best_k`'s measurements as (batch size, k) pairs, ascending: ((1, k),) where one k was
    measured; those above `max_batch_size` left out, but for the smallest."""
    measured = _defaults().get(method or "", {}).get("num_speculative_tokens", 3)
    if isinstance(measured, dict):
        measured = measured.get(platform, measured.get("gpu", 3))
    if not isinstance(measured, dict):
        return ((1, int(measured)),)
    pairs = sorted((int(size), int(k)) for size, k in measured.items())
    return tuple(pair for index, pair in enumerate(pairs) if index == 0 or max_batch_size is None
                 or pair[0] <= max_batch_size)


def plain_by_default(platform: str) -> str | None:
    """Why the CLI decodes without a draft on `platform` unless asked to speculate, or None.

    On a small CPU, verifying k+1 tokens costs several decode steps, so speculating is slower
    (measured; the rates are in defaults.json); accelerators, where a step is bound by memory,
    speculate.
    """
    measured = _defaults().get("plain_decoding_by_default_on", {}).get(platform)
    if not measured:
        return None
    speculative, plain = measured["best_speculative_tokens_per_second"], measured["plain_tokens_per_second"]
    return (f"plain decoding measured faster here ({plain} tokens/s against {speculative} for the best "
            f"speculative setting: verifying k+1 tokens costs several one-token steps)")


def draft_plan(model: str | None, draft: str | None, method: str | None, k: int | None,
               platform: str, batch_size: int = 1) -> tuple[Path | None, str, int, str | None]:
    """(head directory or None, method, k, a note for the user or None) for the CLI's flags.

    Asking for nothing picks the shipped head with its measured best k for this batch size,
    except where plain decoding measured faster; asking for a head (--draft, --method) or a k
    always speculates.

    Raises:
        ValueError: speculation asked (--method, a k > 0) for a model with no shipped head and
            no --draft: decoding plainly instead would ignore what was asked.
    """
    asked = [flag for flag, given in ((f"--method {method}", method is not None and k != 0),
                                      (f"{k} drafts per step", bool(k))) if given]
    if model is not None and draft is None and asked:
        raise ValueError(f"speculation ({', '.join(asked)}) needs a draft head for --model {model}, and the shipped "
                         "heads fit the default model only: pass --draft with an EAGLE head trained for this model "
                         "(a directory or a hub id), or drop the speculation flags to decode without drafts")
    path, chosen = choose_draft(model, draft, method)
    if path is None:
        return None, "none", 0, None
    if draft is None and method is None and k is None and (reason := plain_by_default(platform)):
        return None, "none", 0, (f"decoding without a draft on {platform}: {reason}. "
                                 f"Pass --method {chosen} to speculate anyway.")
    k = best_k(chosen, platform, batch_size) if k is None else k
    return (path, chosen, k, None) if k > 0 else (None, "none", 0, None)


def choose_draft(model: str | None, draft: str | None, method: str | None) -> tuple[Path | None, str]:
    """(head directory or None, method) from the CLI's --model, --draft and --method."""
    if draft is not None and draft.lower() == "none":
        return None, "none"
    if draft is not None:
        path = Path(draft).expanduser()
        if not path.exists():
            from eagle_jax.io import models  # a hub id (org/name) resolves to its download

            path = models.resolve_head_dir(draft)
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
