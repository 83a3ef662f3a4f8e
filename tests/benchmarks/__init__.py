"""Tests of the scripts under benchmarks/, which are files rather than an importable package."""

import importlib.util
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def script(name: str):
    """benchmarks/<name>.py, loaded as a module (its `main` not run)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
