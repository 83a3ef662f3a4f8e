"""Reads and writes Hugging Face weight files as numpy arrays.

Framework-neutral on purpose: everything here returns plain numpy arrays so that the same
readers serve the JAX loaders, the converters and the tests. Safetensors files go through the
`safetensors` library (bfloat16 via ml_dtypes); its header is also parsed here, cheaply, for
what the library does not check: a key given twice (JSON keeps the last silently) and offsets
named by tensor. Everything a directory names must lie inside it: an index naming
`../../etc/x`, an absolute path or a symbolic link that leads out is refused.
"""

import json
import math
import os
import pathlib
import pickle
import re
import stat

import ml_dtypes
import numpy as np
import safetensors
import safetensors.numpy
import tqdm

from eagle_jax.io import staging


class CheckpointError(ValueError):
    """A checkpoint file or directory is missing, malformed or unsafe."""


# What the safetensors dtype codes hold, for header checks (the library maps them to numpy).
_ITEM_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
               "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
_SAVED_DTYPES = {np.dtype(dtype) for dtype in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16, np.int64,
                                               np.int32, np.int16, np.int8, np.uint64, np.uint32, np.uint16,
                                               np.uint8, np.bool_)}

# A header larger than this is not a real safetensors file (the reference implementation
# uses the same 100 MB bound) and would only waste memory; a config.json likewise.
_MAX_HEADER_BYTES = 100_000_000
_MAX_CONFIG_BYTES = 16_000_000


def load_config(directory):
    """Reads `config.json` from a checkpoint directory.

    Args:
        directory: Path of a Hugging Face checkpoint directory.

    Returns:
        The parsed configuration as a dict.

    Raises:
        CheckpointError: If the file is missing, unreadable or is not a JSON object.
    """
    path = pathlib.Path(directory) / "config.json"
    if not os.path.lexists(path):
        raise CheckpointError(f"{path}: config.json not found")
    config = _read_json(path, _MAX_CONFIG_BYTES)
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return config


def load_tensors(directory, progress=True):
    """Reads every tensor of a Hugging Face checkpoint.

    Looks, in order, for a sharded safetensors index, `model.safetensors`, any
    `*.safetensors`, a sharded `pytorch_model.bin` index and `pytorch_model.bin`. A path to
    a single weight file is also accepted.

    Args:
        directory: Checkpoint directory, or one `.safetensors`/`.bin` file.
        progress: Show a progress bar when there is more than one file.

    Returns:
        Tensor name to numpy array.

    Raises:
        CheckpointError: If no weights are found, a shard named by an index is missing or
            outside the directory, a key appears twice, or a file is malformed or unsafe.
    """
    return _merge_files(directory, _read_weight_file, progress)


def tensor_shapes(directory):
    """Tensor name to (shape, safetensors dtype code), from headers only where there are any.

    A safetensors file's header describes its tensors without its data, so a config can be
    checked against a checkpoint before anything large is read or built; a
    `pytorch_model.bin` has no header, so it is loaded whole.

    Args:
        directory: Checkpoint directory, or one `.safetensors`/`.bin` file.

    Raises:
        CheckpointError: As `load_tensors`, for what it reads.
    """
    def described(path):
        if path.suffix == ".safetensors":
            return {name: (tuple(entry["shape"]), entry["dtype"]) for name, entry in _header(path)[0].items()}
        return {name: (array.shape, array.dtype.name) for name, array in _read_torch(path).items()}

    return _merge_files(directory, described)


