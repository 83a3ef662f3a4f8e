"""Reads and writes Hugging Face weight files as numpy arrays.

Framework-neutral on purpose: everything here returns plain numpy arrays so
that the same readers serve the JAX loaders, the converters and the tests.
Safetensors files are parsed directly (an 8-byte header length, a JSON header,
then raw little-endian bytes) rather than through `safetensors.numpy`, because
that loader cannot represent bfloat16 in older releases, and parsing ourselves
lets every error name the file and key at fault.
"""

import json
import math
import mmap
import os
import pathlib
import pickle

import ml_dtypes
import numpy as np
import tqdm


class CheckpointError(ValueError):
    """A checkpoint file or directory is missing, malformed or unsafe."""


# Safetensors dtype codes and their numpy equivalents; bfloat16 and the fp8
# types come from ml_dtypes, the extension types JAX itself uses.
_SAFETENSORS_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_DTYPE_CODES = {dtype: code for code, dtype in _SAFETENSORS_DTYPES.items()}

# A header larger than this is not a real safetensors file (the reference
# implementation uses the same 100 MB bound) and would only waste memory.
_MAX_HEADER_BYTES = 100_000_000


def load_config(directory):
    """Reads `config.json` from a checkpoint directory.

    Args:
        directory: Path of a Hugging Face checkpoint directory.

    Returns:
        The parsed configuration as a dict.

    Raises:
        CheckpointError: If the file is missing or is not a JSON object.
    """
    path = pathlib.Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: config.json not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{path}: invalid JSON ({error})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return config


def load_tensors(directory, progress=True):
    """Reads every tensor of a Hugging Face checkpoint.

    Looks, in order, for a sharded safetensors index, `model.safetensors`,
    any `*.safetensors`, a sharded `pytorch_model.bin` index and
    `pytorch_model.bin`. A path to a single weight file is also accepted.

    Args:
        directory: Checkpoint directory, or one `.safetensors`/`.bin` file.
        progress: Show a progress bar when there is more than one file.

    Returns:
        Tensor name to numpy array. Safetensors arrays are read-only views of
        a memory map, so a large checkpoint is paged in only as it is used.

    Raises:
        CheckpointError: If no weights are found, a shard named by an index is
            missing, a key appears twice, or a file is malformed or unsafe.
    """
    files, index_keys = _weight_files(pathlib.Path(directory))
    tensors = {}
    bar = tqdm.tqdm(files, desc="Loading weights", unit="file",
                    disable=not progress or len(files) < 2)
    for path in bar:
        reader = _read_safetensors if path.suffix == ".safetensors" else _read_torch
        for name, array in reader(path).items():
            if name in tensors:
                raise CheckpointError(f"{path}: duplicate tensor key {name!r}")
            tensors[name] = array
    for name in index_keys:
        if name not in tensors:
            raise CheckpointError(
                f"{directory}: index names tensor {name!r} but no shard holds it")
    return tensors


def tensor_names(directory):
    """The tensor names of a Hugging Face checkpoint, reading as little as it can.

    An index's weight map names them without opening a shard, and a
    safetensors file's header does without its data; a `pytorch_model.bin`
    has no header, so it is loaded whole.

    Args:
        directory: Checkpoint directory, or one `.safetensors`/`.bin` file.

    Returns:
        The names, in file order.

    Raises:
        CheckpointError: As `load_tensors`, for what it reads.
    """
    files, index_keys = _weight_files(pathlib.Path(directory))
    if index_keys:
        return index_keys
    names = []
    for path in files:
        names += list(_safetensors_header(path)[0] if path.suffix == ".safetensors" else _read_torch(path))
    return names


def save_tensors(tensors, path, metadata=None):
    """Writes tensors to one safetensors file (bfloat16 via ml_dtypes too).

    The file is written beside its destination and renamed into place, so a
    reader never sees a half-written file.

    Args:
        tensors: Tensor name to numpy array.
        path: Destination `.safetensors` path.
        metadata: Optional dict of string to string, stored as `__metadata__`.
    """
    path = pathlib.Path(path)
    header, arrays, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {str(key): str(value) for key, value in metadata.items()}
    for name in sorted(tensors):
        array = np.asarray(tensors[name])
        code = _DTYPE_CODES.get(array.dtype.newbyteorder("="))
        if code is None:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {array.dtype}")
        # Safetensors is little-endian by definition.
        array = array.astype(array.dtype.newbyteorder("<"), order="C", copy=False)
        header[name] = {"dtype": code, "shape": list(array.shape),
                        "data_offsets": [offset, offset + array.nbytes]}
        arrays.append(array)
        offset += array.nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    # Pad with spaces so the data starts 8-byte aligned, as the reference writer does.
    header_bytes += b" " * (-len(header_bytes) % 8)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as file:
            file.write(len(header_bytes).to_bytes(8, "little"))
            file.write(header_bytes)
            for array in arrays:
                array.reshape(-1).view(np.uint8).tofile(file)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def _weight_files(directory):
    """Returns (files to read, keys an index promises) for a checkpoint path."""
    if directory.is_file():
        return [directory], []
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    if (directory / "model.safetensors.index.json").exists():
        return _indexed_files(directory / "model.safetensors.index.json")
    if (directory / "model.safetensors").exists():
        return [directory / "model.safetensors"], []
    if found := sorted(directory.glob("*.safetensors")):
        return found, []
    if (directory / "pytorch_model.bin.index.json").exists():
        return _indexed_files(directory / "pytorch_model.bin.index.json")
    if (directory / "pytorch_model.bin").exists():
        return [directory / "pytorch_model.bin"], []
    raise CheckpointError(f"{directory}: no *.safetensors or pytorch_model.bin weights found")


