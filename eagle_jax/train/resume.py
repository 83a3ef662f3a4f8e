"""Training checkpoints (orbax): params and optimizer state saved, and restored only once verified.

A run resumes from the latest checkpoint in its output directory. That directory may hold a
checkpoint of another head (an output directory reused with another method, width or draft
vocabulary) or damaged files; either is refused with a `hf_files.CheckpointError` that says
which and what to do, not an orbax shape error or a silently poisoned run.

Each checkpoint carries the sha256 of its arrays (`DIGEST_FILE` in its step directory), so that
damage that leaves every value finite (a flipped bit in a stored weight) is caught on resume too.
A checkpoint written without one (by an older eagle_jax) resumes with a warning.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import numpy as np

import jax
import orbax.checkpoint as ocp

from eagle_jax.io import hf_files
from eagle_jax.train import divergence


def checkpoint_manager(directory: Path) -> ocp.CheckpointManager:
    """The manager of the checkpoints in `directory` (created if missing), keeping the last two."""
    options = ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    # The handler named up front, so that a new manager can read a checkpoint's metadata
    # (`restore` checks its tree and shapes) before restoring anything.
    return ocp.CheckpointManager(directory.resolve(), options=options, item_handlers=ocp.StandardCheckpointHandler())


DIGEST_FILE = "eagle_jax_digest.json"


def save(manager: ocp.CheckpointManager, step: int, state: dict) -> None:
    """Checkpoints `state` ({"params": ..., "opt_state": ...}) as `step`, waiting until it is written,
    with the digest of its arrays beside it."""
    manager.save(step, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
    digest_path(manager, step).write_text(json.dumps({"sha256": state_digest(state)}) + "\n")


def digest_path(manager: ocp.CheckpointManager, step: int) -> Path:
    return Path(manager.directory) / str(step) / DIGEST_FILE


def state_digest(state) -> str:
    """sha256 over every array's path, dtype, shape and bytes, in tree order."""
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        array = np.ascontiguousarray(jax.device_get(leaf))
        digest.update(f"{jax.tree_util.keystr(path)}|{array.dtype.str}|{array.shape}|".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def restore(manager: ocp.CheckpointManager, state: dict) -> tuple[dict, int] | None:
    """The latest checkpoint restored into the shapes of `state`, and its step; None if there is none.

    Raises:
        hf_files.CheckpointError: the checkpoint was written for another head (its parameter
            tree or shapes differ), cannot be read into `state`, or holds non-finite values
            (damaged files, or a run that had diverged).
    """
    step = manager.latest_step()
    if step is None:
        return None
    where = f"the checkpoint of step {step} in {manager.directory}"
    try:
        stored = manager.item_metadata(step)["params"]
    except (KeyError, TypeError, ValueError, OSError) as error:  # no metadata, or not a trainer's checkpoint
        raise hf_files.CheckpointError(f"{where} cannot be read as a training checkpoint: {error!r}") from error
    check_checkpoint_params(stored, state["params"], where)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
    try:
        restored = manager.restore(step, args=ocp.args.StandardRestore(abstract))
    except ValueError as error:
        raise hf_files.CheckpointError(f"{where} cannot be restored into this head and optimizer: {error}") from error
    earlier = [s for s in manager.all_steps() if s < step]
    instead = (f"delete {Path(manager.directory) / str(step)} to resume from step {earlier[-1]}" if earlier
               else f"delete {manager.directory} to start over")
    bad = divergence.non_finite_paths(restored)
    if bad:
        raise hf_files.CheckpointError(f"{where} holds non-finite values in {len(bad)} arrays "
                                       f"({', '.join(bad[:3])}): {instead}")
    try:
        expected = json.loads(digest_path(manager, step).read_text())["sha256"]
    except FileNotFoundError:
        print(f"eagle_jax: warning: {where} has no {DIGEST_FILE} (written by an older eagle_jax): "
              "resuming without checking its bytes", file=sys.stderr)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise hf_files.CheckpointError(f"{where}: its {DIGEST_FILE} cannot be read ({error!r}): {instead}") from None
    else:
        if state_digest(restored) != expected:
            raise hf_files.CheckpointError(f"{where} does not match the sha256 written with it (its files were "
                                           f"damaged or changed): {instead}")
    return restored, int(step)


def check_checkpoint_params(stored, params: dict, where: str) -> None:
    """Raises `hf_files.CheckpointError` unless a checkpoint's params metadata has `params`' tree and shapes.

    Checked before restoring, so that a checkpoint of another head (another method, width or
    draft vocabulary, written to the same output directory) is named as such.
    """
    shapes = lambda tree: {jax.tree_util.keystr(path): tuple(leaf.shape)
                           for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
    found, expected = shapes(stored), shapes(params)
    missing, extra = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    if missing or extra:
        raise hf_files.CheckpointError(
            f"{where} was written for another head: it lacks {len(missing)} of this head's parameter arrays "
            f"{missing[:3]} and has {len(extra)} others {extra[:3]}; give another output directory")
    differ = [f"{name} {found[name]} there, {expected[name]} here" for name in sorted(expected)
              if found[name] != expected[name]]
    if differ:
        raise hf_files.CheckpointError(f"{where} was written for another head: {'; '.join(differ[:3])}; "
                                       "give another output directory")
