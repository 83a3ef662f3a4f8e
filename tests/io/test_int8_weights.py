"""Int8 weight storage (`eagle_jax.int8_weights`) and `eagle-jax-convert --int8` for heads."""

import json

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from eagle_jax.io import checkpoint
from eagle_jax.io import hf_files
from eagle_jax.io import int8_weights
from eagle_jax.io import models

from tests.io.test_convert import run


def test_round_trip_moves_each_value_by_at_most_half_its_rows_step():
    rng = np.random.default_rng(0)
    weight = (rng.standard_normal((6, 10)) * np.array([[0.01], [1], [30], [0.5], [2], [1e-4]])).astype(np.float32)
    weight[3] = 0.0  # an all-zero row
    stored = int8_weights.quantize({"w.weight": weight.astype(ml_dtypes.bfloat16), "norm": np.ones(10)}, ["w.weight"])
    assert stored["w.weight"].dtype == np.int8 and stored["w.weight_scale"].shape == (6, 1)
    assert stored["norm"].dtype == np.float64  # untouched
    restored = int8_weights.dequantize(stored)
    assert set(restored) == {"w.weight", "norm"} and restored["w.weight"].dtype == np.float32
    step = np.abs(weight.astype(ml_dtypes.bfloat16).astype(np.float32)).max(axis=1, keepdims=True) / 127
    assert np.all(np.abs(restored["w.weight"] - weight) <= step / 2 + 0.004 * np.abs(weight))  # + bfloat16's rounding
    np.testing.assert_array_equal(restored["w.weight"][3], 0.0)
    assert np.abs(stored["w.weight"]).max(axis=1).tolist() == [127, 127, 127, 0, 127, 127]  # each row uses its range


def test_refuses_what_it_cannot_store():
    tensors = {"w.weight": np.ones((2, 3), np.float32), "norm": np.ones(3, np.float32), "d2t": np.zeros((2, 3), np.int64)}
    with pytest.raises(hf_files.CheckpointError, match="no tensor 'lm_head.weight'"):
        int8_weights.quantize(tensors, ["lm_head.weight"])
    for name in ("norm", "d2t"):
        with pytest.raises(hf_files.CheckpointError, match="only 2-D floating weights"):
            int8_weights.quantize(tensors, [name])
    bad = dict(int8_weights.quantize(tensors, ["w.weight"]), **{"w.weight_scale": np.ones((3, 1), np.float32)})
    with pytest.raises(hf_files.CheckpointError, match="one scale per row"):
        int8_weights.dequantize(bad)
    lone = {"w.weight": np.ones((2, 3), np.float32), "w.weight_scale": np.ones((2, 1), np.float32)}
    assert int8_weights.dequantize(lone) is lone  # no int8 partner: left for the name table to report


def test_convert_stores_a_heads_lm_head_as_int8_and_loads_it_widened(hf_llama, random_head, save_head, tmp_path, capsys):
    _, target_dir, target = hf_llama(seed=13)
    head = random_head(target.config, "eagle3", seed=4, draft_vocab_size=40)
    source = save_head(head, tmp_path / "head")
    dtype = json.loads((source / "config.json").read_text())["torch_dtype"]
    code, err = run(capsys, source, tmp_path / "int8", "--target", target_dir, "--int8", "lm_head.weight")
    assert code == 0, err
    original, written = hf_files.load_tensors(source), hf_files.load_tensors(tmp_path / "int8")
    assert set(written) == set(original) | {"lm_head.weight_scale"}
    assert written["lm_head.weight"].dtype == np.int8 and written["fc.weight"].dtype == original["fc.weight"].dtype
    assert (tmp_path / "int8" / "model.safetensors").stat().st_size < (source / "model.safetensors").stat().st_size

    # It loads as the same head with the lm_head widened from int8: every other parameter equal.
    loaded = checkpoint.flat_state(nnx.state(models.load_head(tmp_path / "int8", target)))
    plain = checkpoint.flat_state(nnx.state(models.load_head(source, target)))
    for path, value in plain.items():
        if path != "lm_head/kernel":
            np.testing.assert_array_equal(loaded[path], value)
    widened = written["lm_head.weight"].astype(np.float32) * written["lm_head.weight_scale"]
    np.testing.assert_array_equal(loaded["lm_head/kernel"], widened.T)
    assert np.abs(widened - original["lm_head.weight"].astype(np.float32)).max() > 0  # a lossy store, not a copy

    # Converted again without --int8 it is written in its own dtype, the layout vLLM reads.
    code, err = run(capsys, tmp_path / "int8", tmp_path / "plain", "--target", target_dir)
    assert code == 0, err
    back = hf_files.load_tensors(tmp_path / "plain")
    assert set(back) == set(original) and back["lm_head.weight"].dtype == original["lm_head.weight"].dtype
    np.testing.assert_array_equal(back["lm_head.weight"], widened.astype(original["lm_head.weight"].dtype))
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["torch_dtype"] == dtype


def test_convert_int8_errors_write_nothing(hf_llama, random_head, save_head, tmp_path, capsys):
    _, target_dir, target = hf_llama(seed=13)
    source = save_head(random_head(target.config, "eagle3", draft_vocab_size=40), tmp_path / "head")
    code, err = run(capsys, source, tmp_path / "out", "--target", target_dir, "--int8", "lm_head")
    assert code == 2 and "no tensor 'lm_head'" in err and "lm_head.weight" in err
    code, err = run(capsys, target_dir, tmp_path / "out", "--int8", "lm_head.weight")
    assert code == 2 and "EAGLE heads only" in err
    assert not (tmp_path / "out").exists() and "Traceback" not in err
