"""Tests for eagle_jax.hf_files: safetensors and pytorch_model.bin readers."""

import json
import os
import pathlib
import sys

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy

from eagle_jax.io import hf_files


def sample_tensors():
    rng = np.random.default_rng(0)
    return {
        "model.embed_tokens.weight": rng.standard_normal((8, 4)).astype(np.float32),
        "model.norm.weight": rng.standard_normal(4).astype(np.float16),
        "lm_head.weight": rng.standard_normal((8, 4)).astype(ml_dtypes.bfloat16),
        "d2t": np.arange(5, dtype=np.int64),
        "t2d": np.array([True, False, True]),
        "scalar": np.array(3.5, dtype=np.float32),
    }


def assert_same(loaded, expected):
    assert set(loaded) == set(expected)
    for name, array in expected.items():
        assert loaded[name].dtype == array.dtype and loaded[name].shape == array.shape, name
        np.testing.assert_array_equal(loaded[name].astype(np.float64), array.astype(np.float64))


def write_sharded(directory, shards, index_name="model.safetensors.index.json"):
    """Saves {shard file: tensors} plus an index mapping every key to its shard."""
    weight_map = {}
    for shard_name, tensors in shards.items():
        hf_files.save_tensors(tensors, directory / shard_name)
        weight_map.update(dict.fromkeys(tensors, shard_name))
    (directory / index_name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_single_file_round_trip_including_bfloat16(tmp_path):
    tensors = sample_tensors()
    hf_files.save_tensors(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    assert_same(hf_files.load_tensors(tmp_path), tensors)
    assert os.listdir(tmp_path) == ["model.safetensors"]  # no temporary file left


def test_files_interoperate_with_the_safetensors_library(tmp_path):
    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.ones(3, np.int32)}
    hf_files.save_tensors(tensors, tmp_path / "ours.safetensors")
    assert_same(safetensors.numpy.load_file(tmp_path / "ours.safetensors"), tensors)
    safetensors.numpy.save_file(tensors, tmp_path / "theirs.safetensors")
    assert_same(hf_files.load_tensors(tmp_path / "theirs.safetensors"), tensors)


def test_sharded_safetensors_round_trip(tmp_path):
    tensors = sample_tensors()
    names = sorted(tensors)
    write_sharded(tmp_path, {
        "model-00001-of-00002.safetensors": {name: tensors[name] for name in names[:3]},
        "model-00002-of-00002.safetensors": {name: tensors[name] for name in names[3:]},
    })
    assert_same(hf_files.load_tensors(tmp_path, progress=False), tensors)


def test_tensor_names_and_shapes_read_an_index_or_headers_only(tmp_path, monkeypatch):
    """`tensor_names` and `tensor_shapes` list a checkpoint's tensors from its index or headers: with the
    library's reader (which reads data) out of order, they still list."""
    tensors = sample_tensors()
    names = sorted(tensors)
    write_sharded(tmp_path, {"model-00001-of-00002.safetensors": {name: tensors[name] for name in names[:3]},
                             "model-00002-of-00002.safetensors": {name: tensors[name] for name in names[3:]}})
    shard = tmp_path / "model-00002-of-00002.safetensors"

    def no_data(*args, **kwargs):
        raise AssertionError("tensor data was read")

    monkeypatch.setattr(hf_files.safetensors, "safe_open", no_data)
    assert sorted(hf_files.tensor_names(tmp_path)) == names
    shapes = hf_files.tensor_shapes(tmp_path)
    assert shapes["lm_head.weight"] == ((8, 4), "BF16") and shapes["scalar"] == ((), "F32")
    (tmp_path / "model.safetensors.index.json").unlink()  # no index: each file's header
    assert sorted(hf_files.tensor_names(tmp_path)) == names
    assert sorted(hf_files.tensor_names(shard)) == names[3:]
    with pytest.raises(hf_files.CheckpointError, match="tensor data was read"):
        hf_files.load_tensors(tmp_path, progress=False)


def test_missing_shard_is_named(tmp_path):
    write_sharded(tmp_path, {"model-00001-of-00002.safetensors": {"a": np.zeros(2, np.float32)},
                             "model-00002-of-00002.safetensors": {"b": np.zeros(2, np.float32)}})
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(hf_files.CheckpointError, match="model-00002-of-00002.safetensors"):
        hf_files.load_tensors(tmp_path)


def test_duplicate_key_across_shards_is_named(tmp_path):
    hf_files.save_tensors({"a": np.zeros(2, np.float32), "dup": np.zeros(1)}, tmp_path / "one.safetensors")
    hf_files.save_tensors({"dup": np.ones(1)}, tmp_path / "two.safetensors")
    with pytest.raises(hf_files.CheckpointError, match="dup"):
        hf_files.load_tensors(tmp_path, progress=False)


def test_index_key_absent_from_shards_is_named(tmp_path):
    write_sharded(tmp_path, {"model-00001-of-00001.safetensors": {"a": np.zeros(2, np.float32)}})
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    index["weight_map"]["ghost"] = "model-00001-of-00001.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(hf_files.CheckpointError, match="ghost"):
        hf_files.load_tensors(tmp_path)


def test_corrupt_safetensors_is_named(tmp_path):
    hf_files.save_tensors({"weight": np.zeros((4, 4), np.float32)}, tmp_path / "model.safetensors")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-8])  # truncated
    with pytest.raises(hf_files.CheckpointError, match="model.safetensors.*'weight'"):
        hf_files.load_tensors(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(hf_files.CheckpointError, match="model.safetensors"):
        hf_files.load_tensors(tmp_path)


def test_empty_directory_and_config_errors(tmp_path):
    with pytest.raises(hf_files.CheckpointError, match="no .*weights"):
        hf_files.load_tensors(tmp_path)
    with pytest.raises(hf_files.CheckpointError, match="config.json not found"):
        hf_files.load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(hf_files.CheckpointError, match="invalid JSON"):
        hf_files.load_config(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    assert hf_files.load_config(tmp_path) == {"hidden_size": 8}


def test_pytorch_bin_with_plain_tensors(tmp_path):
    torch = pytest.importorskip("torch")
    state = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
             "b": torch.tensor([1.5, -2.25], dtype=torch.bfloat16)}
    torch.save(state, tmp_path / "pytorch_model.bin")
    loaded = hf_files.load_tensors(tmp_path)
    assert_same(loaded, {"a": np.arange(6, dtype=np.float32).reshape(2, 3),
                         "b": np.array([1.5, -2.25], dtype=ml_dtypes.bfloat16)})


def test_sharded_pytorch_bin(tmp_path):
    torch = pytest.importorskip("torch")
    weight_map = {"a": "pytorch_model-00001-of-00002.bin", "b": "pytorch_model-00002-of-00002.bin"}
    for name, shard in weight_map.items():
        torch.save({name: torch.ones(2)}, tmp_path / shard)
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert set(hf_files.load_tensors(tmp_path, progress=False)) == {"a", "b"}


class MarkerPayload:
    """A pickle that would create a file if it were ever unpickled unsafely."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_pytorch_bin_with_code_is_refused_and_not_executed(tmp_path):
    torch = pytest.importorskip("torch")
    marker = tmp_path / "executed"
    torch.save({"a": torch.ones(2), "evil": MarkerPayload(str(marker))}, tmp_path / "pytorch_model.bin")
    with pytest.raises(hf_files.CheckpointError, match="refusing to unpickle.*not plain tensors"):
        hf_files.load_tensors(tmp_path)
    assert not marker.exists()


def test_pytorch_bin_with_non_tensor_values_is_refused(tmp_path):
    torch = pytest.importorskip("torch")
    torch.save({"a": torch.ones(2), "step": 7}, tmp_path / "pytorch_model.bin")
    with pytest.raises(hf_files.CheckpointError, match="not plain tensors.*'step'"):
        hf_files.load_tensors(tmp_path)


def test_missing_torch_gives_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "pytorch_model.bin").write_bytes(b"unused")
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch now fails
    with pytest.raises(hf_files.CheckpointError, match="needs torch"):
        hf_files.load_tensors(tmp_path)


# ---- hostile and broken files: each refused with the file or tensor named ----

def raw_safetensors(path, header: bytes, data: bytes):
    """A safetensors file with a header written by hand (what no writer would produce)."""
    header += b" " * (-len(header) % 8)
    path.write_bytes(len(header).to_bytes(8, "little") + header + data)
    return path


def test_a_key_twice_in_one_header_is_refused(tmp_path):
    # JSON parsers keep the last of two equal keys; the second entry here is valid on its own.
    header = (b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
              b'"w":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}')
    raw_safetensors(tmp_path / "model.safetensors", header, np.array([1, 2], np.float32).tobytes())
    for read in (hf_files.load_tensors, hf_files.tensor_names, hf_files.tensor_shapes):
        with pytest.raises(hf_files.CheckpointError, match=r"model.safetensors: duplicate key 'w'"):
            read(tmp_path)
    header = b'{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    raw_safetensors(tmp_path / "model.safetensors", header, np.array([1], np.float32).tobytes())
    with pytest.raises(hf_files.CheckpointError, match="duplicate key 'w'"):  # identical twins too
        hf_files.load_tensors(tmp_path)


def test_a_key_twice_in_an_index_is_refused(tmp_path):
    write_sharded(tmp_path, {"a.safetensors": {"a": np.zeros(2, np.float32)}, "b.safetensors": {"b": np.ones(2)}})
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "a.safetensors", "a": "b.safetensors", "b": "b.safetensors"}}')
    with pytest.raises(hf_files.CheckpointError, match="model.safetensors.index.json: duplicate key 'a'"):
        hf_files.load_tensors(tmp_path)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "../../etc/passwd", "/etc/passwd", "link.safetensors",
                                   "sub/../../outside.safetensors"])
def test_an_index_naming_a_shard_outside_the_directory_is_refused(tmp_path, shard):
    model = tmp_path / "model"
    model.mkdir()
    hf_files.save_tensors({"b": np.ones(2, np.float32)}, tmp_path / "outside.safetensors")
    (model / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")  # a link leading out
    write_sharded(model, {"a.safetensors": {"a": np.zeros(2, np.float32)}})
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "a.safetensors", "b": shard}}))
    for read in (hf_files.load_tensors, hf_files.tensor_names):
        with pytest.raises(hf_files.CheckpointError, match="outside|not a file name inside"):
            read(model)


def test_weight_files_linking_out_are_refused_but_a_hub_snapshot_loads(tmp_path):
    hf_files.save_tensors({"a": np.ones(2, np.float32)}, tmp_path / "elsewhere.safetensors")
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(hf_files.CheckpointError, match="leads outside the model directory"):
        hf_files.load_tensors(model)
    # huggingface_hub's cache: snapshots/<revision>/<file> -> ../../blobs/<hash>
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / "abc").mkdir(parents=True)
    hf_files.save_tensors({"a": np.ones(2, np.float32)}, repo / "blobs" / "0123")
    (repo / "snapshots" / "abc" / "model.safetensors").symlink_to("../../blobs/0123")
    assert set(hf_files.load_tensors(repo / "snapshots" / "abc")) == {"a"}


def test_a_symlink_loop_is_named_not_a_traceback(tmp_path):
    (tmp_path / "model.safetensors").symlink_to(tmp_path / "model.safetensors")
    with pytest.raises(hf_files.CheckpointError, match="model.safetensors: cannot be opened"):
        hf_files.load_tensors(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "config.json").symlink_to(tmp_path / "config.json")
    with pytest.raises(hf_files.CheckpointError, match="config.json: cannot be read"):
        hf_files.load_config(tmp_path)


def test_fp8_tensors_are_refused_by_name(tmp_path):
    raw_safetensors(tmp_path / "model.safetensors", b'{"q":{"dtype":"F8_E4M3","shape":[2],"data_offsets":[0,2]}}',
                    b"\x00\x00")
    with pytest.raises(hf_files.CheckpointError, match="tensor 'q' is F8_E4M3; fp8 weights are not supported"):
        hf_files.load_tensors(tmp_path)


def test_a_full_disk_while_saving_leaves_the_old_file(tmp_path, monkeypatch):
    import errno

    tensors = {"a": np.ones(3, np.float32)}
    hf_files.save_tensors(tensors, tmp_path / "model.safetensors")

    def disk_full(tensors, filename, metadata=None):
        pathlib.Path(filename).write_bytes(b"partial")
        raise safetensors.SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(hf_files.safetensors.numpy, "save_file", disk_full)
    with pytest.raises(hf_files.CheckpointError, match="no space left on the device") as error:
        hf_files.save_tensors({"a": np.zeros(3, np.float32)}, tmp_path / "model.safetensors")
    assert isinstance(error.value.__context__, OSError) and error.value.__context__.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == ["model.safetensors"]  # no temporary left ...
    monkeypatch.undo()
    assert_same(hf_files.load_tensors(tmp_path), tensors)  # ... and the earlier file intact


def test_transposed_views_are_saved_as_their_values(tmp_path):
    # The library writes an array's memory as it lies; a transposed view must not come out scrambled.
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    hf_files.save_tensors({"t": array.T}, tmp_path / "model.safetensors")
    np.testing.assert_array_equal(hf_files.load_tensors(tmp_path)["t"], array.T)