def tensor_names(directory):
    """The tensor names of a Hugging Face checkpoint, reading as little as it can.

    An index's weight map names them without opening a shard, and a safetensors file's
    header does without its data; a `pytorch_model.bin` has no header, so it is loaded whole.

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
        names += list(_header(path)[0] if path.suffix == ".safetensors" else _read_torch(path))
    return names


def save_tensors(tensors, path, metadata=None):
    """Writes tensors to one safetensors file (bfloat16 via ml_dtypes too).

    The file is written beside its destination and renamed into place, so a reader never
    sees a half-written file.

    Args:
        tensors: Tensor name to numpy array.
        path: Destination `.safetensors` path.
        metadata: Optional dict of string to string, stored as `__metadata__`.

    Raises:
        CheckpointError: A tensor's dtype has no safetensors code, or the write failed (a
            full disk: nothing is left at `path`).
    """
    path = pathlib.Path(path)
    arrays = {}
    for name, array in tensors.items():
        array = np.asarray(array)
        if array.dtype.newbyteorder("=") not in _SAVED_DTYPES:
            raise CheckpointError(f"{path}: tensor {name!r} has unsupported dtype {array.dtype}")
        # The library writes each array's memory as it lies: a transposed view would come out
        # scrambled, so every array is made contiguous (and little-endian, as the format is).
        arrays[name] = np.asarray(array, dtype=array.dtype.newbyteorder("<"), order="C")
    metadata = {str(key): str(value) for key, value in metadata.items()} if metadata else None
    with staging.staged_file(path) as temporary:
        try:
            safetensors.numpy.save_file(arrays, temporary, metadata=metadata)
        except safetensors.SafetensorError as error:
            # The library reports I/O failures as its own error: give them back their errno,
            # so that a full disk reads as one.
            if code := re.search(r"os error (\d+)", str(error)):
                raise OSError(int(code.group(1)), os.strerror(int(code.group(1))), str(path)) from None
            raise CheckpointError(f"{path}: cannot write safetensors ({error})") from None


def _merge_files(directory, read, progress=False):
    """`read(path)` (tensor name to anything) of each weight file of a checkpoint, merged into one dict.

    A name in two files is an error rather than the later file's silently winning, and every
    name an index promises must be found.
    """
    files, index_keys = _weight_files(pathlib.Path(directory))
    merged = {}
    bar = tqdm.tqdm(files, desc="Loading weights", unit="file", disable=not progress or len(files) < 2)
    for path in bar:
        for name, value in read(path).items():
            if name in merged:
                raise CheckpointError(f"{path}: duplicate tensor key {name!r}")
            merged[name] = value
    _check_index_keys(directory, index_keys, merged)
    return merged


def _read_weight_file(path):
    """Tensor name to numpy array of one `.safetensors` or `pytorch_model.bin` file."""
    return _read_safetensors(path) if path.suffix == ".safetensors" else _read_torch(path)


def _check_index_keys(directory, index_keys, found):
    for name in index_keys:
        if name not in found:
            raise CheckpointError(f"{directory}: index names tensor {name!r} but no shard holds it")


def _weight_files(path):
    """Returns (files to read, keys an index promises) for a checkpoint path."""
    if path.is_file():
        return [_inside(path.parent, path)], []
    if not path.is_dir():
        if os.path.lexists(path):
            _inside(path.parent, path)  # a symbolic link loop, say, is named as one
        raise CheckpointError(f"{path}: no such checkpoint directory")
    for index_name in ("model.safetensors.index.json", None, "pytorch_model.bin.index.json"):
        if index_name is None:  # no safetensors index: a single file or any *.safetensors
            if os.path.lexists(path / "model.safetensors"):
                return [_inside(path, path / "model.safetensors")], []
            if found := sorted(path.glob("*.safetensors")):
                return [_inside(path, file) for file in found], []
        elif os.path.lexists(path / index_name):
            return _indexed_files(path, path / index_name)
    if os.path.lexists(path / "pytorch_model.bin"):
        return [_inside(path, path / "pytorch_model.bin")], []
    raise CheckpointError(f"{path}: no *.safetensors or pytorch_model.bin weights found")


def _inside(directory, path):
    """`path`, checked to be a regular file that resolves inside `directory`.

    A Hugging Face hub snapshot links each file to `../../blobs/<hash>`; that folder counts as
    inside a snapshot directory.
    """
    try:
        real = path.resolve(strict=True)
    except RuntimeError as error:  # Python < 3.13 reports a symbolic link loop so
        raise CheckpointError(f"{path}: cannot be opened ({error})") from None
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be opened ({error.strerror or error})") from None
    allowed = [directory.resolve()]
    if directory.resolve().parent.name == "snapshots":
        allowed.append(directory.resolve().parent.parent / "blobs")
    if not any(real.is_relative_to(root) for root in allowed):
        raise CheckpointError(f"{path}: leads outside the model directory {directory} (to {real}); refusing to read it")
    if not stat.S_ISREG(real.stat().st_mode):
        raise CheckpointError(f"{path}: not a regular file")
    return path


def _indexed_files(directory, index_path):
    """Reads a sharded-checkpoint index; every shard it names must exist inside the directory."""
    index = _read_json(_inside(directory, index_path), _MAX_HEADER_BYTES)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(value, str) for value in weight_map.values()):
        raise CheckpointError(f"{index_path}: invalid index (no weight_map of tensor name to shard file name)")
    shards = []
    for name in dict.fromkeys(weight_map.values()):
        relative = pathlib.PurePosixPath(name)
        if not name or relative.is_absolute() or pathlib.PureWindowsPath(name).is_absolute() or "\\" in name \
                or ".." in relative.parts:
            raise CheckpointError(f"{index_path}: shard {name!r} is not a file name inside {directory}; refusing it")
        shard = directory / name
        if not os.path.lexists(shard):
            raise CheckpointError(f"{index_path}: shard {name} is missing")
        shards.append(_inside(directory, shard))
    return shards, list(weight_map)


def _read_json(path, limit):
    """Parses a JSON file of at most `limit` bytes; a key given twice in one object is an error."""
    try:
        with open(path, "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise CheckpointError(f"{path}: not a regular file")
            data = file.read(limit + 1)
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read ({error.strerror or error})") from None
    if len(data) > limit:
        raise CheckpointError(f"{path}: larger than {limit} bytes; not a configuration file")
    return _parse_json(path, data)


def _parse_json(path, data):
    def unique(pairs):
        result = {}
        for key, value in pairs:
            if key in result:
                raise CheckpointError(f"{path}: duplicate key {key!r}")
            result[key] = value
        return result

    try:
        return json.loads(data, object_pairs_hook=unique)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
        raise CheckpointError(f"{path}: invalid JSON ({error})") from None


def _header(path):
    """(tensor name to header entry, metadata) of one safetensors file, checked entry by entry."""
    try:
        with open(path, "rb") as file:
            size = os.fstat(file.fileno()).st_size
            header_length = int.from_bytes(file.read(8), "little")
            if size < 8 or header_length > min(_MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"{path}: not a safetensors file (bad header length)")
            header = _parse_json(path, file.read(header_length))
    except OSError as error:
        raise CheckpointError(f"{path}: cannot be read ({error.strerror or error})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    data_size = size - 8 - header_length
    for name, entry in header.items():
        try:
            shape = tuple(entry["shape"])
            begin, end = entry["data_offsets"]
            item_size = _ITEM_SIZES[entry["dtype"]]
            valid = all(type(value) is int and value >= 0 for value in (*shape, begin, end))
        except (KeyError, TypeError, ValueError) as error:
            raise CheckpointError(f"{path}: bad header entry for tensor {name!r} ({error!r})") from None
        if not valid or end - begin != math.prod(shape) * item_size or end > data_size:
            raise CheckpointError(f"{path}: tensor {name!r} has inconsistent data offsets")
    return header, metadata


def _read_safetensors(path):
    """Reads one safetensors file through the library, after checking its header here."""
    header, _ = _header(path)
    tensors, name = {}, None
    try:
        with safetensors.safe_open(path, framework="np") as file:
            for name in header:
                if header[name]["dtype"].startswith("F8"):  # numpy has no fp8 for the library to return
                    raise CheckpointError(f"{path}: tensor {name!r} is {header[name]['dtype']}; fp8 weights are "
                                          "not supported (their scales have no conversion rule)")
                tensors[name] = file.get_tensor(name)
    except CheckpointError:
        raise
    except Exception as error:  # the library raises its own error type
        where = "header" if name is None else f"tensor {name!r}"
        raise CheckpointError(f"{path}: cannot read {where} ({error})") from None
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
