"""benchmarks/call_overhead.py: a row per buffer count and steps a call."""

import json

from tests.benchmarks import script


def test_a_row_per_setting(tmp_path):
    bench = script("call_overhead")
    out = tmp_path / "rows.json"
    assert bench.main(["--buffers", "1:1,3:2", "--kernels", "2", "--steps", "1,4", "--calls", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(row["params"], row["state"], row["steps"]) for row in rows] == [(1, 1, 1), (1, 1, 4), (3, 2, 1), (3, 2, 4)]
    assert all(row["us_per_call"] > 0 for row in rows)
