"""benchmarks/gpu_benchmark.sh: the sections it runs and their order, where the rows go, a failed
command noted while the rest still run, and a failed kernel check that stops everything."""

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_benchmark.sh"


def run(*args, python=None, cwd=None):
    env = dict(os.environ)
    if python:
        env["PYTHON"] = str(python)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, env=env,
                          cwd=cwd or REPO)


def commands(output: str) -> list[str]:
    return [line[2:] for line in output.splitlines() if line.startswith("+ ")]


def test_a_dry_run_prints_the_default_sections_in_order_with_rows_in_the_results_folder(tmp_path):
    results = tmp_path / "rows"
    done = run("--dry-run", "--results", str(results))
    assert done.returncode == 0, done.stderr
    ran = commands(done.stdout)
    assert [line.split()[1] for line in ran] == ["benchmarks/kernels_bench.py"] + ["benchmarks/eagle.py"] * 4 + [
        "benchmarks/hf_peers.py"]
    assert "--check" in ran[0].split() and f"--out {results}/kernels_check.json" in ran[0]
    assert "--method none,eagle,eagle3 --num_spec_tokens 1,2,3,4,5,6,7 --max_num_seqs 1" in ran[1]
    assert all(f"--out {results}/mtbench.json" in line for line in ran[1:])
    assert not results.exists()  # a dry run writes nothing


def test_a_head_of_ones_own_replaces_the_shipped_eagle3_head(tmp_path):
    head = tmp_path / "head"
    head.mkdir()
    done = run("--dry-run", "--draft", str(head), "--results", str(tmp_path), "batch1", "steps")
    ran = commands(done.stdout)
    assert "--method none,eagle3 " in ran[0] and ran[0].endswith(f"--draft {head}")
    assert "--draft" not in ran[1] and ran[2].split()[5:7] == ["eagle3", "--k"] and f"--draft {head}" in ran[2]
    assert run("--draft", str(tmp_path / "missing"), "batch1").returncode == 2


def test_an_unknown_section_names_the_sections(tmp_path):
    refused = run("--dry-run", "trees", "warp_speed")
    assert refused.returncode == 2 and refused.stdout == ""
    assert "error: unknown section warp_speed (sections: check batch1" in refused.stderr


def fake_python(tmp_path, failing: str) -> Path:
    """A stand-in interpreter that logs each script it is given and fails on `failing`."""
    log = tmp_path / "calls.txt"
    fake = tmp_path / "python"
    fake.write_text(f'#!/usr/bin/env bash\necho "$1" >> {log}\n[[ "$1" != *{failing} ]]\n')
    fake.chmod(0o755)
    return fake


def test_a_failed_command_is_reported_at_the_end_and_the_rest_still_run(tmp_path):
    done = run("--results", str(tmp_path / "rows"), "trees", "peers", "sampling",
               python=fake_python(tmp_path, "hf_peers.py"))
    assert done.returncode == 1
    assert (tmp_path / "calls.txt").read_text().split() == [
        "benchmarks/eagle.py", "benchmarks/hf_peers.py", "benchmarks/eagle.py"]
    assert "failed: " in done.stderr and "hf_peers.py --modes eager,static,prompt_lookup" in done.stderr
    assert (tmp_path / "rows").is_dir()


def test_a_failed_kernel_check_stops_the_run(tmp_path):
    done = run("--results", str(tmp_path / "rows"), python=fake_python(tmp_path, "kernels_bench.py"))
    assert done.returncode == 1 and "the kernel check failed" in done.stderr
    assert (tmp_path / "calls.txt").read_text().split() == ["benchmarks/kernels_bench.py"]
