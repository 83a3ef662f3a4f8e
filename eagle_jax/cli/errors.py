"""What the commands and benchmark scripts do with a problem the user can fix: one `error: ...`
line, exit status 2.

A missing optional package or data file, a bad path or a bad value is reported the way
`python -m eagle_jax.generate` reports it, not as a traceback.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Callable, NoReturn

# Missing files and packages, unreadable inputs, out-of-range values; eagle_jax's InputError and
# CheckpointError are ValueErrors. Anything else is a bug and keeps its traceback.
USER_ERRORS = (OSError, ValueError)


def fail(message: str) -> NoReturn:
    """Prints `error: message` to stderr and exits with status 2."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def require(module: str, install: str) -> ModuleType:
    """Imports an optional module, or fails naming the command that installs it."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError:
        fail(f"{script_name()} needs {module}; install it with: {install}")


def run(main: Callable[[], int | None]) -> int:
    """Calls a script's `main`, turning a user error into its `error:` line and status 2."""
    try:
        return main() or 0
    except USER_ERRORS as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def script_name() -> str:
    return Path(sys.argv[0]).name
