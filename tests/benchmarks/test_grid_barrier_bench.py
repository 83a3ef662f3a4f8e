"""benchmarks/grid_barrier_bench.py in interpret mode: a row per grid and spin, no wrong value, a time a barrier."""

import json

from tests.benchmarks import script


def test_a_row_per_grid(tmp_path):
    bench = script("grid_barrier_bench")
    out = tmp_path / "rows.json"
    assert bench.main(["--rounds", "3", "--repeats", "1", "--spin", "volatile,atomic", "--out", str(out)]) == 0
    assert bench.main(["--programs", "2", "--rounds", "3", "--repeats", "1", "--out", str(out)]) == 0
    *resident, refused = json.loads(out.read_text())
    assert [row["spin"] for row in resident] == ["volatile", "atomic"]
    for row in resident:
        assert row["programs"] == 1 and row["wrong_values"] == 0 and row["us_per_barrier"] > 0
    assert refused["programs"] == 2 and "programs must be in 1..1" in refused["error"]
