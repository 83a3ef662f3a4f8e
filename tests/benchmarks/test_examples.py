"""The benchmark scripts: a missing optional package or data file is one `error:` line, status 2; the
benchmark records the schedulers it is asked to compare and expands its tree option lists; the
plots read only default-setting rows into the method comparison, draw the tree sweep and the
newest serving-setting rows of each batch size and scheduler; the 8B-shaped timing runs several
steps per call."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from eagle_jax.train import data
from tests.cli.test_generate_cli import model_dir  # noqa: F401 (a fixture: a tiny converted model with a chat template)

REPO = Path(__file__).resolve().parents[2]


def test_eagle_without_mtbench_names_the_install_command(tmp_path):
    # A stand-in MT-Bench package without its question file, first on the path, hides any installed copy.
    package, _, requirement = data.MTBENCH_FILE
    (tmp_path / "site" / package).mkdir(parents=True)
    (tmp_path / "site" / package / "__init__.py").write_text("")
    env = {name: value for name, value in os.environ.items() if name != "EAGLE_JAX_MTBENCH"}
    env.update(PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(REPO)]),
               EAGLE_JAX_CACHE_DIR=str(tmp_path / "cache"))
    # The model path does not exist: questions read after loading the model would report that instead.
    command = [sys.executable, str(REPO / "benchmarks" / "eagle.py"), "--model", str(tmp_path / "missing"),
               "--out", str(tmp_path / "rows.json")]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: ") and f"pip install --no-deps {requirement}" in last_line
    assert not (tmp_path / "rows.json").exists() and not (tmp_path / "cache").exists()


def test_eagle_tree_lists_run_every_valid_combination(capsys):
    sys.path.append(str(REPO / "benchmarks"))  # the example's helper modules
    import importlib

    example = importlib.import_module("eagle")
    args = example.parse_args(["--speculative_eagle_topk", "1,2", "--speculative_num_steps", "2,3",
                               "--speculative_num_draft_tokens", "3,6"])
    valid = [(tree.topk, tree.num_steps, tree.num_draft_tokens) for tree in args.trees]
    # topk 1 is a chain (N = num_steps); N ranges from num_steps to topk + (num_steps - 1) * topk^2.
    assert valid == [(1, 3, 3), (2, 2, 3), (2, 2, 6), (2, 3, 3), (2, 3, 6)]
    skipped = capsys.readouterr().err
    assert "skipping tree (1, 2, 3)" in skipped and "skipping tree (1, 3, 6)" in skipped
    with pytest.raises(SystemExit):
        example.parse_args(["--speculative_eagle_topk", "2"])
    assert "trees need all of" in capsys.readouterr().err


def test_eagle_reads_an_attention_tiling_or_names_its_fields(capsys):
    sys.path.append(str(REPO / "benchmarks"))
    import importlib

    from eagle_jax.kernels import decode_attention

    example = importlib.import_module("eagle")
    args = example.parse_args(["--decode_kernels", "pallas", "--attention_tiling", "256/8/3/4"])
    assert args.attention_tiling == decode_attention.Tiling(block_s=256, num_warps=8, splits=4)
    assert example.parse_args([]).attention_tiling is None
    with pytest.raises(SystemExit):
        example.parse_args(["--attention_tiling", "256/8"])
    assert "--attention_tiling: a tiling is block_s/num_warps/num_stages/splits" in capsys.readouterr().err


def test_eagle_records_both_schedulers(model_dir, tmp_path, capsys, monkeypatch):
    """One run, two rows: the same prompts and tokens through static batches and through decode
    slots, each row with its scheduler, time to first token and latency percentiles."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import eagle as eagle_script

    questions = tmp_path / "question.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "writing", "turns": [text]}) + "\n"
                                 for i, text in enumerate(["write a poem", "the sea", "a short poem about the sky"])))
    out = tmp_path / "rows.json"
    code = eagle_script.main(["--model", str(model_dir), "--dataset", str(questions), "--method", "none",
                              "--num_prompts", "3", "--max_new_tokens", "5", "--max_num_seqs", "2", "--dtype",
                              "float32", "--scheduler", "continuous,static", "--cache-dir", "none", "--steps_per_call",
                              "2", "--trace", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    rows = json.loads(out.read_text())
    assert [row["scheduler"] for row in rows] == ["continuous", "static"]
    # --trace: a second, traced run of the same prompts says which programs kept the device busy.
    modules = [{m["module"] for m in row["trace"]["modules"]} for row in rows]
    assert {"jit__start_rows", "jit__insert", "jit__run"} <= modules[0]  # slots: prefill, insert, step loop
    assert {"jit__start", "jit__run"} <= modules[1] and "jit__insert" not in modules[1]
    for row in rows:
        assert row["trace"]["device"] == "cpu" and 0 < row["trace"]["busy_seconds"] <= row["trace"]["wall_seconds"]
        assert all(0 <= m["busy_seconds"] <= row["trace"]["busy_seconds"] + 1e-4 for m in row["trace"]["modules"])
    for row in rows:
        assert row["batch_size"] == 2 and row["num_prompts"] == 3 and row["output_tokens_per_second"] > 0
        assert 0 < row["ttft_ms_p50"] / 1000 <= row["latency_s_p50"] <= row["latency_s_p90"] <= row["wall_seconds"]
        assert 1 <= row["run_calls"] < row["device_calls"] and row["syncs"] >= row["run_calls"]
        # The environment's XLA flags change the programs, so the row says which ran (conftest sets some).
        assert row["xla_flags"] == os.environ["XLA_FLAGS"] and "matmul_precision" not in row  # None: left out
    assert rows[0]["total_tokens"] == rows[1]["total_tokens"]


def test_eagle_ignore_eos_generates_every_budget(model_dir, tmp_path, capsys):
    """--ignore_eos: each prompt generates max_new_tokens, as serve_bench.py asks a server, where
    without it a row stops at EOS; the rows say which."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import eagle as eagle_script

    questions = tmp_path / "question.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "writing", "turns": [text]}) + "\n"
                                 for i, text in enumerate(["write a poem", "the sea"])))
    out = tmp_path / "rows.json"
    flags = ["--model", str(model_dir), "--dataset", str(questions), "--method", "none", "--num_prompts", "2",
             "--max_new_tokens", "40", "--max_num_seqs", "2", "--dtype", "float32", "--scheduler", "continuous",
             "--cache-dir", "none", "--steps_per_call", "8", "--out", str(out)]
    assert eagle_script.main(flags) == 0 and eagle_script.main(flags + ["--ignore_eos"]) == 0, capsys.readouterr().err
    stopping, ignoring = json.loads(out.read_text())[-2:]
    assert not stopping["ignore_eos"] and stopping["total_tokens"] < 2 * 40  # this model reaches EOS early
    assert ignoring["ignore_eos"] and ignoring["total_tokens"] == 2 * 40


def test_prompts_past_the_dataset_come_round_again(monkeypatch):
    """--num_prompts above the questions' count takes them again in order (several passes, so a
    large batch measures its steady state rather than its tail); below it, the first ones."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import eagle as eagle_script
    questions = [{"turns": [f"q{i}", "second"], "category": f"c{i}"} for i in range(3)]
    assert eagle_script.first_turns(questions, 7) == (["q0", "q1", "q2", "q0", "q1", "q2", "q0"],
                                                      ["c0", "c1", "c2", "c0", "c1", "c2", "c0"])
    assert eagle_script.first_turns(questions, 2) == (["q0", "q1"], ["c0", "c1"])


def test_acceptance_is_pooled_per_category(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import types
    import eagle as eagle_script

    result = lambda drafts, accepted: types.SimpleNamespace(stats=dict(
        num_drafts=drafts, num_accepted_tokens=accepted, acceptance_rate_per_position=[accepted / drafts, 0.0]))
    results = [result(2, 2), result(1, 1), result(2, 0)]
    by_category = eagle_script.acceptance_by_category(results, ["math", "coding", "math"], k=2)
    assert by_category == {"coding": 2.0, "math": 1.5}  # math: 1 + 2 accepted / 4 drafts, pooled
    assert eagle_script.acceptance_by_category(results, ["math"] * 3, k=0) is None
    with pytest.raises(ValueError):
        eagle_script.acceptance_by_category(results, ["math"], k=2)


def mtbench_row(method, k, tokens_per_second, acceptance, **settings):
    return dict(method=method, k=k, mode="compiled", batch_size=1, temperature=0.0, max_new_tokens=256,
                num_prompts=80, output_tokens_per_second=tokens_per_second, acceptance_length=acceptance,
                acceptance_rate_per_position=[0.5] * k, device="NVIDIA H200", dtype="bfloat16", **settings)


def trained(when):
    """A `head` field as the result files name a head: when its training ended (UTC) and its commit."""
    return f"EAGLE-3 trained {when} UTC, commit 0000000"


def test_plots_compare_default_settings_and_draw_the_tree_sweep(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import plot_results
    rows = [mtbench_row("none", 0, 800.0, 1.0), mtbench_row("eagle3", 5, 1400.0, 2.1),
            # Later rows of other settings must not replace the default ones in the comparison.
            mtbench_row("none", 0, 700.0, 1.0, decode_kernels="pallas"),
            mtbench_row("none", 0, 150.0, 1.0, tensor_parallel_size=2),
            mtbench_row("none", 0, 990.0, 1.0, xla_flags="--xla_gpu_enable_command_buffer=+WHILE"),
            mtbench_row("none", 0, 995.0, 1.0, decode_kernels="pallas", steps_per_check=8),
            # The newest head's row stands, though an older head was measured after it.
            mtbench_row("eagle3", 5, 1900.0, 2.9, head=trained("2026-11-30 22:25"), date="2026-11-30T22:06:00"),
            mtbench_row("eagle3", 5, 1850.0, 2.8, head=trained("2026-11-30 19:55"), date="2026-11-30T22:14:00"),
            # A newer head with no trees yet, exported to the same path: its chain is not the trees' chain.
            mtbench_row("eagle3", 5, 1950.0, 3.0, head=trained("2026-12-01 01:34"), draft="/root/stage/run/eagle3/head",
                        date="2026-12-01T10:00:00"),
            # A newer head that was not shipped never replaces a shipped head's row.
            mtbench_row("eagle3", 5, 1990.0, 2.95, head=trained("2026-12-01 04:39"), shipped=False, date="2026-12-01T15:00:00")]
    rows += [mtbench_row("eagle3", 5, 1300.0 + n, 2.5 + n / 100, speculative_eagle_topk=topk, speculative_num_steps=5,
                         speculative_num_draft_tokens=n, head=trained("2026-11-30 22:25"), draft="/root/stage/run/eagle3/head",
                         date="2026-11-30T22:10:00")
             for topk in (4, 8) for n in (16, 32)]
    # The trees' head measured again in a later window: the chain beside the trees stays their window's.
    rows.append(mtbench_row("eagle3", 5, 1800.0, 2.7, head=trained("2026-11-30 22:25"), date="2026-12-02T00:33:00+00:00"))
    # An older head's tree, measured later at a setting the newest head lacks, stays out of the sweep.
    rows.append(mtbench_row("eagle3", 5, 1000.0, 2.0, speculative_eagle_topk=4, speculative_num_steps=5,
                            speculative_num_draft_tokens=64, head=trained("2026-11-30 19:55"), date="2026-11-30T23:00:00"))
    # A later window's repeat of one tree shape does not patch the widest window's sweep.
    rows.append(mtbench_row("eagle3", 5, 2050.0, 4.06, speculative_eagle_topk=4, speculative_num_steps=5,
                            speculative_num_draft_tokens=16, head=trained("2026-11-30 22:25"), draft="/root/stage/run/eagle3/head",
                            date="2026-12-02T14:07:35+00:00"))
    # The newest head's tree on other decode kernels is another setting: it stays out too.
    rows.append(mtbench_row("eagle3", 5, 1100.0, 2.7, speculative_eagle_topk=4, speculative_num_steps=5,
                            speculative_num_draft_tokens=16, head=trained("2026-11-30 22:25"), decode_kernels="pallas_linear"))
    results = tmp_path / "mtbench.json"
    results.write_text(json.dumps(rows))
    drawn, sweeps = [], []
    monkeypatch.setattr(plot_results, "plot_otps", lambda batch1, plain, peers, sub, out: drawn.append((batch1, plain)))
    draw_trees = plot_results.plot_trees
    monkeypatch.setattr(plot_results, "plot_trees", lambda *args: (sweeps.append(args[:3]), draw_trees(*args)))
    assert plot_results.main(["--results", str(results), "--profile", str(tmp_path / "none.json"),
                              "--scaling", str(tmp_path / "none.json"), "--out-dir", str(tmp_path)]) == 0
    [(batch1, plain_beside_k)] = drawn
    # Chains on XLA's or Pallas' kernels (the batch-1 sweeps ran on both); plain decoding on either.
    assert sorted((r["method"], r["output_tokens_per_second"]) for r in batch1) == [
        ("eagle3", 1950.0), ("none", 700.0), ("none", 800.0)]
    [(trees, chains, plain)] = sweeps
    assert sorted((r["speculative_num_draft_tokens"], r["output_tokens_per_second"]) for r in trees) == [
        (16, 1316.0), (16, 1316.0), (32, 1332.0), (32, 1332.0)]
    # Beside the trees: the chain, and plain decoding with any kernels on one device (the fastest is drawn).
    assert [(r["method"], r["head"], r["output_tokens_per_second"]) for r in chains] == [("eagle3", trained("2026-11-30 22:25"), 1900.0)]
    assert sorted(r["output_tokens_per_second"] for r in plain) == [700.0, 800.0]
    assert plain_beside_k == plain
    assert (tmp_path / "tree_sweep.png").stat().st_size > 0
    assert not (tmp_path / "data_scaling.png").exists()  # no scaling rows given


def test_plain_decoding_beside_a_curve_comes_from_the_curves_window():
    """A plain-decoding line beside one measurement window's curve is that window's, or the nearest
    window's: a faster plain run of a later window (new kernels) would shrink a speedup nothing measured."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import plot_results
    then = mtbench_row("none", 0, 923.0, 1.0, date="2026-12-02T07:10:00+00:00")
    later = mtbench_row("none", 0, 1170.0, 1.0, date="2026-12-02T15:58:00+00:00")
    curve = [mtbench_row("eagle3", k, 2000.0 + k, 3.0, date=f"2026-12-02T07:{20 + k}:00+00:00") for k in (5, 6)]
    assert plot_results.of_nearest_window([then, later], curve) == [then]
    earlier = mtbench_row("none", 0, 900.0, 1.0, date="2026-12-02T02:10:00+00:00")
    assert plot_results.of_nearest_window([earlier, later], curve) == [earlier]  # none in the curve's window: the nearest
    assert plot_results.of_nearest_window([then, later], [mtbench_row("eagle3", 6, 2000.0, 3.0)]) == [then, later]


def test_a_k_sweep_comes_from_one_window():
    """Acceptance moves from one measurement window to the next: a method's curve is the window with
    the most k values of its newest head, not each k's latest row."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import plot_results
    first = [mtbench_row("eagle3", k, 1500.0 + k, 2.0 + k / 10, head=trained("2026-12-02 00:36"), date=f"2026-12-02T00:2{k}:00")
             for k in range(1, 8)]
    second = [mtbench_row("eagle3", k, 1400.0 + k, 1.9 + k / 10, head=trained("2026-12-02 00:36"), date=f"2026-12-02T02:5{k}:00")
              for k in (5, 6)]
    older_head = [mtbench_row("eagle3", k, 1000.0, 1.5, head=trained("2026-12-01 12:22"), date="2026-12-01T12:00:00") for k in range(1, 9)]
    plain = mtbench_row("none", 0, 900.0, 1.0, date="2026-12-02T02:50:00")
    rows = first + second + older_head + [plain]
    shown = plot_results.latest_of_newest_head(rows)
    chosen = plot_results.one_window_sweeps(shown, rows)
    assert sorted((r["k"], r["acceptance_length"]) for r in chosen if r["method"] == "eagle3") == [
        (r["k"], r["acceptance_length"]) for r in first]
    assert [r for r in chosen if r["method"] == "none"] == [plain]
    # A later window that measured every k as well is the newer sweep.
    again = [dict(r, date=r["date"].replace("T00:2", "T05:1"), acceptance_length=3.0) for r in first]
    chosen = plot_results.one_window_sweeps(plot_results.latest_of_newest_head(rows + again), rows + again)
    assert {r["acceptance_length"] for r in chosen if r["method"] == "eagle3"} == {3.0}


def test_a_k_sweep_is_drawn_on_one_set_of_decode_kernels():
    """Batch-1 sweeps ran on XLA's kernels, then on Pallas': a window that measured a few k on each
    is two groups, never one curve (k = 1-8 together, wider than the XLA sweep's 1-7); a later full
    sweep on Pallas' kernels replaces XLA's."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import plot_results
    xla = [mtbench_row("eagle3", k, 1800.0 + k, 3.0, head=trained("2026-12-02 00:36"), date=f"2026-12-02T00:2{k}:00") for k in range(1, 8)]
    both = [mtbench_row("eagle3", k, 2000.0, 3.1, head=trained("2026-12-02 00:36"), date=f"2026-12-02T11:1{k}:00", decode_kernels=kernels)
            for kernels, ks in (("pallas", (1, 2, 3, 4)), ("xla", (5, 6, 7, 8))) for k in ks]
    rows = plot_results.default_settings(xla + both, plot_results.SWEEP_KERNELS)
    chosen = plot_results.one_window_sweeps(plot_results.latest_of_newest_head(rows), rows)
    assert sorted((r["k"], r["output_tokens_per_second"]) for r in chosen) == [(r["k"], r["output_tokens_per_second"])
                                                                            for r in xla]
    pallas = [mtbench_row("eagle3", k, 2050.0 + k, 3.2, head=trained("2026-12-02 00:36"), date=f"2026-12-02T12:4{k}:00",
                          decode_kernels="pallas") for k in range(1, 8)]
    rows = plot_results.default_settings(xla + both + pallas, plot_results.SWEEP_KERNELS)
    chosen = plot_results.one_window_sweeps(plot_results.latest_of_newest_head(rows), rows)
    assert sorted((r["k"], r["output_tokens_per_second"]) for r in chosen) == [
        (r["k"], r["output_tokens_per_second"]) for r in pallas]
    # k_at_batch.png's batch-1 line fills a k its sweep lacks from its own kernels' windows only.
    short = [r for r in pallas if r["k"] != 7]  # wider than XLA's k = 1-5, so drawn
    sweep = plot_results.k_sweeps_by_batch(xla[:5] + both + short, (80, 256))[1]
    assert sweep["tokens_per_s"] == {r["k"]: r["output_tokens_per_second"] for r in short}
    # Trees' chains stay on XLA's kernels, as before: the default kernels filter keeps them apart.
    assert {plot_results.kernels_of(r) for r in plot_results.default_settings(xla + both + pallas)} == {"xla"}


def test_eager_vs_compiled_names_where_a_run_leaves_its_reference():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import eager_vs_compiled
    assert eager_vs_compiled.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert eager_vs_compiled.first_difference([1, 5, 3], [1, 2, 3]) == 1
    assert eager_vs_compiled.first_difference([1, 2], [1, 2, 3]) == 2  # one stopped early
    assert eager_vs_compiled.agreement([[1, 2], [7, 2]], [[1, 2], [1, 2]]) == "yes, no (token 0)"


def test_data_scaling_plot_keeps_one_point_per_size_and_steps(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "benchmarks"))
    import plot_results
    rows = [mtbench_row("eagle3", 5, 1100.0, acceptance, train_tokens=tokens, scheduled_steps=763, train_steps=steps,
                        date=date)  # a time cap ends runs a few steps apart: one line still
            for tokens, acceptance, steps, date in [(10**6, 1.60, 732, "1"), (4 * 10**6, 1.61, 737, "1"),
                                                    (4 * 10**6, 1.7, 715, "2")]]
    rows.append(mtbench_row("eagle3", 5, 1900.0, 2.9))  # not a scaling point: no train_tokens
    drawn = []
    monkeypatch.setattr(plot_results, "finish", lambda fig, ax, path, *rest: drawn.append(
        (path.name, [(list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()])))
    plot_results.plot_data_scaling(rows, tmp_path)
    assert drawn == [("data_scaling.png", [([10**6, 4 * 10**6], [1.60, 1.7])])]


def batch_row(method, k, tokens_per_second, batch_size, scheduler, date, **settings):
    """A batch benchmark row as benchmarks/eagle.py writes them since 2026-12-01: Pallas kernels, one
    device, refill_at recorded on continuous rows (default a quarter of the slots)."""
    row = mtbench_row(method, k, tokens_per_second, 3.0 if k else 1.0, date=date, commit="16983ef",
                      note="2026-12-01 (...): batch_steps")
    row.update(batch_size=batch_size, scheduler=scheduler, decode_kernels="pallas", tensor_parallel_size=1,
               steps_per_check=1, refill_at=max(1, batch_size // 4) if scheduler == "continuous" else None)
    row.update(settings)
    return row


def test_batch_plot_draws_the_newest_serving_rows_of_each_scheduler(tmp_path, monkeypatch):
    """batch_scaling.png: of each batch size, method and scheduler, the newest row at the default
    serving settings (Pallas kernels, default refill_at, speculation on, one device), at the k
    measured last there, a shipped head's row before a newer unshipped one's."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import plot_results

    day = "2026-12-01T"
    rows = [
        batch_row("none", 0, 11000.0, 16, "static", day + "10:00"),
        batch_row("none", 0, 10000.0, 16, "continuous", day + "10:01"),
        batch_row("none", 0, 22000.0, 64, "static", day + "10:02"),
        batch_row("none", 0, 25000.0, 64, "continuous", day + "10:03"),
        # Later rows of other settings: not the serving setting, so none of them replaces the above.
        batch_row("none", 0, 10500.0, 16, "static", day + "11:00", decode_kernels="xla"),
        batch_row("none", 0, 11400.0, 16, "continuous", day + "11:01", refill_at=16),  # a refill variant
        batch_row("none", 0, 12100.0, 16, "static", day + "11:02", steps_per_check=8),
        batch_row("none", 0, 11200.0, 16, "static", day + "11:03", xla_flags="--xla_gpu_enable_command_buffer=+WHILE"),
        batch_row("none", 0, 9000.0, 16, "continuous", day + "11:04", refill_at=None),  # before refill_at existed
        batch_row("none", 0, 11000.0, 16, "static", day + "11:05", temperature=0.7),
        batch_row("none", 0, 11000.0, 16, "static", day + "11:06", num_prompts=10),
        batch_row("none", 0, 1000.0, 1, "static", day + "11:07"),  # batch 1: another plot
        # A batch size measured only on XLA kernels (an older commit's) gets no group.
        batch_row("none", 0, 16000.0, 32, "static", "2026-11-30T22:00", decode_kernels="xla"),
        # EAGLE-3 at 16: the shipped head's static row beats a newer unshipped head's; the
        # unshipped head's continuous row stands, no shipped head having that setting.
        batch_row("eagle3", 5, 15000.0, 16, "static", day + "10:04", head=trained("2026-12-01 12:22"), shipped=True),
        batch_row("eagle3", 5, 13650.0, 16, "static", day + "12:00", head=trained("2026-12-01 21:11"), shipped=False),
        batch_row("eagle3", 5, 13120.0, 16, "continuous", day + "12:01", head=trained("2026-12-01 21:11"), shipped=False),
        # ... and the k an unshipped head was measured at last is not the k of the group: a shipped head's is.
        batch_row("eagle3", 7, 14000.0, 16, "static", day + "12:05", head=trained("2026-12-01 21:11"), shipped=False),
        # EAGLE-3 at 64: k = 6 measured last, on continuous batching only; speculation disabled and
        # trees are other settings.
        batch_row("eagle3", 5, 24000.0, 64, "static", day + "10:05", head=trained("2026-12-01 12:22")),
        batch_row("eagle3", 5, 30000.0, 64, "continuous", day + "10:06", head=trained("2026-12-01 12:22")),
        batch_row("eagle3", 6, 31000.0, 64, "continuous", day + "12:02", head=trained("2026-12-01 12:22")),
        batch_row("eagle3", 6, 22000.0, 64, "static", day + "12:03", head=trained("2026-12-01 12:22"),
                  speculative_disable_by_batch_size=16),
        batch_row("eagle3", 6, 20000.0, 64, "static", day + "12:04", head=trained("2026-12-01 12:22"), speculative_eagle_topk=4,
                  speculative_num_steps=6, speculative_num_draft_tokens=16),
        # EAGLE-3 at 4 rows has no plain decoding to compare with: no group (k_at_batch.png has its sweep).
        batch_row("eagle3", 4, 5500.0, 4, "continuous", day + "12:06", head=trained("2026-12-01 12:22")),
    ]
    chosen = plot_results.batch_rows(rows[::-1], (80, 256))  # in any order: "newest" goes by date
    assert [(r["batch_size"], r["method"], r["scheduler"], r["k"], r["output_tokens_per_second"]) for r in chosen] == [
        (16, "eagle3", "static", 5, 15000.0), (16, "eagle3", "continuous", 5, 13120.0),
        (16, "none", "static", 0, 11000.0), (16, "none", "continuous", 0, 10000.0),
        (64, "eagle3", "continuous", 6, 31000.0),
        (64, "none", "static", 0, 22000.0), (64, "none", "continuous", 0, 25000.0)]
    # Given the CLI's k per batch size, a measured one is drawn instead of the newest (both schedulers
    # at 64 rows with k = 5); one never measured (16 rows: k = 4) leaves the newest.
    with_cli_k = plot_results.batch_rows(rows[::-1], (80, 256), {16: 4, 64: 5}.get)
    assert [(r["batch_size"], r["scheduler"], r["k"]) for r in with_cli_k if r["method"] == "eagle3"] == [
        (16, "static", 5), (16, "continuous", 5), (64, "static", 5), (64, "continuous", 5)]

    # main draws those rows: a bar each, its tokens/s on it, an unshipped head named on its bar,
    # and continuous / static per method and batch size where both exist (EAGLE-3 at 64 has one).
    results = tmp_path / "mtbench.json"
    results.write_text(json.dumps(rows))
    drawn = {}
    monkeypatch.setattr(plot_results, "finish", lambda fig, ax, path, title, sub, **kw: drawn.setdefault(
        path.name, ([bar.get_height() for bar in ax.patches], [text.get_text() for text in ax.texts], sub)))
    assert plot_results.main(["--results", str(results), "--profile", str(tmp_path / "none.json"), "--training",
                              str(tmp_path), "--scaling", str(tmp_path / "none.json"), "--out-dir", str(tmp_path)]) == 0
    heights, texts, sub = drawn["batch_scaling.png"]
    assert sorted(heights) == sorted(r["output_tokens_per_second"] for r in chosen)
    assert {"11,000", "13,120", "31,000"} <= set(texts)
    assert "k=5, head of 2026-12-01\nnot shipped" in texts and "k=5, head of 2026-12-01 (shipped)" in texts
    ratios = sorted(text.rsplit("\n", 1)[-1] for text in texts if text.startswith("continuous / static"))
    assert ratios == ["0.87x", "0.91x", "1.14x"]  # EAGLE-3 and plain at 16, plain at 64 (the heads differ at 16)
    assert [text for text in texts if "two heads" in text] == ["continuous / static,\ntwo heads\n0.87x"]
    assert "pallas decode kernels" in sub and "2026-12-01 10:00-12:02 UTC (commit 16983ef)" in sub


def test_k_at_batch_draws_one_window_per_batch_size_and_the_clis_k(tmp_path, monkeypatch):
    """k_at_batch.png: at each batch size the k sweep of one measurement window (the newest head's,
    the window with the most k values), a k's repeats averaged, relative to that size's best k, and
    a k it lacks from the newest window that has it; batch 1 from static rows, larger batches from
    continuous ones; a star where the CLI's k lies."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import plot_results

    day = "2026-12-02T"
    batch1 = [mtbench_row("eagle3", k, 1800.0 + 40 * k, 3.0, head=trained("2026-12-02 00:36"), date=f"{day}00:3{k}") for k in (4, 5, 6)]
    rows = batch1 + [
        mtbench_row("eagle3", 6, 2500.0, 3.0, head=trained("2026-12-02 00:36"), date=f"{day}03:00"),  # another window, a k of the sweep's: not used
        batch_row("eagle3", 4, 3600.0, 2, "continuous", day + "05:50", head=trained("2026-12-02 00:36")),  # 2 rows: k = 4 in one window,
        batch_row("eagle3", 5, 3000.0, 2, "continuous", day + "08:30", head=trained("2026-12-02 00:36"),
                  commit="b079150"),  # k = 5 and 6 in a later one
        batch_row("eagle3", 6, 2900.0, 2, "continuous", day + "08:31", head=trained("2026-12-02 00:36"),
                  commit="b079150"),
        batch_row("eagle3", 4, 3900.0, 2, "continuous", day + "01:00", head=trained("2026-12-02 00:36")),  # an older window's k = 4: not used
        batch_row("eagle3", 3, 36000.0, 64, "continuous", day + "05:31", head=trained("2026-12-02 00:36")),
        batch_row("eagle3", 4, 34000.0, 64, "continuous", day + "05:32", head=trained("2026-12-02 00:36")),
        batch_row("eagle3", 3, 35000.0, 64, "continuous", day + "05:46", head=trained("2026-12-02 00:36")),  # a repeat: averaged
        batch_row("eagle3", 3, 50000.0, 64, "static", day + "05:47", head=trained("2026-12-02 00:36")),  # static: not the CLI's at 64
        batch_row("eagle3", 4, 40000.0, 64, "continuous", day + "05:48", head=trained("2026-12-01 21:11"), shipped=False),
        batch_row("none", 0, 24000.0, 64, "continuous", day + "05:30"),
    ]
    sweeps = plot_results.k_sweeps_by_batch(rows[::-1], (80, 256))
    assert {batch: sweep["tokens_per_s"] for batch, sweep in sweeps.items()} == {
        1: {4: 1960.0, 5: 2000.0, 6: 2040.0}, 2: {4: 3600.0, 5: 3000.0, 6: 2900.0}, 64: {3: 35500.0, 4: 34000.0}}
    assert sweeps[64]["runs"] == {3: 2, 4: 1}

    drawn = {}
    monkeypatch.setattr(plot_results, "finish", lambda fig, ax, path, title, sub, **kw: drawn.setdefault(
        path.name, [(list(line.get_xdata()), list(line.get_ydata()), line.get_label()) for line in ax.lines]))
    plot_results.plot_k_at_batch(sweeps, (80, 256), {1: 6, 2: 4, 64: 4}.get, tmp_path)
    lines = drawn["k_at_batch.png"]
    curves = {label: (x, y) for x, y, label in lines if len(x) > 1}
    assert curves["64 rows: best k = 3, 35,500 tok/s (commit 16983ef)"] == ([3, 4], [1.0, 34000.0 / 35500.0])
    assert curves["1 row: best k = 6, 2,040 tok/s"][1] == [1960.0 / 2040.0, 2000.0 / 2040.0, 1.0]
    stars = sorted((x[0], y[0]) for x, y, label in lines if len(x) == 1)
    assert curves["2 rows: best k = 4, 3,600 tok/s (commits 16983ef, b079150)"][1] == [1.0, 3000.0 / 3600.0, 2900.0 / 3600.0]
    assert stars == [(4, 34000.0 / 35500.0), (4, 1.0), (6, 1.0)]

    # Runs on 320 prompts (MT-Bench four times) are their own dashed lines, beside the 80-prompt ones.
    longer = rows + [batch_row("eagle3", k, speed, 64, "continuous", day + f"11:2{k}", head=trained("2026-12-02 00:36"), num_prompts=320)
                     for k, speed in ((3, 38000.0), (4, 40000.0))]
    long_sweeps = plot_results.longer_sweeps(longer, (80, 256))
    assert list(long_sweeps) == [(64, 320)] and long_sweeps[64, 320]["tokens_per_s"] == {3: 38000.0, 4: 40000.0}
    assert plot_results.k_sweeps_by_batch(longer, (80, 256))[64]["tokens_per_s"] == {3: 35500.0, 4: 34000.0}
    drawn.clear()
    plot_results.plot_k_at_batch(sweeps, (80, 256), {1: 6, 2: 4, 64: 4}.get, tmp_path, long_sweeps)
    curves = {label: (x, y) for x, y, label in drawn["k_at_batch.png"] if len(x) > 1}
    assert curves["64 rows, 320 prompts: best k = 4, 40,000 tok/s (commit 16983ef)"] == ([3, 4], [0.95, 1.0])
    assert len(curves) == 4


def test_scale_plot_keeps_the_last_comparison_of_one_gpu_with_two(tmp_path, monkeypatch):
    """scale_8b.png draws one run: a later run on one GPU only (a baseline) does not replace the
    latest run that measured both tensor parallel sizes."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import plot_results

    def step(what, ms, size, date):
        return dict(kind="scale_8b", what=what, ms=ms, floor_ms=5.0 / size, ratio_to_floor=ms * size / 5.0,
                    tensor_parallel_size=size, date=date, model_shape="llama-3.1-8b", cache_length=1024,
                    filled=512, device="NVIDIA H200", commit="1354955" if date < "2026-12" else "d9a5090")
    compared = [step("decode", 4.8, 1, "2026-11-30T22:17"), step("decode", 6.6, 2, "2026-11-30T22:17")]
    older = [step("decode", 6.0, 1, "2026-11-30T16:52"), step("decode", 8.5, 2, "2026-11-30T16:52")]
    baseline = [step("decode", 4.5, 1, "2026-12-02T05:44")]
    drawn = {}
    monkeypatch.setattr(plot_results, "finish", lambda fig, ax, path, title, sub, **kw: drawn.setdefault(
        path.name, ([bar.get_height() for bar in ax.patches], sub)))
    plot_results.plot_scale(older + compared + baseline, tmp_path)
    heights, sub = drawn["scale_8b.png"]
    assert heights == [4.8, 6.6, 5.0, 2.5] and "(commit 1354955)" in sub


def test_scale_8b_times_several_steps_per_call(tmp_path):
    out = tmp_path / "profile.json"
    result = subprocess.run([sys.executable, str(REPO / "benchmarks" / "scale_8b.py"), "--tiny", "--ks", "2",
                             "--methods", "eagle3", "--iterations", "1", "--steps_per_call", "3",
                             "--results", str(tmp_path / "none.json"), "--out", str(out)],
                            capture_output=True, text=True, cwd=REPO, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    timed = [row for row in json.loads(out.read_text()) if "ms" in row]
    assert {row["what"] for row in timed} == {"decode", "verify", "draft_step"}
    assert all(row["steps_per_call"] == 3 and row["ms"] > 0 for row in timed)
    assert all(row["collectives"] == {} for row in timed)  # one device: nothing to communicate


def test_the_collectives_xla_placed_are_listed():
    """`sharding.collectives`, which scale_8b's rows and the sharding tests read."""
    from eagle_jax.serve import sharding
    text = """
  %all-reduce.1 = f32[1,1,256]{2,1,0} all-reduce(%select_bitcast_fusion), channel_id=2, to_apply=%add
  %all-reduce.2 = f32[1,1,256]{2,1,0} all-reduce(%fusion.7), channel_id=3, to_apply=%add
  %all-gather-start = (s32[1,1]{1,0}, s32[1,2]{0,1}) all-gather-start(%bitcast.51), dimensions={1}
  %ag = bf16[1,2]{0,1} all-gather(%bitcast.50), channel_id=4, dimensions={1}
  %fusion.3 = f32[1,1,256]{2,1,0} fusion(%all-reduce.1), kind=kLoop, calls=%fused_computation
"""
    assert sharding.collectives(text) == {"all-reduce f32[1,1,256]": 2, "all-gather bf16[1,2]": 1,
                                           "all-gather s32[1,2]": 1}


def test_allreduce_latency_records_both_chains(tmp_path, monkeypatch):
    """benchmarks/allreduce_latency.py on the test's forced CPU devices: a row per chain and width."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import allreduce_latency
    out = tmp_path / "profile.json"
    allreduce_latency.main(["--count", "3", "--iterations", "1", "--sizes", "8,16", "--out", str(out)])
    rows = json.loads(out.read_text())
    assert [(row["chain"], row["width"]) for row in rows] == [("unrolled", 8), ("unrolled", 16), ("loop", 8), ("loop", 16)]
    assert all(row["kind"] == "all_reduce" and row["us_per_all_reduce"] > 0 for row in rows)


def test_vocab_init_probe_records_every_start(model_dir, random_head, save_head, tmp_path):  # noqa: F811
    """benchmarks/vocab_init_probe.py on a tiny model: a head extended by `extend_draft_vocabulary`
    from a smaller one, one row per start with an agreement share per unrolled step."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import vocab_init_probe
    from eagle_jax.io import models
    from eagle_jax.train import draft_vocabulary

    target, _ = models.load_target(model_dir, "float32")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 101, (6, 24))
    data_path = data.save_dataset(dict(input_ids=tokens, loss_mask=np.ones_like(tokens, bool),
                                     lengths=np.full(6, 24)), tmp_path / "data.npz")
    counts = draft_vocabulary.token_counts(data.load_dataset(data_path), 101)
    smaller = random_head(target.config, "eagle3", seed=3, draft_vocab_size=40, feature_layers=(0, 1, 1))
    smaller.d2t[...] = draft_vocabulary.draft_vocabulary(counts, 40)
    larger = draft_vocabulary.extend_draft_vocabulary(smaller, counts, 60, np.asarray(target.output_embedding()))
    out = tmp_path / "rows.json"
    assert vocab_init_probe.main(["--model", str(model_dir), "--head", str(save_head(larger, tmp_path / "larger")),
                                  "--smaller-head", str(save_head(smaller, tmp_path / "smaller")), "--data", str(data_path),
                                  "--counts", str(data_path), "--extend-to", "80", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows] == ["trained", "mean", "embedding", "extended to 80, untrained", "smaller head"]
    assert all(len(r["top1_agreement_by_step"]) == 3 and r["added_tokens"] == 20 for r in rows)
    # The larger head's added columns are the embedding placement itself: those two drafts agree.
    assert rows[0]["top1_agreement_by_step"] == rows[2]["top1_agreement_by_step"]


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (conftest forces 4 on a CPU)")
def test_scale_8b_splits_the_heads_when_asked(tmp_path, monkeypatch):
    """--split_heads at tensor parallel size 2: each device holds less of the head, and the draft
    step all-reduces once more (after the head's MLP) than with the head whole on each device."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import scale_8b
    drafts = {}
    for split in (False, True):
        out = tmp_path / f"split{split}.json"
        argv = ["--tiny", "--ks", "1", "--methods", "eagle3", "--iterations", "1", "--tensor_parallel_size", "2",
                "--results", str(tmp_path / "none.json"), "--out", str(out)] + ["--split_heads"] * split
        assert scale_8b.main(argv) == 0
        [drafts[split]] = [row for row in json.loads(out.read_text()) if row["what"] == "draft_step"]
    assert [drafts[split]["draft_tensor_parallel_size"] for split in (False, True)] == [1, 2]
    assert drafts[True]["head_bytes"] < drafts[False]["head_bytes"]
    all_reduces = lambda row: sum(n for name, n in row["collectives"].items() if name.startswith("all-reduce"))
    assert all_reduces(drafts[True]) == all_reduces(drafts[False]) + 1
