"""A persistent compilation cache with one subdirectory per compiled module.

JAX's own persistent cache is one flat directory for the whole process. vLLM found it needed a
separate cache for the draft head; here every module (prefill, decode, speculative step, draft
head) gets `<root>/<module>-<hash>/`, the hash covering what the caller says determines its
program (model configs, static options, argument shapes, dtypes and shardings), jax and jaxlib
versions, the backend, and the device mesh (axes, sizes, device kind and ids; the executable
is bound to those devices). Inside, each entry is named by the hash of the code the program is
traced from (`program_identity.code_identity`: eagle_jax's source, the model classes, versions
and jax's settings), so a change to any of it writes a new entry; a directory keeps the four
entries last written or loaded. Looking an entry up needs no tracing or lowering: on a warm
start a program is loaded without being built at all. Removing one module's directory
recompiles only that module.

Threat model: loading an entry runs it. `serialize_executable.deserialize_and_load` unpickles
the entry and the executable inside is machine code, so whoever can write an entry that passes
our check can run code in every later process using the cache. A checksum stops corruption but
not an attacker, who simply recomputes it. So entries are `MAGIC + MAC + payload`, the MAC an
HMAC-SHA256 over the entry's name and payload under a secret key kept in `<root>/key` (32
random bytes, created with mode 0600, refused if another user owns it or others may read or
write it). Nothing is unpickled before the MAC verifies. The root and every module directory
pass the checks every part of the cache root passes (`eagle_jax.io.cache_dirs`: mode 0700,
refused with `CompileCacheError` if another user owns them or others may write to them,
unless the sticky bit protects our files, as in /tmp). This defends against other local users
and against entries copied in from elsewhere; it cannot defend against code running as the
same user, which can read the key. (JAX's own persistent cache avoids pickle but not this:
its entries are unauthenticated executables too.)

Entries are written to a locked temporary file then renamed, so two processes filling the same
cache leave only complete entries, and the temporaries of killed processes (no longer locked)
are removed when a cache is first used (`eagle_jax.io.staging`). A corrupt or truncated entry
(or one signed with another key) fails its MAC, is reported as a warning, and is rebuilt
without being unpickled. Two processes creating the key at once agree on one: each writes a
complete temporary file and hard-links it into place, which fails for all but the first, and
the others read the first one's key.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import pickle
import secrets
import stat
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Callable

import jax
import jaxlib
from jax.experimental import serialize_executable

from eagle_jax.io import cache_dirs
from eagle_jax.io import staging

MAGIC = b"EAGLEJAX-XLA-3\n"
ENV_VAR = "EAGLE_JAX_CACHE_DIR"
KEY_NAME = "key"
KEY_BYTES = 32
MAC_LENGTH = 64  # hex digits of HMAC-SHA256
KEEP_ENTRIES = 4  # per module directory: versions of the code whose executables stay (`_prune`)


LABEL = "compilation cache"
TEMPORARY_PREFIX = ".tmp-"


class CompileCacheError(cache_dirs.CacheDirectoryError):
    """A cache directory or key file that others could have tampered with, or that cannot be used."""


def default_root() -> Path:
    """`$EAGLE_JAX_CACHE_DIR/xla`, else under the user's cache directory."""
    return cache_dirs.cache_root() / "xla"


