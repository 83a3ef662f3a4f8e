"""Plots the benchmark results in docs/results/ as PNGs in docs/.

    python benchmarks/plot_results.py [--results docs/results/mtbench_h200.json]
                                    [--profile docs/results/profile_h200.json] [--out-dir docs]

Rows measured within an hour of one another form one measurement window (one machine, one commit:
figures move by a few percent from window to window, so a curve is drawn from one window).

From mtbench_h200.json (benchmarks/eagle.py and benchmarks/hf_peers.py rows), each written only when
its data exists:
  * acceptance_vs_k.png: acceptance length vs k per method (compiled, batch 1, greedy), with
    vLLM's Llama-3.1-8B figures as dashed references; each method's curve from one window (the one
    that measured the most k values with its newest head: `one_window_sweeps`);
  * otps_vs_k.png: output tokens/s vs k, the fastest plain decoding (any decode kernels; of the
    window nearest the EAGLE-3 curve's: `of_nearest_window`) and HF peers as horizontal lines;
  * per_position_acceptance.png: acceptance rate at each draft position, best k per method;
  All three from static batches with speculation never disabled (rows with a `scheduler` of
  continuous or a `speculative_disable_by_batch_size` are left out), XLA decode kernels;
  * k_at_batch.png: EAGLE-3 tokens/s vs k at each batch size, relative to that size's best k, with
    the k the CLI picks there (heads/defaults.json) starred (`k_sweeps_by_batch`), and dashed the
    batch runs on more prompts (`longer_sweeps`: MT-Bench taken again, closer to a steady state);
  * batch_scaling.png: what serving gets, output tokens/s at each batch size above 1, grouped bars
    of plain decoding and each EAGLE method on static batches and on continuous batching, with
    the continuous / static ratio. The newest row of each (method, batch size, scheduler) at
    the k measured most recently there, among compiled greedy rows on Pallas decode kernels, one
    device, an exit test every step, no XLA_FLAGS, speculation never disabled, no tree and the
    scheduler's default refill_at (`batch_rows`); an unshipped head's row only where no shipped
    head's has its setting, and its bars say so.
From docs/results/training/*_metrics.json (`eagle_jax.train`, METHOD_stageN_DATE_metrics.json: the
successive trainings of the shipped heads): training_curves.png.
From data_scaling_h200_2026-12-01.json (heads_pipeline.sh's SCALING_TOKENS runs, with `train_tokens`
and `scheduled_steps`):
  * data_scaling.png: MT-Bench acceptance length vs tokens trained on, one line per step count.
From profile_h200.json (benchmarks/profile_step.py and benchmarks/scale_8b.py rows), when present:
  * step_breakdown.png: draft / verify / rest of a speculative step;
  * scale_8b.png: 8B-shaped step times against their HBM floors, from one run: the latest of those
    that compared the most tensor parallel sizes.
Rows repeating a setting (method, k, mode, batch, temperature, max_new_tokens, num_prompts,
scheduler, speculative_disable_by_batch_size, kernels, devices, tree, refill_at) count once: the
latest by date wins. The tree plot's chain is the one drafted by the trees' head, measured nearest them.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import re
import sys
from pathlib import Path

import numpy as np

try:
    import eagle_jax  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle_jax.cli import errors as script_errors
from eagle_jax import heads  # noqa: E402

matplotlib = script_errors.require("matplotlib", 'pip install matplotlib (or -e ".[dev]")')
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# vLLM's MT-Bench acceptance lengths for Llama-3.1-8B-Instruct (PRs #17211 and #20780).
VLLM_ANCHORS = {
    "eagle": {1: 1.71, 2: 2.09, 3: 2.30, 4: 2.38, 5: 2.43},
    "eagle3": {2: 2.36, 3: 2.79, 4: 3.08, 5: 3.32, 6: 3.46, 7: 3.54},
}
LABELS = {"none": "plain decoding", "eagle": "EAGLE-1", "eagle3": "EAGLE-3", "hf-eager": "HF transformers (eager)",
          "hf-static": "HF transformers (static cache)", "hf-static-compiled": "HF transformers (static, compiled)",
          "hf-prompt-lookup": "HF transformers (prompt lookup)"}
COLORS = {"none": "black", "eagle": "tab:blue", "eagle3": "tab:orange"}
EAGLE_METHODS = ("eagle", "eagle3")
KEY = ("method", "k", "mode", "batch_size", "temperature", "max_new_tokens", "num_prompts", "scheduler",
       "speculative_disable_by_batch_size", "decode_kernels", "tensor_parallel_size", "steps_per_check",
       "speculative_eagle_topk", "speculative_num_steps", "speculative_num_draft_tokens", "xla_flags", "refill_at", "attention_tiling")
# Rows written before a field existed: static batches, XLA kernels, one device, a test every step,
# no XLA flags (a row run without them has none), no refill_at (static rows have none), the
# attention kernel's own tiling (a row names one only when it was set).
KEY_DEFAULTS = {"scheduler": "static", "decode_kernels": "xla", "tensor_parallel_size": 1, "steps_per_check": 1,
                "xla_flags": None, "refill_at": None, "attention_tiling": None}
SCHEDULERS = ("static", "continuous")
BATCH_KERNELS = "pallas"  # the batch benchmarks' decode kernels since 2026-12-01 (commit 017afed)
# Batch-1 chain sweeps: XLA's kernels until `auto` chose Pallas for chains (2026-12-02, commit 80c3849),
# Pallas since. A sweep is one window's on one set of kernels (`windows_by_kernels`); the widest, newest on
# ties, is drawn.
SWEEP_KERNELS = ("xla", "pallas")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--results", default="docs/results/mtbench_h200.json")
    parser.add_argument("--profile", default="docs/results/profile_h200.json")
    parser.add_argument("--training", default="docs/results/training", help="folder of train metrics.json files")
    parser.add_argument("--scaling", default="docs/results/data_scaling_h200_2026-12-01.json",
                        help="data-scaling rows (train_tokens)")
    parser.add_argument("--out-dir", default="docs")
    parser.add_argument("--num-prompts", type=int, help="plot rows of this many prompts (default: the most common)")
    parser.add_argument("--max-new-tokens", type=int, help="plot rows of this budget (default: the most common)")
    return parser.parse_args(argv)


def load_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    try:
        rows = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not a JSON list of result rows ({error})") from None
    if not isinstance(rows, list):
        raise ValueError(f"{path} does not hold a JSON list")
    return rows


def setting_key(row: dict) -> tuple:
    """The row's setting (`KEY`, with `KEY_DEFAULTS` for fields older rows lack)."""
    return tuple(row.get(name, KEY_DEFAULTS.get(name)) for name in KEY)


