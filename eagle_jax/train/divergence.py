"""Detecting a diverged training run: non-finite losses and parameters.

A run that diverged must neither checkpoint nor export: a NaN head would load and serve, and a
NaN checkpoint would poison every run that resumes from it. The checks run on the device inside
the train step (`all_finite`, one bool a step) and name what is wrong on the host
(`non_finite_paths`) only when something is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


class DivergedError(ValueError):
    """A train step's loss or updated parameters are not finite; `step` is the first such step."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


def all_finite(tree) -> jax.Array:
    """One bool: every floating-point leaf of `tree` is finite (integer leaves always are)."""
    checks = [jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree) if jnp.issubdtype(leaf.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)


def non_finite_paths(tree) -> list[str]:
    """The paths of the floating-point leaves of `tree` holding a NaN or an infinity (read on the host)."""
    leaves = jax.tree_util.tree_flatten_with_path(jax.device_get(tree))[0]
    return [jax.tree_util.keystr(path) for path, leaf in leaves
            if np.issubdtype(np.asarray(leaf).dtype, np.inexact) and not np.isfinite(leaf).all()]
