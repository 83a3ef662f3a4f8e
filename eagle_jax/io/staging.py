"""Writing a directory or file whole or not at all, and removing what interrupted writers left.

A writer works in a temporary `.<name>.tmp-<random>` beside its destination and renames it
into place as its last step (a rename within one filesystem is atomic), so a reader sees the
old state or the finished one, never a half-written one. While it works, the writer holds an
exclusive `flock` on the temporary; the lock dies with the process, so a temporary nobody
holds is the remains of a writer that was killed, and `remove_stale` deletes it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

from eagle_jax.io import hf_files

MARK = ".tmp-"
# A temporary is created a moment before it is locked: one younger than this is left alone.
_GRACE_SECONDS = 60.0
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# Raised inside a staged block, these can only be the writing failing, not a bad source.
_WRITE_FAILURES = (*_DISK_FULL, errno.EROFS)


def temporary_name(name: str) -> str:
    """The prefix of a temporary standing in for `name`."""
    return f".{name}{MARK}"


def lock(path: Path | int) -> int:
    """Takes the writer's exclusive lock on `path` (or an open descriptor); returns the descriptor."""
    handle = path if isinstance(path, int) else os.open(path, os.O_RDONLY)
    fcntl.flock(handle, fcntl.LOCK_EX)
    return handle


def remove_stale(directory: Path, prefix: str = ".") -> list[Path]:
    """Deletes the temporaries in `directory` that no live writer holds.

    Only this user's entries named `<prefix>...{MARK}...` and older than a minute are touched;
    one that cannot be removed (a read-only cache) is left as it is.

    Returns:
        The paths removed.
    """
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(prefix) or MARK not in entry.name:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
            if info.st_uid != os.getuid() or time.time() - info.st_mtime < _GRACE_SECONDS:
                continue
            path = Path(entry.path)
            if stat.S_ISLNK(info.st_mode):
                path.unlink()
                removed.append(path)
                continue
            handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live writer holds it
            os.close(handle)
            continue
        try:
            if stat.S_ISDIR(info.st_mode):
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path)
        except OSError:
            pass
        finally:
            os.close(handle)
    return removed


def write_error(error: OSError, destination: Path) -> hf_files.CheckpointError:
    """A clear error for a failed write of `destination` (a full disk, no permission, ...)."""
    if error.errno in _DISK_FULL:
        return hf_files.CheckpointError(
            f"no space left on the device holding {destination.parent} while writing {destination.name}; "
            "nothing was written there. Free some space or choose another output directory")
    reason = error.strerror or str(error)
    return hf_files.CheckpointError(f"cannot write {destination} ({reason}); nothing was written there")


@contextlib.contextmanager
def temporary_directory(parent: Path, name: str):
    """A fresh, locked `.<name>.tmp-*` directory in `parent`, removed on exit whatever happens."""
    remove_stale(parent, temporary_name(name))
    try:
        temporary = Path(tempfile.mkdtemp(prefix=temporary_name(name), dir=parent))
    except OSError as error:
        raise write_error(error, parent / name) from None
    handle = lock(temporary)
    try:
        yield temporary
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
        os.close(handle)


@contextlib.contextmanager
def staged_directory(destination: Path):
    """Yields a temporary directory that becomes `destination` when the block finishes.

    `destination` must not exist, or be an empty directory. If the block raises (or the
    process dies), nothing is left at `destination` and the temporary is gone (or, after a
    kill, removed by the next writer). A write that fails for want of space or permission is
    raised as a clear `CheckpointError`.

    Raises:
        FileExistsError: `destination` exists and is not an empty directory, now or at the end
            (another writer finished first).
    """
    destination = Path(destination)
    _check_free(destination)
    try:
        destination.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise write_error(error, destination) from None
    with temporary_directory(destination.parent, destination.name) as temporary:
        try:
            yield temporary
        except OSError as error:
            if error.errno in _WRITE_FAILURES:
                raise write_error(error, destination) from None
            raise
        try:
            _check_free(destination)
            os.rename(temporary, destination)  # replaces an empty directory, atomically
        except OSError as error:
            if isinstance(error, FileExistsError) or error.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise FileExistsError(f"{destination} already exists and is not an empty directory") from None
            raise write_error(error, destination) from None


def _check_free(destination: Path) -> None:
    if os.path.lexists(destination) and (not destination.is_dir() or destination.is_symlink()
                                         or any(destination.iterdir())):
        raise FileExistsError(f"{destination} already exists and is not an empty directory")


@contextlib.contextmanager
def staged_file(destination: Path):
    """Yields a locked temporary path beside `destination` that replaces it when the block finishes."""
    destination = Path(destination)
    remove_stale(destination.parent, temporary_name(destination.name))
    try:
        handle, temporary = tempfile.mkstemp(prefix=temporary_name(destination.name), dir=destination.parent)
    except OSError as error:
        raise write_error(error, destination) from None
    lock(handle)
    try:
        try:
            yield Path(temporary)
        except OSError as error:
            if error.errno in _WRITE_FAILURES:
                raise write_error(error, destination) from None
            raise
        try:
            os.replace(temporary, destination)
        except OSError as error:
            raise write_error(error, destination) from None
    finally:
        os.close(handle)
        if os.path.lexists(temporary):
            os.unlink(temporary)
