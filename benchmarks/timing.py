"""Wall-clock timing shared by the benchmark scripts."""

from __future__ import annotations

import time

import jax


def best_seconds(call, repeats: int) -> float:
    """The fastest of `repeats` wall times of `call()` until its results are ready (compile it first)."""
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        jax.block_until_ready(call())
        best = min(best, time.perf_counter() - began)
    return best
