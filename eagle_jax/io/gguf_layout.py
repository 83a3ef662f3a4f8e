"""Checks a GGUF file's header against the file's size before anything trusts it.

gguf's reader takes every count, string length and offset in a header as given: one that lies
makes it index past the end of the file (an IndexError naming nothing) or misread what follows.
This walks the header once, as llama.cpp's `gguf.cpp` lays it out (little-endian v2/v3: tensor
and metadata counts, then key/type/value entries, then each tensor's name, dimensions, type and
offset, then aligned data), and says which count, length or tensor exceeds the file.
"""

import math
import mmap
import os
import struct

import gguf

from eagle_jax.io import hf_files

# GGUF metadata value types (gguf.GGUFValueType) and the bytes of each scalar one.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
# The fewest bytes a metadata entry (key length, empty key, type, one byte) and a tensor
# description (name length, empty name, no dimensions, type, offset) can take.
_MIN_ENTRY_BYTES, _MIN_TENSOR_BYTES = 13, 24
_MAX_DIMS = 4  # GGML_MAX_DIMS


def check(path):
    """Raises CheckpointError if a count, length or offset in a GGUF's header exceeds the file.

    Files that are not little-endian GGUF v2/v3 are left for gguf's reader to name.
    """
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size < 24:
            raise hf_files.CheckpointError(f"{path}: not a GGUF file (only {size} bytes)")
        data = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    with data:
        if data[:4] != b"GGUF" or struct.unpack_from("<I", data, 4)[0] not in (2, 3):
            return
        tensor_count, entry_count = struct.unpack_from("<QQ", data, 8)
        if tensor_count * _MIN_TENSOR_BYTES + entry_count * _MIN_ENTRY_BYTES > size - 24:
            raise hf_files.CheckpointError(
                f"{path}: the header claims {tensor_count} tensors and {entry_count} metadata entries, more than "
                f"a file of {size} bytes can describe (truncated or corrupt)")
        cursor = _Cursor(path, data, size)
        alignment = 32
        for index in range(entry_count):
            key = cursor.string(f"metadata entry {index}'s key").decode("utf-8", "replace")
            value_type = cursor.unpack("<I", f"the type of metadata {key!r}")
            start = cursor.position
            cursor.value(value_type, f"metadata {key!r}")
            if key == "general.alignment" and value_type == _UINT32:
                alignment = struct.unpack_from("<I", data, start)[0] or 32
        extents = []
        for index in range(tensor_count):
            name = cursor.string(f"tensor {index}'s name").decode("utf-8", "replace")
            num_dims = cursor.unpack("<I", f"tensor {name!r}'s dimension count")
            if num_dims > _MAX_DIMS:
                raise hf_files.CheckpointError(f"{path}: tensor {name!r} claims {num_dims} dimensions "
                                               f"(GGUF has at most {_MAX_DIMS}; corrupt)")
            dims = [cursor.unpack("<Q", f"tensor {name!r}'s dimensions") for _ in range(num_dims)]
            kind = cursor.unpack("<I", f"tensor {name!r}'s type")
            offset = cursor.unpack("<Q", f"tensor {name!r}'s offset")
            if kind in gguf.GGML_QUANT_SIZES:
                block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
                extents.append((name, offset, math.prod(dims) // block * block_bytes))
        data_start = -(-cursor.position // alignment) * alignment
        for name, offset, length in extents:
            if data_start + offset + length > size:
                raise hf_files.CheckpointError(
                    f"{path}: tensor {name!r} ({length} bytes at offset {data_start + offset}) extends past the end "
                    f"of the file ({size} bytes; truncated or corrupt)")


class _Cursor:
    """Reads a GGUF header forward, checking each length against the file before using it."""

    def __init__(self, path, data, size):
        self.path, self.data, self.size, self.position = path, data, size, 24

    def take(self, count, what):
        if count > self.size - self.position:
            raise hf_files.CheckpointError(
                f"{self.path}: {what} needs {count} bytes at offset {self.position}, which exceeds the file "
                f"({self.size} bytes; truncated or corrupt)")
        start = self.position
        self.position += count
        return start

    def unpack(self, layout, what):
        return struct.unpack_from(layout, self.data, self.take(struct.calcsize(layout), what))[0]

    def string(self, what):
        length = self.unpack("<Q", f"{what} length")
        start = self.take(length, f"{what} (a string of length {length})")
        return self.data[start:start + length]

    def value(self, value_type, what):
        if value_type in _SCALAR_SIZES:
            self.take(_SCALAR_SIZES[value_type], what)
        elif value_type == _STRING:
            self.string(what)
        elif value_type == _ARRAY:
            item_type = self.unpack("<I", f"{what}'s item type")
            count = self.unpack("<Q", f"{what}'s item count")
            if item_type in _SCALAR_SIZES:
                self.take(count * _SCALAR_SIZES[item_type], f"{what} ({count} items)")
            else:
                if count > self.size - self.position:  # every item takes a byte at least
                    raise hf_files.CheckpointError(
                        f"{self.path}: {what} claims {count} items, which exceeds the file ({self.size} bytes)")
                for _ in range(count):
                    self.value(item_type, what)
        else:
            raise hf_files.CheckpointError(f"{self.path}: {what} has unknown value type {value_type}")
