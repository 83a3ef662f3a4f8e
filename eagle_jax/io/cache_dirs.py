"""The eagle_jax cache root, and the ownership and mode checks every part of it passes.

The cache holds what later processes trust without looking again: compiled executables
(`xla/`, which run when loaded) and converted models (`models/`, whose weights are served as
the model the user named). Whoever can write there decides what runs or what answers, so
every directory of it is created with mode 0700 and refused if another user owns it or
others may write to it, unless the sticky bit protects our entries (as in /tmp): then others
may add entries but not rename or replace ours, and whatever they add is owned by them and
so refused in turn. This defends against other local users; it cannot defend against code
running as the same user.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

ENV_VAR = "EAGLE_JAX_CACHE_DIR"


class CacheDirectoryError(ValueError):
    """A cache directory that others could have tampered with, or that cannot be used."""


def cache_root() -> Path:
    """The eagle_jax cache directory (not created here).

    `$EAGLE_JAX_CACHE_DIR` if set, else `$XDG_CACHE_HOME/eagle_jax`, else `~/.cache/eagle_jax`.
    """
    if directory := os.environ.get(ENV_VAR):
        return Path(directory).expanduser()
    xdg_cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg_cache).expanduser() / "eagle_jax"


def check_private(directory: Path, label: str, what: str = "cached content") -> None:
    """Raises CacheDirectoryError unless only this user can change what `directory` holds.

    Args:
        directory: an existing directory.
        label: how messages name the cache part, e.g. "compilation cache".
        what: what would be trusted from it, for the message ("compiled code").
    """
    try:
        info = directory.stat()
    except OSError as error:
        raise CacheDirectoryError(f"{label}: cannot read {directory} ({error.strerror})") from None
    if not stat.S_ISDIR(info.st_mode):
        raise CacheDirectoryError(f"{label}: {directory} is not a directory; set {ENV_VAR} to a directory")
    if info.st_uid != os.getuid():
        raise CacheDirectoryError(f"{label}: {directory} is owned by uid {info.st_uid}, not by this user "
                                  f"(uid {os.getuid()}); refusing to load {what} from it")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise CacheDirectoryError(f"{label}: {directory} is writable by other users "
                                  f"(mode {stat.S_IMODE(info.st_mode):o}); refusing to load {what} from it. "
                                  f"Run `chmod go-w {directory}` or choose another cache directory")


def make_private(directory: Path, label: str, what: str = "cached content") -> Path:
    """Creates `directory` (mode 0700, with its parents) unless it exists, then checks it.

    Raises:
        CacheDirectoryError: it cannot be created (a file is in the way, no permission, a
            read-only filesystem) or fails `check_private`.
    """
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        raise CacheDirectoryError(f"{label}: {directory} (or a parent) exists and is not a directory; "
                                  f"set {ENV_VAR} to a directory") from None
    except OSError as error:
        raise CacheDirectoryError(f"{label}: cannot create {directory} ({error.strerror}); set {ENV_VAR} "
                                  "to a writable directory") from None
    check_private(directory, label, what)
    return directory