def latest(rows: list[dict]) -> list[dict]:
    """One row per setting, the last in `rows`."""
    return list({setting_key(row): row for row in rows}.values())


def seconds_apart(a: str | None, b: str | None) -> float:
    """Seconds between two rows' ISO dates (naive ones read as UTC); infinite where one is missing."""
    if not a or not b:
        return math.inf
    a, b = (datetime.datetime.fromisoformat(d) for d in (a, b))
    a, b = (d if d.tzinfo else d.replace(tzinfo=datetime.timezone.utc) for d in (a, b))
    return abs((a - b).total_seconds())


TRAINED = re.compile(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}")  # the `head` field's training time, UTC


def head_rank(row: dict) -> tuple[int, str]:
    """The row's head in training order: the time its `head` field names ("EAGLE-3 trained
    2026-12-02 00:36 UTC, commit 5a2b1b4"); rows older than the field rank below any named head; a
    head that was not shipped (`"shipped": false`) below all: its rows are shown only where no
    other row has the setting."""
    if row.get("shipped") is False:
        return (0, "")
    found = TRAINED.search(row.get("head") or "")
    return (1, found.group(0) if found else "")


def is_shipped(row: dict) -> bool:
    return row.get("shipped") is not False


def latest_of_newest_head(rows: list[dict]) -> list[dict]:
    """`latest`, except that a row measured with an older head (the `head` field; none: older than
    any) never replaces one with a newer head, so the plots show the shipped heads even where an
    older head was measured later (on a second GPU in the same window)."""
    by_key = {}
    for row in rows:
        key = setting_key(row)
        if key not in by_key or head_rank(row) >= head_rank(by_key[key]):
            by_key[key] = row
    return list(by_key.values())


WINDOW_GAP_SECONDS = 3600.0  # rows less than an hour apart were measured together (one machine, one commit)


def measurement_windows(rows: list[dict]) -> list[list[dict]]:
    """`rows` in groups measured close together in time (one machine and commit each), oldest first."""
    windows = []
    for row in sorted(rows, key=lambda r: r.get("date", "")):
        if windows and seconds_apart(windows[-1][-1].get("date"), row.get("date")) <= WINDOW_GAP_SECONDS:
            windows[-1].append(row)
        else:
            windows.append([row])
    return windows


def of_nearest_window(rows: list[dict], anchors: list[dict]) -> list[dict]:
    """The `rows` of the measurement window nearest in time to `anchors` (the window of one of them
    where it has some): a plain-decoding line beside one window's curve then compares figures
    measured together (kernels and tilings change between commits). All of `rows` where no dates tell."""
    distance = lambda window: min((seconds_apart(r.get("date"), a.get("date")) for r in window for a in anchors),
                                  default=math.inf)
    nearest = min(measurement_windows(rows), key=distance, default=[])
    return nearest if distance(nearest) < math.inf else rows


def kernels_of(row: dict) -> str:
    return row.get("decode_kernels", KEY_DEFAULTS["decode_kernels"])


def windows_by_kernels(rows: list[dict]) -> list[list[dict]]:
    """`measurement_windows`, each split by decode kernels (a window that ran both gives one group of
    each), oldest first."""
    return [[r for r in window if kernels_of(r) == kernels] for window in measurement_windows(rows)
            for kernels in dict.fromkeys(kernels_of(r) for r in window)]


def tree_shape(row: dict) -> tuple:
    return row["speculative_eagle_topk"], row["speculative_num_steps"], row["speculative_num_draft_tokens"]


def widest_window(rows: list[dict], swept=lambda row: row["k"]) -> list[dict]:
    """The rows of the group (`windows_by_kernels`: one window, one set of decode kernels) that
    measured the most values of `swept` (k; a tree's shape with `tree_shape`); the newest on ties."""
    return max(reversed(windows_by_kernels(rows)), key=lambda group: len({swept(r) for r in group}))


def one_window_sweeps(shown: list[dict], pool: list[dict]) -> list[dict]:
    """`shown` (one row per setting) with each EAGLE method's k sweep replaced by one window's: the
    window that measured the most k values with the newest head shown (the latest on ties), from
    `pool`. Acceptance moves by up to ~0.1 from window to window (greedy bf16 trajectories differ),
    so a curve stitched from two windows would draw steps that no measurement ran."""
    result = [r for r in shown if r["method"] not in EAGLE_METHODS]
    for method in EAGLE_METHODS:
        mine = [r for r in shown if r["method"] == method]
        if not mine:
            continue
        head = max(mine, key=head_rank).get("head")
        chosen = widest_window([r for r in pool if r["method"] == method and r.get("head") == head])
        result += latest(chosen)
    return result


def default_settings(rows: list[dict], kernels: tuple[str, ...] = (KEY_DEFAULTS["decode_kernels"],)) -> list[dict]:
    """Chain rows at the default settings: decode kernels among `kernels`, one device, the exit test
    every step, no XLA_FLAGS, the attention kernel's own tiling (trees apart: a tree row's k is its
    depth, not comparable with a chain's k)."""
    return [r for r in rows if not r.get("speculative_eagle_topk") and kernels_of(r) in kernels and all(
        r.get(name, KEY_DEFAULTS[name]) == KEY_DEFAULTS[name] for name in ("tensor_parallel_size", "steps_per_check",
                                                                           "xla_flags", "attention_tiling"))]


def compiled_greedy(row: dict) -> bool:
    """A compiled, greedy row of plain decoding or an EAGLE method (not an HF peer)."""
    return row.get("mode") == "compiled" and float(row.get("temperature", 0)) == 0 and row["method"] in ("none",) + EAGLE_METHODS