def _indexed_files(index_path):
    """Reads a sharded-checkpoint index; every shard it names must exist."""
    try:
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        shard_names = list(dict.fromkeys(weight_map.values()))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{index_path}: invalid index ({error!r})") from None
    shards = [index_path.parent / name for name in shard_names]
    for shard in shards:
        if not shard.is_file():
            raise CheckpointError(f"{index_path}: shard {shard.name} is missing")
    return shards, list(weight_map)


def _safetensors_header(path):
    """(tensor name to header entry, where the data starts) of one safetensors file."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        header_length = int.from_bytes(file.read(8), "little")
        if size < 8 or header_length > min(_MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{path}: not a safetensors file (bad header length)")
        try:
            header = json.loads(file.read(header_length))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise CheckpointError(f"{path}: invalid safetensors header ({error})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return header, 8 + header_length


def _read_safetensors(path):
    """Parses one safetensors file into read-only memory-mapped arrays."""
    size = path.stat().st_size
    header, data_start = _safetensors_header(path)
    with open(path, "rb") as file:
        # Arrays keep the mapping alive; pages load only when a tensor is used.
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    tensors = {}
    for name, entry in header.items():
        try:
            dtype = _SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(int(dimension) for dimension in entry["shape"])
            begin, end = (int(offset) for offset in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(f"{path}: bad header entry for tensor {name!r} ({error!r})") from None
        if end - begin != math.prod(shape) * dtype.itemsize or begin < 0 or data_start + end > size:
            raise CheckpointError(f"{path}: tensor {name!r} has inconsistent data offsets")
        tensors[name] = np.frombuffer(mapped, dtype=dtype.newbyteorder("<"), count=math.prod(shape),
                                      offset=data_start + begin).reshape(shape)
    return tensors


def _read_torch(path):
    """Loads a `pytorch_model.bin`, refusing anything but plain tensors."""
    try:
        import torch  # Optional: only legacy .bin checkpoints need it.
    except ImportError:
        raise CheckpointError(f"{path}: reading .bin checkpoints needs torch (pip install torch)") from None
    try:
        # weights_only=True makes torch's unpickler reject any global that is
        # not a tensor building block, so a hostile pickle is never executed.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        # torch's message advises weights_only=False; keep only the reason.
        reasons = [line for line in str(error).splitlines() if "GLOBAL" in line]
        raise CheckpointError(f"{path}: refusing to unpickle; not plain tensors "
                              f"({' '.join(reasons) or 'rejected by the safe loader'})") from None
    except Exception as error:  # torch raises many types for a corrupt file.
        raise CheckpointError(f"{path}: unreadable torch checkpoint ({error!r})") from error
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: refusing to unpickle; not plain tensors (got {type(state).__name__})")
    tensors = {}
    for name, tensor in state.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise CheckpointError(f"{path}: refusing to unpickle; not plain tensors (key {name!r})")
        tensors[name] = _torch_to_numpy(tensor, torch)
    return tensors


def _torch_to_numpy(tensor, torch):
    """Converts a CPU torch tensor to numpy, keeping bfloat16/fp8 bit-exact."""
    tensor = tensor.detach().contiguous()
    # numpy has no bfloat16 or fp8: reinterpret the bits through an integer
    # carrier of the same width, then view them as the ml_dtypes type.
    bit_views = {torch.bfloat16: (torch.int16, ml_dtypes.bfloat16),
                 torch.float8_e4m3fn: (torch.uint8, ml_dtypes.float8_e4m3fn),
                 torch.float8_e5m2: (torch.uint8, ml_dtypes.float8_e5m2)}
    if tensor.dtype in bit_views:
        carrier, numpy_dtype = bit_views[tensor.dtype]
        return tensor.view(carrier).numpy().view(numpy_dtype)
    return tensor.numpy()
