"""Load on a running `python -m eagle_jax.serve`: the counterpart of `vllm bench serve`.

    python benchmarks/serve_bench.py --url http://127.0.0.1:8000 --request-rate 1,4,16,64 --num-prompts 200
    python benchmarks/serve_bench.py --url http://127.0.0.1:8000 --concurrency 16 --num-prompts 320 --label eagle3

Requests are MT-Bench first turns (or ShareGPT first user turns with `--dataset sharegpt`), sent
to /v1/chat/completions streamed, greedy, `--max-tokens` each with EOS ignored (so every
setting decodes the same number of tokens). Arrivals are Poisson at each `--request-rate`
(requests/s; `inf` sends all at once), or a closed loop of `--concurrency` clients. Per setting
it prints and appends one JSON row (to `--out`): request throughput, output tokens/s, TTFT,
TPOT (time per output token after the first) and ITL (between streamed chunks, per token)
p50/p90/p99, and from the server's /metrics counters over the setting the acceptance length and
where the device loop's time went (`device_loop`: run, prefill, fetch and host seconds; calls;
steps; and run ms a step, host ms a run call, prefill ms a refill, ms a fetch).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import random
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

try:
    import eagle_jax  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle_jax.cli import errors as script_errors
from eagle_jax.train import data as data_lib
from results_file import append_rows

COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_accepted_tokens_total", "generation_tokens_total",
            "decode_steps_total")
DEVICE_LOOP = (("device_loop_seconds_total", "part"), ("device_calls_total", "call"))  # (metric, its label)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="model id (default: the server's only one, from /v1/models)")
    parser.add_argument("--dataset", choices=("mtbench", "sharegpt"), default="mtbench")
    parser.add_argument("--num-prompts", type=int, default=200, help="requests per setting (prompts repeat)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--request-rate", default="", help="comma list of requests/s (inf: all at once)")
    parser.add_argument("--concurrency", default="", help="comma list of closed-loop client counts")
    parser.add_argument("--seed", type=int, default=0, help="arrival times and prompt order")
    parser.add_argument("--label", default="", help="free text saved in each row (e.g. the server's settings)")
    parser.add_argument("--out", default="docs/results/serve.json", help="JSON list the rows are appended to")
    parser.add_argument("--plot", help="PNG of TPOT and TTFT against output tokens/s for the rows of this run")
    args = parser.parse_args(argv)
    if not args.request_rate and not args.concurrency:
        parser.error("give --request-rate and/or --concurrency")
    return args


def prompts(dataset: str, count: int, seed: int) -> list[str]:
    if dataset == "mtbench":
        texts = [q["turns"][0] for q in data_lib.load_mtbench()]
    else:
        path = data_lib.package_data_file(*data_lib.SHAREGPT_FILE)
        texts = [c["conversations"][0]["value"] for c in json.loads(path.read_text())[:5000]
                 if c.get("conversations") and c["conversations"][0].get("from") == "human"]
    rng = random.Random(seed)
    return [texts[rng.randrange(len(texts))] for _ in range(count)]


async def one_request(client, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """Sends one streamed chat request; returns its arrival-relative times and token count."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    chunk_times, tokens, error = [], 0, None
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return {"error": f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                    chunk_times.append(time.perf_counter() - sent)
    except Exception as exc:  # a failed request is counted, not fatal to the run
        error = repr(exc)
    return {"sent": sent, "chunk_times": chunk_times, "tokens": tokens, "error": error}


async def run_setting(url, model, texts, max_tokens, rate=None, concurrency=None, seed=0,
                      transport=None) -> tuple[list, float]:
    """(one result per text, seconds from the first request to the last answer); `transport`:
    httpx's, for tests."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, transport=transport) as client:
        if concurrency:
            # The clients' connections are opened before the clock starts: a closed loop measures
            # the server at saturation, not a burst of new connections. At 128 clients, a tenth
            # of the requests waited 4.7-6.2 s for their first token while the server's own TTFT
            # stayed under 2.5 s (H100): the wait came before the server saw them, as when a
            # listen queue overflows and dropped connections are retried 1 s and 3 s later.
            await asyncio.gather(*(client.get(f"{url}/health") for _ in range(concurrency)))
        began = time.perf_counter()
        if concurrency:
            queue = list(texts)
            results = []

            async def worker():
                while queue:
                    results.append(await one_request(client, url, model, queue.pop(), max_tokens))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:
            rng = np.random.default_rng(seed)
            gaps = np.zeros(len(texts)) if math.isinf(rate) else rng.exponential(1.0 / rate, len(texts))
            tasks = []
            for text, gap in zip(texts, gaps):
                await asyncio.sleep(gap)
                tasks.append(asyncio.create_task(one_request(client, url, model, text, max_tokens)))
            results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - began


def percentiles(values) -> dict:
    values = np.asarray(values, float)
    if not values.size:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    return {f"p{q}": float(np.percentile(values, q)) for q in (50, 90, 99)} | {"mean": float(values.mean())}


def summarise(results: list[dict], seconds: float) -> dict:
    done = [r for r in results if not r.get("error") and r["chunk_times"]]
    ttft = [r["chunk_times"][0] for r in done]
    tpot = [(r["chunk_times"][-1] - r["chunk_times"][0]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]
    itl = []  # the gap before each chunk after the first, per token of that chunk: chunk sizes are not sent
    for r in done:
        gaps = np.diff(r["chunk_times"])
        per_chunk = (r["tokens"] - 1) / max(len(gaps), 1)
        itl += (gaps / per_chunk).tolist() if per_chunk else []
    tokens = sum(r["tokens"] for r in done)
    return dict(num_requests=len(results), failed=len(results) - len(done), seconds=seconds,
                request_throughput=len(done) / seconds, output_tokens_per_second=tokens / seconds,
                output_tokens=tokens, ttft_seconds=percentiles(ttft), tpot_seconds=percentiles(tpot),
                itl_seconds=percentiles(itl))


def scrape(url: str) -> dict:
    import httpx

    return counters(httpx.get(f"{url}/metrics", timeout=30).text)


def counters(text: str) -> dict:
    """From a /metrics text: each of COUNTERS summed over its labels, and the device loop's
    counters by label ("device_loop_seconds_total/run", "device_calls_total/prefill", ...)."""
    values = {}
    for name in COUNTERS:
        found = re.findall(rf"^eagle_jax:{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
        values[name] = sum(map(float, found))
    for name, label in DEVICE_LOOP:
        for value, number in re.findall(rf"^eagle_jax:{name}\{{[^}}]*{label}=\"(\w+)\"[^}}]*\}} ([0-9.e+-]+)$", text, re.M):
            values[f"{name}/{value}"] = float(number)
    return values


def device_loop(before: dict, after: dict) -> dict:
    """Where the server's device loop spent a setting, from /metrics before and after it: seconds
    by part, calls by kind, steps, and the costs per unit (run ms a step, host ms a run call,
    prefill ms a refill, fetch ms a fetch)."""
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after if "/" in key or key == "decode_steps_total"}
    seconds = {key.split("/")[1]: value for key, value in delta.items() if key.startswith("device_loop_seconds")}
    calls = {key.split("/")[1]: int(value) for key, value in delta.items() if key.startswith("device_calls")}
    steps = int(delta.get("decode_steps_total", 0))
    per = lambda part, count: 1e3 * seconds.get(part, 0.0) / count if count else None  # noqa: E731
    return dict(seconds=seconds, calls=calls, steps=steps,
                run_ms_per_step=per("run", steps), host_ms_per_run_call=per("host", calls.get("run", 0)),
                prefill_ms_per_refill=per("prefill", calls.get("prefill", 0)),
                fetch_ms_per_fetch=per("fetch", calls.get("fetch", 0)))


def git_commit() -> str | None:
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                           cwd=Path(__file__).resolve().parent)
    return found.stdout.strip() or None


def main(argv=None) -> int:
    import httpx

    args = parse_args(argv)
    model = args.model or httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
    texts = prompts(args.dataset, args.num_prompts, args.seed)
    settings = [("request_rate", float(r)) for r in args.request_rate.split(",") if r] + \
               [("concurrency", int(c)) for c in args.concurrency.split(",") if c]
    rows = []
    for kind, value in settings:
        before = scrape(args.url)
        results, seconds = asyncio.run(run_setting(args.url, model, texts, args.max_tokens, seed=args.seed,
                                                   **{"rate" if kind == "request_rate" else kind: value}))
        after = scrape(args.url)
        drafts = after[COUNTERS[0]] - before[COUNTERS[0]]
        accepted = after[COUNTERS[1]] - before[COUNTERS[1]]
        row = dict(benchmark="serve", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   commit=git_commit(), command="python benchmarks/serve_bench.py " + shlex.join(sys.argv[1:] if argv is None else argv),
                   url=args.url, model=model, dataset=args.dataset, max_tokens=args.max_tokens, label=args.label,
                   **{kind: value}, **summarise(results, seconds),
                   acceptance_length=1 + accepted / drafts if drafts else None,
                   device_loop=device_loop(before, after))
        rows.append(row)
        print(f"{kind} {value:>6}: {row['request_throughput']:.2f} req/s, {row['output_tokens_per_second']:.0f} tok/s, "
              f"TTFT p50 {1e3 * (row['ttft_seconds']['p50'] or 0):.1f} ms, TPOT p50 "
              f"{1e3 * (row['tpot_seconds']['p50'] or 0):.2f} ms, failed {row['failed']}, "
              f"acceptance {row['acceptance_length'] or 1:.2f}; {loop_summary(row['device_loop'])}", flush=True)
    append_rows(args.out, rows)
    if args.plot:
        plot(rows, args.plot)
    return 0


def loop_summary(loop: dict) -> str:
    """One line of `device_loop`'s costs per unit (absent ones left out)."""
    parts = [("run", "run_ms_per_step", "ms a step"), ("host", "host_ms_per_run_call", "ms a call"),
             ("prefill", "prefill_ms_per_refill", "ms a refill"), ("fetch", "fetch_ms_per_fetch", "ms")]
    return ", ".join(f"{name} {loop[key]:.2f} {unit}" for name, key, unit in parts if loop.get(key) is not None)


def plot(rows: list[dict], path: str):
    """TPOT and TTFT p50 against output tokens/s: one line per label over its request rates, its
    closed-loop rows as crosses. Returns the figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = list(dict.fromkeys(r["label"] or r["model"] for r in rows))
    for number, label in enumerate(labels):
        mine = [r for r in rows if (r["label"] or r["model"]) == label]
        for axis, key in zip(axes, ("tpot_seconds", "ttft_seconds")):
            for kind, style in (("request_rate", "o-"), ("concurrency", "x")):
                points = sorted((r["output_tokens_per_second"], 1e3 * (r[key]["p50"] or np.nan))
                                for r in mine if r.get(kind) is not None)
                if points:
                    axis.plot(*zip(*points), style, color=f"C{number}", label=label if kind == "request_rate" else None)
    for axis, name in zip(axes, ("TPOT p50 (ms)", "TTFT p50 (ms)")):
        axis.set_xlabel("output tokens/s")
        axis.set_ylabel(name)
        axis.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    figure.suptitle("request rates (lines) and closed loops (crosses)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return figure


if __name__ == "__main__":
    sys.exit(script_errors.run(main))