def static_greedy(rows: list[dict], setting: tuple[int, int]) -> list[dict]:
    """Compiled greedy rows of `setting` (num_prompts, max_new_tokens) on static batches, speculation
    never disabled: the plots compare methods there; continuous rows are read from the JSON."""
    return [r for r in rows if compiled_greedy(r) and (r["num_prompts"], r["max_new_tokens"]) == setting
            and r.get("scheduler", "static") == "static" and not r.get("speculative_disable_by_batch_size")]


def reference_setting(rows: list[dict], args) -> tuple[int, int] | None:
    """(num_prompts, max_new_tokens) to plot: the most common among compiled greedy rows, larger on ties."""
    counts = collections.Counter((r["num_prompts"], r["max_new_tokens"]) for r in rows if compiled_greedy(r))
    if args.num_prompts is not None or args.max_new_tokens is not None:
        counts = collections.Counter({key: n for key, n in counts.items()
                                      if args.num_prompts in (None, key[0]) and args.max_new_tokens in (None, key[1])})
    if not counts:
        return None
    return max(counts, key=lambda key: (counts[key], key[0] * key[1]))


def subtitle(rows: list[dict], setting) -> str:
    devices = sorted({r.get("device", "?") for r in rows})
    dtypes = sorted({r.get("dtype", "?") for r in rows})
    return (f"SmolLM2-135M-Instruct, MT-Bench first turns: {setting[0]} prompts x up to {setting[1]} tokens; "
            f"{', '.join(devices)}, {', '.join(dtypes)}")


