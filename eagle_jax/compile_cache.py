"""A persistent compilation cache with one subdirectory per compiled module.

JAX's own persistent cache is one flat directory for the whole process. vLLM found it needed a
separate cache for the draft head; here every module (prefill, decode, speculative step, draft
head) gets `<root>/<module>-<hash>/`, the hash covering what determines its program besides the
program text: model configs, static options, argument shapes and dtypes, jax and jaxlib
versions, and the backend. Inside, each entry is named by the hash of the lowered program, so
a stale entry can never be loaded for a changed program. Removing one module's directory
recompiles only that module.

Entries are `MAGIC + sha256(payload) + payload` and are written to a temporary file then
renamed, so two processes filling the same cache leave only complete entries; a corrupt or
truncated entry fails its checksum, is reported as a warning, and is rebuilt.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
import warnings
from pathlib import Path

import jax
import jaxlib
from jax.experimental import serialize_executable

MAGIC = b"EAGLEJAX-XLA-1\n"
ENV_VAR = "EAGLE_JAX_CACHE_DIR"


def default_root() -> Path:
    """`$EAGLE_JAX_CACHE_DIR/xla`, else under the user's cache directory."""
    from eagle_jax import default_model  # local: keeps this module free of model code at import

    return default_model.cache_root() / "xla"


def _digest(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


class CompileCache:
    """Compiles lowered programs, reusing executables saved by earlier processes.

    Args:
        root: cache directory; None disables persistence (compile every time).
    """

    def __init__(self, root: str | Path | None):
        self.root = Path(root).expanduser() if root is not None else None
        self.hits = 0
        self.misses = 0

    def module_dir(self, module: str, key: str) -> Path:
        device = jax.devices()[0]
        # XLA_FLAGS change the executable but not the program text, so they belong in the key.
        identity = "|".join([key, jax.__version__, jaxlib.__version__, device.platform, device.device_kind,
                             os.environ.get("XLA_FLAGS", "")])
        return self.root / f"{module}-{_digest(identity)[:16]}"

    def compile(self, module: str, key: str, lowered) -> tuple[object, float]:
        """Returns (compiled executable, seconds spent compiling or loading).

        Args:
            module: short module name, the directory prefix (e.g. "speculative-eagle3-k5").
            key: text describing the settings the program depends on.
            lowered: the `jax.stages.Lowered` program.
        """
        began = time.perf_counter()
        if self.root is None:
            self.misses += 1
            return lowered.compile(), time.perf_counter() - began
        directory = self.module_dir(module, key)
        entry = directory / f"{_digest(lowered.as_text())[:32]}.xla"
        compiled = self._load(entry, lowered)
        if compiled is not None:
            self.hits += 1
            return compiled, time.perf_counter() - began
        self.misses += 1
        compiled = lowered.compile()
        try:
            payload = serialize_executable.serialize(compiled)[0]
            self._write(entry, payload)
        except Exception as error:  # a backend that cannot serialise still runs, uncached
            warnings.warn(f"compilation cache: could not save {entry}: {error}")
        return compiled, time.perf_counter() - began

    @staticmethod
    def _load(entry: Path, lowered):
        try:
            blob = entry.read_bytes()
        except FileNotFoundError:
            return None
        try:
            if not blob.startswith(MAGIC):
                raise ValueError("bad header")
            checksum, payload = blob[len(MAGIC):len(MAGIC) + 64], blob[len(MAGIC) + 64:]
            if checksum.decode() != _digest(payload):
                raise ValueError("checksum mismatch (truncated or corrupt)")
            return serialize_executable.deserialize_and_load(payload, lowered.in_tree, lowered.out_tree)
        except Exception as error:
            warnings.warn(f"compilation cache: discarding unreadable entry {entry}: {error}; recompiling")
            entry.unlink(missing_ok=True)
            return None

    @staticmethod
    def _write(entry: Path, payload: bytes) -> None:
        entry.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-")
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(MAGIC + _digest(payload).encode() + payload)
            os.replace(temporary, entry)  # atomic: readers see the old entry or the whole new one
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
