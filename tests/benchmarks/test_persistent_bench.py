"""benchmarks/persistent_bench.py on a tiny random target: a row per kernel, the two steps agreeing."""

import json

from tests.benchmarks import script
from tests.conftest import hf_config_dict


def test_rows_compare_the_persistent_kernel_with_the_fused_kernels(tmp_path):
    bench = script("persistent_bench")
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict()))
    out = tmp_path / "rows.json"
    assert bench.main(["--random-target", str(tmp_path / "config.json"), "--dtype", "float32", "--cache-length", "64",
                       "--position", "20", "--steps", "3", "--repeats", "1", "--part-slots", "16", "--rows", "4,auto",
                       "--out", str(out)]) == 0
    fused, *persistent = json.loads(out.read_text())
    assert fused["kernel"] == "fused kernels" and fused["us_per_call"] > 0
    assert [row["rows"] for row in persistent] == [4, None]
    assert persistent[1]["work"] == dict(qkv=64, o=32, gate_up=64, down=32)  # one program: one item a stage
    for row in persistent:
        assert "error" not in row and row["programs"] == 1  # interpret mode runs one program
        assert row["same_next_token"] and row["max_abs_difference"] < 1e-4 * row["reference_max_abs"] + 1e-5


def test_skipped_stages_are_rows_of_their_own(tmp_path):
    """--skip all times the barriers alone: its row says so and its step is not the model's."""
    bench = script("persistent_bench")
    (tmp_path / "config.json").write_text(json.dumps(hf_config_dict()))
    out = tmp_path / "rows.json"
    assert bench.main(["--random-target", str(tmp_path / "config.json"), "--dtype", "float32", "--cache-length", "64",
                       "--position", "20", "--steps", "2", "--repeats", "1", "--part-slots", "16",
                       "--spin", "atomic", "--skip", "none,all", "--out", str(out)]) == 0
    _, whole, barriers_only = json.loads(out.read_text())
    assert whole["skip"] == [] and whole["spin"] == "atomic" and whole["max_abs_difference"] < 1e-4
    assert barriers_only["skip"] == ["qkv", "attend", "o", "gate_up", "down"] and "skip qkv+attend" in barriers_only["kernel"]
    assert barriers_only["max_abs_difference"] > 1e-2