def _digest(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def _mac(key: bytes, name: str, payload: bytes) -> bytes:
    """HMAC-SHA256 (hex) binding the payload to its `<module dir>/<entry>` name."""
    signed = hmac.new(key, MAGIC + name.encode() + b"\0", hashlib.sha256)
    signed.update(payload)
    return signed.hexdigest().encode()


def _entry_name(entry: Path) -> str:
    return f"{entry.parent.name}/{entry.name}"


def _check_directory(directory: Path) -> None:
    """Raises CompileCacheError unless only we can change what `directory` holds."""
    try:
        cache_dirs.check_private(directory, LABEL, "compiled code")
    except cache_dirs.CacheDirectoryError as error:
        raise CompileCacheError(str(error)) from None


def _make_directory(directory: Path) -> None:
    try:
        cache_dirs.make_private(directory, LABEL, "compiled code")
    except cache_dirs.CacheDirectoryError as error:
        raise CompileCacheError(f"{error} (or pass --no-compile-cache)") from None


def remove_stale_temporaries(root: Path) -> list[Path]:
    """Removes the temporary entries and keys that killed processes left under `root`."""
    removed = staging.remove_stale(root, TEMPORARY_PREFIX)
    try:
        module_dirs = [path for path in root.iterdir() if path.is_dir() and not path.is_symlink()]
    except OSError:  # unreadable: then nothing is loaded from it either
        return removed
    for module_dir in module_dirs:
        removed += staging.remove_stale(module_dir, TEMPORARY_PREFIX)
    return removed


def _read_key(path: Path) -> bytes | None:
    """The key in `path`, None if there is none; CompileCacheError if it is not ours alone."""
    try:
        handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as error:  # ELOOP: a symbolic link
        raise CompileCacheError(f"compilation cache: cannot open key file {path}: {error}") from error
    with os.fdopen(handle, "rb") as file:
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise CompileCacheError(f"compilation cache: key file {path} is not a regular file owned by this user")
        # A key others could read may be known to them; tightening the mode now would not
        # undo that, so refuse rather than fix it.
        if info.st_mode & 0o077:
            raise CompileCacheError(f"compilation cache: key file {path} is accessible to other users "
                                    f"(mode {stat.S_IMODE(info.st_mode):o}); delete it (the cache is then "
                                    f"recompiled under a new key)")
        key = file.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise CompileCacheError(f"compilation cache: key file {path} holds {len(key)} bytes, not {KEY_BYTES}; "
                                f"delete it (the cache is then recompiled under a new key)")
    return key


def _load_or_create_key(root: Path) -> bytes:
    path = root / KEY_NAME
    key = _read_key(path)
    if key is not None:
        return key
    # mkstemp opens with O_CREAT | O_EXCL and mode 0600. The key is complete on disk before it
    # is linked into place, so no reader can see a partial key, and link (unlike rename) fails
    # if another process linked its key first: then we use theirs.
    try:
        handle, temporary = tempfile.mkstemp(dir=root, prefix=TEMPORARY_PREFIX + "key-")
    except OSError as error:
        raise CompileCacheError(f"{LABEL}: cannot create the key file in {root} ({error.strerror}); choose a "
                                "writable --cache-dir or pass --no-compile-cache") from None
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(secrets.token_bytes(KEY_BYTES))
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass
    finally:
        os.unlink(temporary)
    key = _read_key(path)
    if key is None:
        raise CompileCacheError(f"compilation cache: key file {path} vanished while it was being created")
    return key


def _prune(module_dir: Path) -> None:
    """Keeps a module directory's `KEEP_ENTRIES` most recently written or loaded entries.

    Each version of the code writes its own entry (`entry_path`), so without this every edit of
    the package would leave a full set of executables behind. A process that loses an entry to
    another's pruning compiles the program again."""
    entries = []
    for path in module_dir.glob("*.xla"):
        with contextlib.suppress(FileNotFoundError):
            entries.append((path.stat().st_mtime, path))
    for _, path in sorted(entries, reverse=True)[KEEP_ENTRIES:]:
        path.unlink(missing_ok=True)


def mesh_identity(mesh: jax.sharding.Mesh) -> str:
    """The mesh as key text: axis names and sizes, device kind and ids."""
    devices = list(mesh.devices.flat)
    axes = ",".join(f"{name}={size}" for name, size in mesh.shape.items())
    return f"mesh {axes} {devices[0].device_kind} {[device.id for device in devices]}"


class CompileCache:
    """Compiles lowered programs, reusing executables saved by earlier processes.

    Args:
        root: cache directory; None disables persistence (compile every time). It is created
            (mode 0700) and checked on the first compilation, which raises CompileCacheError
            if others could write to it or read its key.
        mesh: the `jax.sharding.Mesh` the programs are partitioned over, None for one device.
        code: `program_identity.code_identity` of the models the programs are traced from (with
            the key each program is given, it must determine the program); None (code that
            cannot be identified) disables persistence as root=None does.
    """

    def __init__(self, root: str | Path | None, mesh: jax.sharding.Mesh | None = None, *, code: str | None):
        self.root = Path(root).expanduser() if root is not None and code is not None else None
        self.mesh, self.code = mesh, code
        self.hits = 0
        self.misses = 0
        self._key: bytes | None = None
        self._lock = threading.Lock()  # `compile` runs on several threads at once (`Compiler.compiling`)

    def module_dir(self, module: str, key: str) -> Path:
        device = jax.devices()[0]
        # XLA_FLAGS change the executable but not the program text, so they belong in the key.
        parts = [key, jax.__version__, jaxlib.__version__, device.platform, device.device_kind,
                 os.environ.get("XLA_FLAGS", "")]
        if self.mesh is not None:  # one device keeps the keys it always had
            parts.append(mesh_identity(self.mesh))
        identity = "|".join(parts)
        return self.root / f"{module}-{_digest(identity)[:16]}"

    def entry_path(self, module: str, key: str) -> Path:
        """Where the executable of the program `key` describes is stored (arguments as `load`)."""
        return self.module_dir(module, key) / f"{_digest(self.code)[:32]}.xla"

    def secret_key(self) -> bytes:
        """The root's HMAC key, creating the root and the key on first use."""
        with self._lock:
            if self._key is None:
                _make_directory(self.root)
                self._key = _load_or_create_key(self.root)
                remove_stale_temporaries(self.root)
            return self._key

    def stored(self, module: str, key: str) -> bool:
        """Whether an entry for this program exists (it may still fail to load)."""
        return self.root is not None and self.entry_path(module, key).is_file()

    def load(self, module: str, key: str):
        """The saved executable of this program, None if there is none or it is unreadable
        (then it is removed, with a warning).

        Args:
            module: short module name, the directory prefix (e.g. "speculative-eagle3-k5").
            key: text describing everything besides the code that the program depends on.

        Raises:
            CompileCacheError: the root or the module's directory is writable by others or
                owned by another user, or the key file is not private to this user.
        """
        if not self.stored(module, key):
            return None
        entry = self.entry_path(module, key)
        compiled = self._load(entry, self.secret_key(), self.devices())
        if compiled is not None:
            self._count(hit=True)
            with contextlib.suppress(OSError):  # a read-only cache still loads
                os.utime(entry)  # in use: the newest entries are the ones `_prune` keeps
        return compiled

    def compile(self, module: str, key: str, lowered):
        """Compiles the `jax.stages.Lowered` program `key` describes and saves it (arguments as `load`)."""
        self._count(hit=False)
        compiled = lowered.compile()
        if self.root is None:
            return compiled
        secret, entry = self.secret_key(), self.entry_path(module, key)
        try:
            payload = pickle.dumps(serialize_executable.serialize(compiled))  # the executable and its pytrees
            self._write(entry, payload, secret)
            _prune(entry.parent)
        except CompileCacheError:
            raise
        except Exception as error:  # a backend that cannot serialise still runs, uncached
            warnings.warn(f"compilation cache: could not save {entry}: {error}")
        return compiled

    def load_or_compile(self, module: str, key: str, lower: Callable[[], object]) -> tuple[object, float]:
        """Returns (executable, seconds spent loading or lowering and compiling); `lower` builds
        the `jax.stages.Lowered` program, called only when nothing loads."""
        began = time.perf_counter()
        compiled = self.load(module, key)
        if compiled is None:
            compiled = self.compile(module, key, lower())
        return compiled, time.perf_counter() - began

    def _count(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self.hits += 1
            else:
                self.misses += 1

    def devices(self) -> list:
        """The devices the programs run on, in the order they were compiled for.

        A loaded executable is bound to exactly these: left to its default (every device of the
        backend), a one-device program on a host of several fails at its first call.
        """
        return list(self.mesh.devices.flat) if self.mesh is not None else [jax.local_devices()[0]]

    @staticmethod
    def _load(entry: Path, secret: bytes, devices: list):
        _check_directory(entry.parent)
        try:
            blob = entry.read_bytes()
        except FileNotFoundError:
            return None
        try:
            if not blob.startswith(MAGIC):
                raise ValueError("bad header")
            mac, payload = blob[len(MAGIC):len(MAGIC) + MAC_LENGTH], blob[len(MAGIC) + MAC_LENGTH:]
            # Authenticate before unpickling: unpickling an entry from anyone else runs their code.
            if not hmac.compare_digest(mac, _mac(secret, _entry_name(entry), payload)):
                raise ValueError("MAC mismatch (truncated, corrupt, or not written with this cache's key)")
            executable, in_tree, out_tree = pickle.loads(payload)
            return serialize_executable.deserialize_and_load(executable, in_tree, out_tree, execution_devices=devices)
        except Exception as error:
            warnings.warn(f"compilation cache: discarding unreadable entry {entry}: {error}; recompiling")
            entry.unlink(missing_ok=True)
            return None

    @staticmethod
    def _write(entry: Path, payload: bytes, secret: bytes) -> None:
        entry.parent.mkdir(mode=0o700, exist_ok=True)  # an OSError here (read-only cache) is only a warning
        _check_directory(entry.parent)
        handle, temporary = tempfile.mkstemp(dir=entry.parent, prefix=TEMPORARY_PREFIX)
        try:
            staging.lock(handle)  # held until the file is complete: until then no cleaner removes it
            with os.fdopen(handle, "wb") as file:
                file.write(MAGIC + _mac(secret, _entry_name(entry), payload) + payload)
            os.replace(temporary, entry)  # atomic: readers see the old entry or the whole new one
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
