"""What a compiled program is traced from, as text: the key of a compilation cache entry that
needs no tracing to look up.

Looking an entry up by the program's own text means tracing and lowering it first, and on a warm
start that is most of the time a load takes (a CPU start of SmolLM2's 21 slot programs: 4.4 s
tracing, 1.5 s lowering, 0.4 s printing the HLO, of 8.2 s). So the cache names an entry by what
the program is traced from instead (`CompileCache`): the settings text the caller gives (model
configs, static options, argument shapes, dtypes and shardings) plus `code_identity` here, which
covers the code that turns those settings into a program:

- every Python source file of the eagle_jax package, by content;
- the source file of every class in the models' graphs and their bases, where it lies outside
  eagle_jax, jax and flax (a user's subclass of `llama.Llama`);
- the versions of Python, jax, jaxlib, flax and numpy, and every jax configuration value;
- each module's class and static attributes (numbers, strings, dtypes), which no config holds.

A class whose source file cannot be read (defined at an interactive prompt) leaves the code
unidentified: `code_identity` returns None and the engine compiles in memory only.
"""

from __future__ import annotations

import builtins
import functools
import hashlib
import inspect
import sys
from pathlib import Path

import flax
import jax
import jaxlib
import numpy as np
from flax import nnx

PACKAGE = Path(__file__).resolve().parents[1]  # eagle_jax/
# Classes from these packages and the standard library are covered by their versions, not by their files.
VERSIONED = ("jax", "jaxlib", "flax", "numpy")


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@functools.cache
def package_digest() -> str:
    """Every .py file of the eagle_jax package, by relative path and content."""
    files = sorted(PACKAGE.rglob("*.py"))
    return _digest(b"".join(f"{path.relative_to(PACKAGE)}\0{_digest(path.read_bytes())}\n".encode()
                            for path in files))


def _outside_files(classes: set[type]) -> list[Path] | None:
    """Source files of these classes and their bases outside eagle_jax and the versioned
    packages; None if one's definition cannot be found in its file."""
    files = set()
    for cls in {base for cls in classes for base in cls.__mro__}:
        package = cls.__module__.split(".")[0]
        if (getattr(builtins, cls.__name__, None) is cls or package in VERSIONED + ("eagle_jax",)
                or package in sys.stdlib_module_names):
            continue
        try:
            inspect.getsource(cls)  # the class is defined in the file found, not only named after it
            files.add(Path(inspect.getsourcefile(cls)).resolve())
        except (TypeError, OSError):
            return None
    return sorted(files)


def _static_text(value) -> str | None:
    """A module attribute as text that is the same in every process; None for what is not static
    (variables, submodules, arrays) or has no such text."""
    if isinstance(value, (nnx.Variable, nnx.Module, jax.Array, np.ndarray)):
        return None
    if isinstance(value, type):  # dtypes as jnp.bfloat16, classes
        return str(np.dtype(value)) if issubclass(value, np.generic) else f"{value.__module__}.{value.__qualname__}"
    if callable(value) and hasattr(value, "__qualname__"):  # initialisers, activations
        return f"{getattr(value, '__module__', '')}.{value.__qualname__}"
    text = repr(value)
    return None if " at 0x" in text or len(text) > 10_000 else text


def _modules(models) -> list[tuple[str, nnx.Module]]:
    """Every module of these models' graphs, in graph order, with its path (model index first)."""
    return [(f"{index}/{'/'.join(map(str, path))}", node) for index, model in enumerate(models) if model is not None
            for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)]


def module_text(modules: list[tuple[str, nnx.Module]]) -> str:
    """Each module's path, class and static attributes, a line each."""
    lines = []
    for path, node in modules:
        attributes = []
        for name, value in sorted(vars(node).items()):
            text = None if name.startswith("_") else _static_text(value)
            if text is not None:
                attributes.append(f"{name}={text}")
        lines.append(f"{path} {type(node).__module__}.{type(node).__qualname__} " + " ".join(attributes))
    return "\n".join(lines)


def code_identity(*models) -> str | None:
    """The text that, with a program's settings, determines it (module docstring); None when a
    model class's source cannot be read."""
    modules = _modules(models)
    outside = _outside_files({type(node) for _, node in modules})
    if outside is None:
        return None
    versions = f"jax {jax.__version__} jaxlib {jaxlib.__version__} flax {flax.__version__} numpy {np.__version__} " \
               f"python {sys.version_info[:3]}"
    config = repr(sorted((name, repr(value)) for name, value in jax.config.values.items()))
    parts = [versions, package_digest(), *(f"{path}\0{_digest(path.read_bytes())}" for path in outside), config,
             module_text(modules)]
    return _digest("\n".join(parts).encode())
