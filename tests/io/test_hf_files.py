"""Tests for eagle_jax.hf_files: safetensors and pytorch_model.bin readers."""

import json
import os
import sys

import ml_dtypes
import numpy as np
import pytest
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


def test_tensor_names_read_an_index_or_headers_only(tmp_path):
    """`tensor_names` lists a checkpoint's tensors from its index or its headers: a shard whose data
    is cut short (which `load_tensors` refuses) still lists."""
    tensors = sample_tensors()
    names = sorted(tensors)
    write_sharded(tmp_path, {"model-00001-of-00002.safetensors": {name: tensors[name] for name in names[:3]},
                             "model-00002-of-00002.safetensors": {name: tensors[name] for name in names[3:]}})
    shard = tmp_path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(hf_files.CheckpointError):
        hf_files.load_tensors(tmp_path, progress=False)
    assert sorted(hf_files.tensor_names(tmp_path)) == names
    (tmp_path / "model.safetensors.index.json").unlink()  # no index: each file's header
    assert sorted(hf_files.tensor_names(tmp_path)) == names
    assert hf_files.tensor_names(shard) == names[3:]


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