def finish(fig, ax, path: Path, title: str, sub: str, legend_below: bool = False, grid: str = "both") -> None:
    ax.set_title(title + "\n" * (1 + sub.count("\n")), fontsize=13)  # a line of room per line of `sub`
    ax.text(0.5, 1.01, sub, transform=ax.transAxes, ha="center", va="bottom", fontsize=8.5, color="dimgray")
    ax.grid(True, alpha=0.3, axis=grid)
    if legend_below:
        handles, labels = ax.get_legend_handles_labels()
        fig.legend(handles, labels, fontsize=9, frameon=True, loc="lower center", ncol=2)
        legend_inches = 0.2 * ((len(labels) + 1) // 2) + 0.25
        fig.tight_layout(rect=(0, legend_inches / fig.get_figheight(), 1, 1))
        fig.savefig(path, dpi=150)
        plt.close(fig)
        print(f"wrote {path}")
        return
    ax.legend(fontsize=9, frameon=True)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    print(f"wrote {path}")


def by_k(rows: list[dict], method: str) -> list[dict]:
    return sorted((r for r in rows if r["method"] == method), key=lambda r: r["k"])


def best_k(rows: list[dict], method: str) -> dict | None:
    candidates = by_k(rows, method)
    return max(candidates, key=lambda r: r["output_tokens_per_second"]) if candidates else None


def plot_acceptance(rows, sub, out: Path) -> None:
    if not any(r["method"] in EAGLE_METHODS for r in rows):
        return
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for method in EAGLE_METHODS:
        series = by_k(rows, method)
        if series:
            ax.plot([r["k"] for r in series], [r["acceptance_length"] for r in series], "o-", color=COLORS[method],
                    label=f"{LABELS[method]} (ours, SmolLM2-135M)", linewidth=2)
        anchor = VLLM_ANCHORS[method]
        ax.plot(list(anchor), list(anchor.values()), "x--", color=COLORS[method], alpha=0.6,
                label=f"{LABELS[method]} (vLLM, Llama-3.1-8B)")
    ax.set_xlabel("k, speculative tokens per step")
    ax.set_ylabel("acceptance length (tokens per target forward)")
    ax.set_ylim(bottom=1.0)
    ax.xaxis.get_major_locator().set_params(integer=True)
    finish(fig, ax, out / "acceptance_vs_k.png", "Acceptance length vs k (greedy, batch 1)", sub)


def fastest_plain_line(plain: list[dict]) -> list[tuple]:
    """The fastest plain decoding row as a (label, tokens/s, color, style) line; none without rows."""
    if not plain:
        return []
    fastest = max(plain, key=lambda r: r["output_tokens_per_second"])
    return [(f"{LABELS['none']} (ours, {kernels_of(fastest)} kernels)", fastest["output_tokens_per_second"], "black", "-")]


def plot_otps(rows, plain, peers, sub, out: Path) -> None:
    """Tokens/s vs k per EAGLE method (`rows`), the fastest plain decoding (`plain`, any decode
    kernels) and the HF peers as horizontal lines."""
    spec = [r for r in rows if r["method"] in EAGLE_METHODS]
    if not spec and not plain:
        return
    lines = fastest_plain_line(plain)
    styles = ["--", ":", "-.", (0, (5, 1, 1, 1))]
    for index, row in enumerate(sorted(peers, key=lambda r: r["method"])):
        label = f"{LABELS.get(row['method'], row['method'])}, {row['num_prompts']}x{row['max_new_tokens']}"
        lines.append((label, row["output_tokens_per_second"], "gray", styles[index % len(styles)]))
    ours = [r["output_tokens_per_second"] for r in spec] + [value for _, value, _, _ in lines[:1 if plain else 0]]
    far = [value for _, value, _, _ in lines if value < 0.2 * min(ours)]
    # HF peers far below ours: a broken axis (ours above, peers below) keeps both readable.
    if far:
        fig, (ax, low) = plt.subplots(2, 1, sharex=True, figsize=(7.5, 6.6), gridspec_kw=dict(height_ratios=[3, 1]))
    else:
        fig, ax = plt.subplots(figsize=(7.5, 5.8))
        low = None
    for method in EAGLE_METHODS:
        series = by_k(rows, method)
        if series:
            ax.plot([r["k"] for r in series], [r["output_tokens_per_second"] for r in series], "o-",
                    color=COLORS[method], label=f"{LABELS[method]} ({kernels_of(series[0])} kernels)", linewidth=2)
    for axis in (ax, low):
        if axis is not None:
            for label, value, color, style in lines:
                axis.axhline(value, color=color, linestyle=style, linewidth=1.3,
                             label=f"{label}: {value:.0f}" if axis is ax else None)
    ax.set_ylabel("output tokens / s")
    if low is not None:
        top = max(ours + [value for _, value, _, _ in lines])
        ax.set_ylim(0.8 * min(ours), 1.08 * top)
        low.set_ylim(0, 1.3 * max(far))
        ax.spines["bottom"].set_visible(False)
        low.spines["top"].set_visible(False)
        ax.tick_params(bottom=False)
        kw = dict(marker=[(-1, -0.5), (1, 0.5)], markersize=10, linestyle="none", color="k", mec="k", mew=1,
                  clip_on=False)
        ax.plot([0, 1], [0, 0], transform=ax.transAxes, **kw)
        low.plot([0, 1], [1, 1], transform=low.transAxes, **kw)
        low.grid(True, alpha=0.3)
        low.set_xlabel("k, speculative tokens per step")
    else:
        ax.set_ylim(bottom=0)
        ax.set_xlabel("k, speculative tokens per step")
    if spec:
        ax.xaxis.get_major_locator().set_params(integer=True)
    finish(fig, ax, out / "otps_vs_k.png", "Output tokens per second vs k (greedy, batch 1)", sub, legend_below=True)


def plot_per_position(rows, sub, out: Path) -> None:
    best = [row for method in EAGLE_METHODS if (row := best_k(rows, method)) and row["acceptance_rate_per_position"]]
    if not best:
        return
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for row in best:
        rates = row["acceptance_rate_per_position"]
        ax.plot(range(1, len(rates) + 1), rates, "o-", color=COLORS[row["method"]], linewidth=2,
                label=f"{LABELS[row['method']]}, k={row['k']} (best tokens/s)")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (share of steps accepting it)")
    ax.set_ylim(0, 1)
    ax.xaxis.get_major_locator().set_params(integer=True)
    finish(fig, ax, out / "per_position_acceptance.png", "Per-position acceptance rate (greedy, batch 1)", sub)


def default_refill_at(row: dict) -> int | None:
    """The refill_at a row of its scheduler runs without --refill_at: none on static batches, a
    quarter of the slots on continuous ones (`Engine.refill_at`)."""
    if row.get("scheduler", KEY_DEFAULTS["scheduler"]) == "static":
        return None
    return min(max(1, row["batch_size"] // 4), row["batch_size"])


def serving_setting(row: dict, setting: tuple[int, int]) -> bool:
    """A batch row at the setting the batch plot compares: batch > 1, compiled, greedy, `setting`,
    `BATCH_KERNELS`, one device, the exit test every step, no XLA_FLAGS, speculation never disabled,
    a chain (no tree), the scheduler's default refill_at (a continuous row older than the field
    refilled at every finish: left out)."""
    return (row["batch_size"] > 1 and compiled_greedy(row) and (row["num_prompts"], row["max_new_tokens"]) == setting
            and kernels_of(row) == BATCH_KERNELS
            and row.get("tensor_parallel_size", 1) == 1 and row.get("steps_per_check", 1) == 1
            and not row.get("xla_flags") and not row.get("speculative_disable_by_batch_size")
            and not row.get("speculative_eagle_topk") and row.get("scheduler", "static") in SCHEDULERS
            and row.get("refill_at") == default_refill_at(row))


def batch_rows(rows: list[dict], setting: tuple[int, int], default_k=None) -> list[dict]:
    """The rows batch_scaling.png draws, by batch size, method and scheduler: of each method and
    batch size, the k the CLI picks there (`default_k(batch)`, where given and measured), else the
    k measured most recently there (by a shipped head's rows where there are any), then of each
    scheduler at that k the newest row, a shipped head's before an unshipped one's
    (`latest_of_newest_head`)."""
    rows = latest_of_newest_head(sorted((r for r in rows if serving_setting(r, setting)),
                                        key=lambda r: r.get("date", "")))
    chosen = []
    for batch, method in sorted({(r["batch_size"], r["method"]) for r in rows}):
        mine = [r for r in rows if (r["batch_size"], r["method"]) == (batch, method)]
        shipped = [r for r in mine if is_shipped(r)] or mine
        k = max(shipped, key=lambda r: r.get("date", ""))["k"]
        if method != "none" and default_k and any(r["k"] == default_k(batch) for r in shipped):
            k = default_k(batch)
        by_scheduler = {r.get("scheduler", "static"): r for r in mine if r["k"] == k}
        chosen += [by_scheduler[s] for s in SCHEDULERS if s in by_scheduler]
    # A batch size without plain decoding has nothing to compare with (k_at_batch.png draws its k sweep).
    compared = {r["batch_size"] for r in chosen if r["method"] == "none"}
    return [r for r in chosen if r["batch_size"] in compared]


def head_label(row: dict) -> str:
    """k and the drafting head of an EAGLE bar ("" for plain decoding)."""
    if row["method"] == "none":
        return ""
    trained = TRAINED.search(row.get("head") or "")
    head = f"head of {trained.group(0)[:10]}" if trained else row.get("head", "head of its date")  # fits in a bar
    shipped = {False: "\nnot shipped", True: " (shipped)"}.get(row.get("shipped"), "")
    return f"k={row['k']}, {head}{shipped}"


def commit_names(rows: list[dict]) -> list[str]:
    """The commits the rows were measured on (their `commit` field), oldest first."""
    return list(dict.fromkeys(r["commit"] for r in sorted(rows, key=lambda r: r.get("date", "")) if r.get("commit")))


def measured_range(rows: list[dict]) -> str:
    """When the rows were measured: their first and last date (UTC), and on which commits."""
    dates = sorted(r["date"] for r in rows if r.get("date"))
    if not dates:
        return "dates unknown"
    first, last = dates[0][:16].replace("T", " "), dates[-1][:16].replace("T", " ")
    span = first if first == last else (f"{first}-{last[11:]}" if first[:10] == last[:10] else f"{first} to {last}")
    commits = commit_names(rows)
    return f"measured {span} UTC" + (f" (commit{'s' * (len(commits) > 1)} {', '.join(commits)})" if commits else "")


def plot_batch_scaling(rows: list[dict], setting: tuple[int, int], out: Path) -> None:
    """batch_scaling.png: `batch_rows`' output tokens/s as bars grouped by batch size, a bar per
    method and scheduler (continuous hatched), each EAGLE bar naming its k and head, and the
    continuous / static ratio above each method's pair."""
    if not rows:
        return
    sizes = sorted({r["batch_size"] for r in rows})
    methods = [m for m in ("none",) + EAGLE_METHODS if any(r["method"] == m for r in rows)]
    slots = [(m, s) for m in methods for s in SCHEDULERS if any((r["method"], r.get("scheduler", "static")) == (m, s)
                                                                  for r in rows)]
    width = 0.8 / len(slots)
    offset = {slot: (index - (len(slots) - 1) / 2) * width for index, slot in enumerate(slots)}
    top = max(r["output_tokens_per_second"] for r in rows)
    fig, ax = plt.subplots(figsize=(9, 5.4))
    for method, scheduler in slots:
        mine = [r for r in rows if (r["method"], r.get("scheduler", "static")) == (method, scheduler)]
        x = [sizes.index(r["batch_size"]) + offset[(method, scheduler)] for r in mine]
        heights = [r["output_tokens_per_second"] for r in mine]
        continuous = scheduler == "continuous"
        ax.bar(x, heights, width * 0.92, color=COLORS[method], alpha=0.45 if continuous else 1.0,
               hatch="//" if continuous else None, edgecolor=COLORS[method], linewidth=0.8, zorder=2,
               label=f"{LABELS[method]}, {scheduler} batching")
        for position, row in zip(x, mine):
            ax.text(position, row["output_tokens_per_second"] + 0.01 * top, f"{row['output_tokens_per_second']:,.0f}",
                    ha="center", va="bottom", fontsize=7.5)
            if row["method"] != "none":
                ax.text(position, 0.02 * top, head_label(row), rotation=90, ha="center", va="bottom", fontsize=7,
                        color="white" if not continuous else "black", zorder=3)
    for index, batch in enumerate(sizes):
        for method in methods:
            pair = {r.get("scheduler", "static"): r for r in rows if (r["batch_size"], r["method"]) == (batch, method)}
            if len(pair) < 2:
                continue
            static, cont = pair["static"], pair["continuous"]
            same_head = static.get("head") == cont.get("head")
            ratio = cont["output_tokens_per_second"] / static["output_tokens_per_second"]
            left, right = (index + offset[(method, s)] for s in SCHEDULERS)
            y = max(static["output_tokens_per_second"], cont["output_tokens_per_second"]) + 0.07 * top
            ax.plot([left, left, right, right], [y - 0.015 * top, y, y, y - 0.015 * top], color="dimgray",
                    linewidth=0.8)
            ax.text((left + right) / 2, y + 0.005 * top,
                    "continuous / static" + ("" if same_head else ",\ntwo heads") + f"\n{ratio:.2f}x",
                    ha="center", va="bottom", fontsize=7.5, color="dimgray", linespacing=1.1)
    ax.set_xticks(range(len(sizes)), [f"{size} rows" for size in sizes])
    ax.set_xlim(-0.5, len(sizes) - 0.5)
    ax.set_xlabel("batch size (max_num_seqs: rows of a static batch, decode slots of continuous batching)")
    ax.set_ylabel("output tokens / s (all rows)")
    ax.set_ylim(0, 1.2 * top)
    ax.yaxis.set_major_formatter(matplotlib.ticker.StrMethodFormatter("{x:,.0f}"))
    ax.set_axisbelow(True)
    sub = f"{subtitle(rows, setting)}\n{kernels_of(rows[0])} decode kernels; {measured_range(rows)}"
    finish(fig, ax, out / "batch_scaling.png", "Throughput by batch size and scheduler (greedy, one GPU)", sub,
           legend_below=True, grid="y")


STAGE = re.compile(r"^(?P<method>[a-z0-9]+)_stage(?P<stage>\d+)_(?P<date>[0-9-]+)_metrics$")


def plot_training(directory: Path, out: Path) -> None:
    """training_curves.png: the shipped heads' top-1 agreement with the target at unrolled step 0
    through their successive trainings, from `eagle_jax.train`'s metrics.json files named
    METHOD_stageN_DATE_metrics.json (stage N continued stage N - 1's head): one line per stage,
    each drawn after the steps of the stages before it."""
    stages = {path: STAGE.match(path.stem) for path in directory.glob("*_metrics.json")} if directory.is_dir() else {}
    stages = {path: found for path, found in stages.items() if found}
    if not stages:
        return
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    steps_before = collections.Counter()
    last = {method: max(int(f["stage"]) for f in stages.values() if f["method"] == method)
            for method in {f["method"] for f in stages.values()}}
    for path, found in sorted(stages.items(), key=lambda item: (item[1]["method"], int(item[1]["stage"]))):
        method, stage = found["method"], int(found["stage"])
        record = json.loads(path.read_text())
        log = [entry for entry in record.get("log", []) if "accuracy_0" in entry]
        if len(log) < 2:
            continue
        window = min(5, len(log))  # the logged values are single batches: a short running mean
        smooth = np.convolve([e["accuracy_0"] for e in log], np.ones(window) / window, mode="valid")
        steps = [steps_before[method] + e["step"] for e in log][window - 1:]
        ax.plot(steps, smooth, linewidth=2, color=COLORS.get(record["method"]), alpha=0.35 + 0.65 * stage / last[method],
                label=f"{LABELS[record['method']]} stage {stage} ({found['date']}, {record['steps']:,} steps)")
        steps_before[method] += record["steps"]
    ax.set_xlabel("train steps of the shipped head, all stages (batch 64 x 640)")
    ax.set_ylabel("top-1 agreement with the target, first draft")
    finish(fig, ax, out / "training_curves.png", "How the shipped heads trained (the training mix, per batch)",
           "running mean of 5 logged batches; each stage continues the head of the stage before "
           "(docs/training.md)", legend_below=True)


def plot_data_scaling(rows: list[dict], out: Path) -> None:
    """data_scaling.png: acceptance length vs generated tokens trained on (log scale), one line per
    (method, k, scheduled steps): runs of equal steps on nested subsets, so only the data differs
    (a time cap may end a run a few steps early: `train_steps` is what ran)."""
    rows = [r for r in rows if "train_tokens" in r]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    series = collections.defaultdict(dict)
    for row in sorted(rows, key=lambda r: r.get("date", "")):  # a repeated point: the latest wins
        series[(row["method"], row["k"], row.get("scheduled_steps"))][row["train_tokens"]] = row["acceptance_length"]
    for (method, k, steps), points in sorted(series.items(), key=str):
        tokens = sorted(points)
        ax.plot(tokens, [points[t] for t in tokens], marker="o", linewidth=2, color=COLORS.get(method),
                label=f"{LABELS.get(method, method)}, k = {k}, {steps} steps from scratch")
    ax.set_xscale("log")
    ax.set_xlabel("generated tokens trained on (nested random subsets)")
    ax.set_ylabel("acceptance length (MT-Bench)")
    ax.set_ylim(1.0, max(r["acceptance_length"] for r in rows) + 0.3)  # room above a flat curve's points
    sub = f"{rows[-1]['num_prompts']} prompts x {rows[-1]['max_new_tokens']} tokens, greedy, batch 1, {rows[-1]['device']}"
    finish(fig, ax, out / "data_scaling.png", "Draft-head acceptance vs training data, equal steps", sub)


def plot_step_breakdown(profile, out: Path) -> None:
    rows = latest_by(profile, "step_breakdown", ("method", "k", "device", "dtype"))
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    labels = [f"{LABELS.get(r['method'], r['method'])}\nk={r['k']}\n{r['device']}" for r in rows]
    draft = [r["draft_ms"] for r in rows]
    verify = [r["verify_ms"] for r in rows]
    other = [max(r["step_ms"] - r["draft_ms"] - r["verify_ms"], 0) for r in rows]
    bar = dict(width=0.5)
    ax.bar(labels, draft, color="tab:orange", label="draft (k head forwards)", **bar)
    ax.bar(labels, verify, bottom=draft, color="tab:blue", label="verify (target over k+1 tokens)", **bar)
    ax.bar(labels, other, bottom=[d + v for d, v in zip(draft, verify)], color="lightgray", label="rest of the step",
           **bar)
    ax.set_xlim(-0.5 - 0.5 * (len(rows) == 1), len(rows) - 0.5 + 0.5 * (len(rows) == 1))
    for index, row in enumerate(rows):
        ax.text(index, row["step_ms"], f"{row['step_ms']:.2f} ms\ndraft {row['draft_share']:.0%}", ha="center",
                va="bottom", fontsize=8)
        ax.plot([index - 0.3, index + 0.3], [row["plain_decode_ms"]] * 2, "k--", linewidth=1,
                label="plain decode step" if index == 0 else None)
    ax.set_ylabel("milliseconds per step (median, jit)")
    ax.set_ylim(0, max(r["step_ms"] for r in rows) * 1.25)
    finish(fig, ax, out / "step_breakdown.png", "Where a speculative step's time goes",
           "batch 1, SmolLM2-135M-Instruct")


def plot_scale(profile, out: Path) -> None:
    rows = [r for r in profile if r.get("kind") == "scale_8b" and "floor_ms" in r]
    if not rows:
        return
    # One run (a date): the latest of those that compared the most tensor parallel sizes, so that a
    # later one-GPU baseline does not hide the last comparison of one GPU with two.
    runs = collections.defaultdict(list)
    for row in rows:
        runs[row["date"]].append(row)
    date = max(runs, key=lambda d: (len({r.get("tensor_parallel_size", 1) for r in runs[d]}), d))
    rows = runs[date]
    fig, ax = plt.subplots(figsize=(8, 4.8))
    tp = lambda r: f" tp={r['tensor_parallel_size']}" if r.get("tensor_parallel_size", 1) > 1 else ""
    names = [r["what"] + (f" {LABELS.get(r['method'], r['method'])}" if "method" in r else "")
             + (f" k={r['k']}" if "k" in r else "") + tp(r) for r in rows]
    positions = range(len(rows))
    ax.bar([p - 0.2 for p in positions], [r["ms"] for r in rows], width=0.4, color="tab:blue", label="measured (jit)")
    ax.bar([p + 0.2 for p in positions], [r["floor_ms"] for r in rows], width=0.4, color="lightgray",
           label="HBM floor (bytes read / copy bandwidth)")
    for p, row in zip(positions, rows):
        ax.text(p - 0.2, row["ms"], f"{row['ratio_to_floor']:.1f}x", ha="center", va="bottom", fontsize=7.5)
    ax.set_xticks(list(positions), names, rotation=35, ha="right", fontsize=8.5)
    ax.set_ylabel("milliseconds (median)")
    sub = (f"{rows[0]['model_shape']} shapes, random bf16 weights, batch 1, cache {rows[0]['cache_length']} "
           f"({rows[0]['filled']} filled), {rows[0]['device']}\n{measured_range(rows)}")
    finish(fig, ax, out / "scale_8b.png", "Llama-3.1-8B-shaped step times vs their HBM floor", sub)


def plot_trees(trees, chains, plain, sub, out: Path) -> None:
    """EAGLE-2 trees: acceptance length and tokens/s vs verified nodes N, a line per (top-k, depth).
    Left, the chain at k = 5 and the goal of 1.4x its acceptance; right, the fastest chain
    and the fastest plain decoding (`plain`: batch-1 rows of any decode kernels, a test every step)."""
    if not trees:
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.6))
    colors = iter(plt.cm.tab10.colors[2:])  # blue and orange are the chains' colors
    for topk, depth in sorted({(r["speculative_eagle_topk"], r["speculative_num_steps"]) for r in trees}):
        rows = sorted((r for r in trees if (r["speculative_eagle_topk"], r["speculative_num_steps"]) == (topk, depth)),
                      key=lambda r: r["speculative_num_draft_tokens"])
        nodes = [r["speculative_num_draft_tokens"] for r in rows]
        label = f"{LABELS[rows[0]['method']]} tree, top-{topk}, depth {depth}"
        color = next(colors, None)
        left.plot(nodes, [r["acceptance_length"] for r in rows], "o-", label=label, linewidth=2, color=color)
        right.plot(nodes, [r["output_tokens_per_second"] for r in rows], "o-", label=label, linewidth=2, color=color)
    methods = {r["method"] for r in trees}
    for method in sorted(methods):
        mine = [r for r in chains if r["method"] == method]
        at5 = [r for r in mine if r["k"] == 5]
        if at5:
            length = at5[-1]["acceptance_length"]
            left.axhline(length, color=COLORS[method], linestyle="--", linewidth=1.3,
                         label=f"{LABELS[method]} chain, k=5")
            left.axhline(1.4 * length, color="gray", linestyle=":", linewidth=1.3, label="goal: 1.4x the chain at k=5")
        if mine:
            fastest = max(mine, key=lambda r: r["output_tokens_per_second"])
            right.axhline(fastest["output_tokens_per_second"], color=COLORS[method], linestyle="--", linewidth=1.3,
                          label=f"{LABELS[method]} chain, fastest k={fastest['k']}")
    for label, value, color, _ in fastest_plain_line(plain):
        right.axhline(value, color=color, linestyle=":", linewidth=1.3, label=label)
    for ax, ylabel in ((left, "acceptance length"), (right, "output tokens / s")):
        ax.set_xscale("log", base=2)
        ticks = sorted({r["speculative_num_draft_tokens"] for r in trees})
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("verified tree nodes N (--speculative-num-draft-tokens)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    left.legend(fontsize=8, frameon=True)
    right.legend(fontsize=8, frameon=True)
    fig.suptitle("EAGLE-2 dynamic trees vs the chain (batch 1, greedy)", fontsize=13)
    fig.text(0.5, 0.92, sub, ha="center", fontsize=8.5, color="dimgray")
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    path = out / "tree_sweep.png"
    fig.savefig(path, dpi=150)
    plt.close(fig)
    print(f"wrote {path}")


def k_sweeps_by_batch(rows: list[dict], setting: tuple[int, int], method: str = "eagle3") -> dict[int, dict]:
    """The k sweep of `method` at each batch size, as the CLI runs it there: batch 1 on static batches
    at the default settings (`default_settings`), larger batches continuous at the serving setting
    (`serving_setting`). Each size's sweep is one window's (the one that measured the most k values
    with the newest head there; the newest on ties), a k's repeats in it averaged; a k that window
    did not measure comes from the newest window that did (the spread between windows is a few percent,
    less than the k = 4 -> 5 steps the sweeps are read for):
    {batch: {"tokens_per_s": {k: mean}, "runs": {k: count}, "rows": [...]}}."""
    batch1 = [r for r in static_greedy(default_settings(rows, SWEEP_KERNELS), setting) if r["batch_size"] == 1]
    served = [r for r in rows if serving_setting(r, setting) and r.get("scheduler") == "continuous"]
    mine = [r for r in batch1 + served if r["method"] == method]
    sweeps = {}
    for batch in sorted({r["batch_size"] for r in mine}):
        at_batch = [r for r in mine if r["batch_size"] == batch]
        newest = max(head_rank(r) for r in at_batch)
        newest_head = [r for r in at_batch if head_rank(r) == newest]
        run = list(widest_window(newest_head))
        kernels = kernels_of(run[0])  # a missing k comes from the same kernels' windows only
        for window in reversed(measurement_windows([r for r in newest_head if kernels_of(r) == kernels])):
            measured = {r["k"] for r in run}
            run += [r for r in window if r["k"] not in measured]
        by_k = collections.defaultdict(list)
        for row in run:
            by_k[row["k"]].append(row["output_tokens_per_second"])
        sweeps[batch] = dict(tokens_per_s={k: float(np.mean(v)) for k, v in sorted(by_k.items())},
                             runs={k: len(v) for k, v in sorted(by_k.items())}, rows=run)
    return sweeps


def longer_sweeps(rows: list[dict], setting: tuple[int, int], method: str = "eagle3") -> dict[tuple[int, int], dict]:
    """`k_sweeps_by_batch` of the batch runs on more prompts than `setting`'s (the same questions
    taken again, `--num_prompts`): a run of 80 prompts on 64 slots is mostly its tail, these are
    closer to a steady state. {(batch, num_prompts): sweep}."""
    prompts = sorted({r["num_prompts"] for r in rows if r["num_prompts"] > setting[0]
                      and serving_setting(r, (r["num_prompts"], setting[1]))})
    return {(batch, count): sweep for count in prompts
            for batch, sweep in k_sweeps_by_batch(rows, (count, setting[1]), method).items() if batch > 1}


def plot_k_at_batch(sweeps: dict[int, dict], setting: tuple[int, int], default_k, out: Path,
                    longer: dict[tuple[int, int], dict] | None = None) -> None:
    """k_at_batch.png: tokens/s at each k relative to the best k of its batch size, a line per batch
    size, a star at the k the CLI picks there (`default_k(batch)`, from heads/defaults.json); runs
    on more prompts (`longer_sweeps`) dashed, in their batch size's color."""
    lines = {(batch, setting[0]): sweep for batch, sweep in sweeps.items()} | (longer or {})
    if not any(len(sweep["tokens_per_s"]) > 1 for sweep in lines.values()):
        return
    fig, ax = plt.subplots(figsize=(9.6, 5.4))  # wide enough for two legend columns of long labels
    batches = sorted({batch for batch, _ in lines})
    colors = dict(zip(batches, plt.get_cmap("viridis")(np.linspace(0, 0.85, len(batches)))))
    for (batch, prompts), sweep in sorted(lines.items()):
        speed = sweep["tokens_per_s"]
        best = max(speed, key=speed.get)
        ks = list(speed)
        names = commit_names(sweep["rows"])
        commits = f"commit{'s' * (len(names) > 1)} {', '.join(names)}" if names else ""
        more = prompts != setting[0]
        ax.plot(ks, [speed[k] / speed[best] for k in ks], "o--" if more else "o-", color=colors[batch], linewidth=2,
                label=f"{batch} row{'s' * (batch > 1)}{f', {prompts} prompts' if more else ''}: "
                      f"{'best' if len(ks) > 1 else 'only'} k = {best}, {speed[best]:,.0f} tok/s"
                      + (f" ({commits})" if commits else ""))
        chosen = default_k(batch)
        if chosen in speed:
            ax.plot([chosen], [speed[chosen] / speed[best]], "*", color=colors[batch], markersize=16,
                    markeredgecolor="black", zorder=3)
    ax.plot([], [], "*", color="lightgray", markeredgecolor="black", markersize=12,
            label="the k the CLI picks there (heads/defaults.json)")
    ax.set_xlabel("k, speculative tokens per step")
    # Two lines: the legend below leaves the axes too short for the label on one.
    ax.set_ylabel("output tokens / s, relative to\nthe best k of its batch size")
    ax.xaxis.get_major_locator().set_params(integer=True)
    rows = [r for sweep in sweeps.values() for r in sweep["rows"]]
    batch1 = f"batch 1 static ({kernels_of(sweeps[1]['rows'][0])} kernels), " if 1 in sweeps else ""
    sub = (f"{subtitle(rows, setting)}\n{batch1}larger batches "
           f"continuous ({BATCH_KERNELS} kernels); repeats of a k averaged")
    finish(fig, ax, out / "k_at_batch.png", "Best k by batch size (EAGLE-3, greedy, one GPU)", sub, legend_below=True)


def latest_by(rows: list[dict], kind: str, key: tuple[str, ...]) -> list[dict]:
    found = {}
    for row in rows:
        if row.get("kind") == kind:
            found[tuple(row.get(name) for name in key)] = row
    return list(found.values())


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Rows from two GPUs measured together land in the file out of time order: "latest" goes by date.
    all_rows = sorted(load_rows(Path(args.results)), key=lambda r: r.get("date", ""))
    rows = default_settings(latest_of_newest_head(all_rows), SWEEP_KERNELS)
    setting = reference_setting(rows, args)
    if setting is None:
        print(f"no compiled greedy rows in {args.results}: no MT-Bench plots", file=sys.stderr)
    else:
        ours = static_greedy(rows, setting)
        pool = [r for r in static_greedy(default_settings(all_rows, SWEEP_KERNELS), setting) if r["batch_size"] == 1]
        batch1 = one_window_sweeps([r for r in ours if r["batch_size"] == 1], pool)
        # HF peers are slow, so they may be run on fewer prompts: the latest of each, whatever its setting.
        peers = list({r["method"]: r for r in rows if r["method"].startswith("hf-") and r["batch_size"] == 1}.values())
        sub = subtitle(batch1 or ours, setting)
        # Each k sweep is one window's on one set of kernels (`widest_window`); beside them, the fastest plain
        # decoding of the nearest window (`of_nearest_window`) on one device, any decode kernels, a test every step,
        # no flags, the attention kernel's own tiling.
        plain = [r for r in static_greedy(all_rows, setting) if r["batch_size"] == 1 and r["method"] == "none"
                 and r.get("tensor_parallel_size", 1) == 1 and not r.get("xla_flags")
                 and r.get("steps_per_check", 1) == 1 and not r.get("attention_tiling")]
        plot_acceptance(batch1, sub, out)
        eagle_curve = [r for r in batch1 if r["method"] == "eagle3"] or [r for r in batch1 if r["method"] != "none"]
        plot_otps(batch1, of_nearest_window(plain, eagle_curve), peers, sub, out)
        plot_per_position(batch1, sub, out)
        cli_k = lambda batch: heads.best_k("eagle3", "gpu", batch)
        plot_batch_scaling(batch_rows(all_rows, setting, cli_k), setting, out)
        plot_k_at_batch(k_sweeps_by_batch(all_rows, setting), setting, cli_k, out, longer_sweeps(all_rows, setting))
        trees = [r for r in all_rows if r.get("speculative_eagle_topk") and r["batch_size"] == 1
                 and (r["num_prompts"], r["max_new_tokens"]) == setting and float(r.get("temperature", 0)) == 0
                 and kernels_of(r) == KEY_DEFAULTS["decode_kernels"]]
        # (trees on other decode kernels are another setting, compared in docs/benchmarks.md's tables)
        newest = max((head_rank(r) for r in trees), default=(0, ""))
        trees = [r for r in trees if head_rank(r) == newest]  # one head's trees: older heads' rows would mix in
        # One window's sweep, the one that measured the most tree shapes (as the k sweeps): a later
        # window's repeat of one shape would otherwise draw a curve nothing measured.
        trees = latest(widest_window(trees, tree_shape)) if trees else []
        # The chain beside the trees is the one drafted by the trees' own head (a newer head may have
        # been measured since), and plain decoding of the window nearest the trees'. A head is named by
        # its `head` field, else by its path (older rows; a training exports its head to the same path).
        drafted_by = lambda row: row.get("head") or row.get("draft")
        tree_heads = {drafted_by(r) for r in trees}
        same_head = [r for r in all_rows if r["method"] == "none" or drafted_by(r) in tree_heads]
        # Of that head's chains, the one measured nearest the trees (their window): figures move by a
        # few percent from window to window, so a later window's chain would skew the comparison.
        trees_date = max((r.get("date", "") for r in trees), default="")
        same_head.sort(key=lambda r: -seconds_apart(r.get("date"), trees_date))
        chains = [r for r in static_greedy(default_settings(latest(same_head)), setting)
                  if r["batch_size"] == 1 and r["method"] != "none"]
        plot_trees(trees, chains, of_nearest_window(plain, trees), sub, out)
    plot_training(Path(args.training), out)
    plot_data_scaling(load_rows(Path(args.scaling)), out)
    profile = load_rows(Path(args.profile))
    plot_step_breakdown(profile, out)
    plot_scale(profile, out)
    return 0


if __name__ == "__main__":
    sys.exit(script_errors.run(main))
