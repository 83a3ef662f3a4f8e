"""Soak of `python -m eagle_jax.serve`: many short streamed requests, some dropped mid-stream, all accounted for.

    python benchmarks/serve_soak.py --start-server --num-requests 10000
    python benchmarks/serve_soak.py --url http://127.0.0.1:8000 --num-requests 2000 --concurrency 64

`--num-requests` requests go through `--concurrency` clients (httpx, async, streamed), mixed
between /v1/chat/completions and /v1/completions, greedy, EOS ignored, `--max-tokens` (a range)
each; a `--disconnect-fraction` of them closes its connection after a random chunk. Each carries
a unique marker (the `user` field) that its record is kept under. At the end the script checks:

* every request not disconnected completed exactly once: one `finish_reason` ("length"), one
  `data: [DONE]`, nothing after it, `usage.completion_tokens` equal to its max_tokens and (with
  `--count-words`, on by default for the started server, whose word-level tokenizer decodes each
  token to one word) to the tokens streamed. Otherwise it is `lost` (or `duplicated` where a
  finish, [DONE] or data came twice, or an `error`: an HTTP status or a broken connection);
* greedy outputs of one prompt agree: every streamed text of a prompt (cut by a disconnect or
  its max_tokens) is a prefix of the longest (`mismatched` counts those that are not: tokens
  routed to the wrong request would show here);
* the server's /metrics: running and waiting back to 0, and finished requests (every reason:
  successes and aborts) up by exactly `--num-requests`.

It prints a table and appends one JSON row to `--out`. `--start-server` builds a tiny random
model (its weights aligned so that drafts are accepted now and then, and special tokens never
emitted) and serves it from this checkout on a free port, waiting on /health.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

from eagle_jax.cli import errors as script_errors  # noqa: E402
from results_file import append_rows  # noqa: E402
import tiny_server  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    date = datetime.date.today().isoformat()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (else give --start-server)")
    parser.add_argument("--start-server", action="store_true", help="serve a tiny random model from this checkout")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="the started server's decode slots")
    parser.add_argument("--steps-per-call", type=int, default=2, help="the started server's steps per device call "
                                                                      "(few: several chunks per request)")
    parser.add_argument("--workdir", help="where the started server's model, log and compile cache go "
                                          "(default: a temporary directory)")
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32, help="clients, each with one request in flight")
    parser.add_argument("--disconnect-fraction", type=float, default=0.2)
    parser.add_argument("--chat-fraction", type=float, default=0.5, help="the rest go to /v1/completions")
    parser.add_argument("--max-tokens", default="8,64", help="min,max of each request's max_tokens (uniform)")
    parser.add_argument("--num-prompts", type=int, default=64, help="distinct prompts (the prefix check compares "
                                                                     "the outputs of one prompt)")
    parser.add_argument("--count-words", action=argparse.BooleanOptionalAction, default=None,
                        help="count streamed tokens as words (exact for the started server's tokenizer; "
                             "default: on with --start-server)")
    parser.add_argument("--settle-seconds", type=float, default=120, help="how long the gauges may take to reach 0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=f"docs/results/serve_soak_cpu_{date}.json")
    args = parser.parse_args(argv)
    if bool(args.url) == args.start_server:
        parser.error("give exactly one of --url and --start-server")
    if args.count_words is None:
        args.count_words = args.start_server
    return args


# -- the load ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Planned:
    index: int
    marker: str
    chat: bool
    prompt: int  # index into the prompt pool
    max_tokens: int
    disconnect_after: int | None  # close the connection after this many data chunks (None: read to the end)


def plan(args, run_id: str) -> tuple[list[str], list[Planned]]:
    rng = np.random.default_rng(args.seed)
    words = [f"w{i}" for i in range(tiny_server.VOCAB - 15)]  # the test tokenizer's plain words (any model reads them)
    prompts = [" ".join(rng.choice(words, rng.integers(2, 13))) for _ in range(args.num_prompts)]
    low, high = map(int, args.max_tokens.split(","))
    requests = []
    for index in range(args.num_requests):
        max_tokens = int(rng.integers(low, high + 1))
        drop = rng.random() < args.disconnect_fraction
        # A chunk index up to max_tokens // 2 + 1: often before the end, sometimes past it (then the
        # request completes and counts as such: what happened is counted, not what was planned).
        after = int(rng.integers(1, max_tokens // 2 + 2)) if drop else None
        requests.append(Planned(index, f"soak-{run_id}-{index}", bool(rng.random() < args.chat_fraction),
                                int(rng.integers(len(prompts))), max_tokens, after))
    return prompts, requests


async def one_request(client, url: str, model: str, prompt: str, planned: Planned) -> dict:
    """Streams one request; returns what arrived (nothing interpreted yet)."""
    body = {"model": model, "max_tokens": planned.max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}, "user": planned.marker}
    if planned.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    record = dict(index=planned.index, status=None, error=None, pieces=[], finishes=[], choices=set(), chunks=0,
                  done_lines=0, after_done=0, usage=None, disconnected=False)
    path = "/v1/chat/completions" if planned.chat else "/v1/completions"
    try:
        async with client.stream("POST", url + path, json=body) as response:
            record["status"] = response.status_code
            if response.status_code != 200:
                record["error"] = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if record["done_lines"]:
                    record["after_done"] += 1
                if line == "data: [DONE]":
                    record["done_lines"] += 1
                    continue
                chunk = json.loads(line[6:])
                record["chunks"] += 1
                for choice in chunk["choices"]:
                    record["choices"].add(choice["index"])
                    record["pieces"].append((choice["delta"].get("content") if planned.chat else choice["text"]) or "")
                    if choice.get("finish_reason"):
                        record["finishes"].append(choice["finish_reason"])
                if chunk.get("usage"):
                    record["usage"] = chunk["usage"]["completion_tokens"]
                if planned.disconnect_after is not None and record["chunks"] >= planned.disconnect_after \
                        and not record["done_lines"]:
                    record["disconnected"] = True
                    break  # leaving the block closes the connection mid-stream
    except Exception as error:  # counted, not fatal to the soak
        record["error"] = repr(error)
    return record


async def send_all(url: str, model: str, prompts: list[str], requests: list[Planned], concurrency: int):
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    records = []
    pending = iter(requests)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        async def worker():
            for planned in pending:  # one shared iterator: each request is taken by one worker
                records.append(await one_request(client, url, model, prompts[planned.prompt], planned))

        began = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return records, time.perf_counter() - began


# -- the checks -------------------------------------------------------------------------------------------

def classify(record: dict, planned: Planned, count_words: bool) -> tuple[str, str | None]:
    """(outcome, what was wrong): completed, disconnected, lost, duplicated or errors."""
    if record["error"] is not None:
        return "errors", record["error"]
    if len(record["finishes"]) > 1 or record["done_lines"] > 1 or record["after_done"] or record["choices"] - {0}:
        return "duplicated", (f"finishes {record['finishes']}, [DONE] x{record['done_lines']}, "
                              f"{record['after_done']} lines after it, choices {sorted(record['choices'])}")
    if record["disconnected"]:
        return "disconnected", None
    wrong = []
    if record["finishes"] != ["length"]:
        wrong.append(f"finish_reason {record['finishes']}")
    if record["done_lines"] != 1:
        wrong.append("no [DONE]")
    if record["usage"] != planned.max_tokens:
        wrong.append(f"usage.completion_tokens {record['usage']} for max_tokens {planned.max_tokens}")
    streamed = len("".join(record["pieces"]).split())
    if count_words and streamed != record["usage"]:
        wrong.append(f"{streamed} tokens streamed, usage.completion_tokens {record['usage']}")
    return ("lost", "; ".join(wrong)) if wrong else ("completed", None)


def mismatched(records: list[dict], requests: list[Planned]) -> list[int]:
    """Requests whose text is not a prefix of the longest text of the same prompt and endpoint (greedy)."""
    texts: dict[tuple, list] = {}
    for record in records:
        if record["error"] is None:
            planned = requests[record["index"]]
            texts.setdefault((planned.chat, planned.prompt), []).append((record["index"], "".join(record["pieces"])))
    bad = []
    for group in texts.values():
        longest = max((text for _, text in group), key=len)
        bad += [index for index, text in group if not longest.startswith(text)]
    return bad


def scrape(url: str) -> dict:
    """/metrics as {name: {labels (sorted tuple): value}}."""
    import httpx
    from prometheus_client import parser

    values: dict = {}
    for family in parser.text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            values.setdefault(sample.name, {})[labels] = sample.value
    return values


def finished_by_reason(values: dict) -> dict[str, float]:
    return {dict(labels)["finished_reason"]: value
            for labels, value in values.get("eagle_jax:request_success_total", {}).items()}


def settle(url: str, before: dict, expected: int, seconds: float) -> tuple[dict, bool]:
    """Polls /metrics until running and waiting are 0 and `expected` more requests finished
    (aborts are counted as the device thread takes the cancels), or `seconds` pass."""
    deadline = time.monotonic() + seconds
    while True:
        values = scrape(url)
        gauges = [sum(values.get(f"eagle_jax:num_requests_{name}", {}).values()) for name in ("running", "waiting")]
        finished = sum(finished_by_reason(values).values()) - sum(finished_by_reason(before).values())
        if (gauges == [0, 0] and finished == expected) or time.monotonic() > deadline:
            return values, gauges == [0, 0] and finished == expected
        time.sleep(0.1)


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return found.stdout.strip() or None


def soak(args, url: str, server_flags: list[str] | None) -> dict:
    import httpx

    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    prompts, requests = plan(args, f"{args.seed}-{int(time.time())}")
    before = scrape(url)
    records, seconds = asyncio.run(send_all(url, model, prompts, requests, args.concurrency))
    after, settled = settle(url, before, len(requests), args.settle_seconds)
    counts = dict.fromkeys(("completed", "disconnected", "lost", "duplicated", "errors"), 0)
    problems = []
    seen = {}
    for record in records:
        seen[record["index"]] = seen.get(record["index"], 0) + 1
        outcome, wrong = classify(record, requests[record["index"]], args.count_words)
        counts[outcome] += 1
        if wrong:
            problems.append(f"{requests[record['index']].marker}: {outcome}: {wrong}")
    # A marker sent twice or never would be the script's own fault; counted so it cannot hide.
    counts["lost"] += sum(1 for planned in requests if planned.index not in seen)
    counts["duplicated"] += sum(n - 1 for n in seen.values())
    bad_prefix = mismatched(records, requests)
    problems += [f"{requests[i].marker}: its text is not a prefix of its prompt's longest" for i in bad_prefix]
    reasons = {reason: after_value - finished_by_reason(before).get(reason, 0)
               for reason, after_value in finished_by_reason(after).items()}
    drafts = [sum(values.get(f"eagle_jax:spec_decode_num_{name}_total", {}).values()) for values in (before, after)
              for name in ("drafts", "accepted_tokens")]
    gauge = lambda name: sum(after.get(f"eagle_jax:num_requests_{name}", {}).values())
    return dict(
        benchmark="serve_soak", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=git_commit(), command="python benchmarks/serve_soak.py " + shlex.join(sys.argv[1:]),
        device=cpu_name(), cpu_count=os.cpu_count(), url=url if not args.start_server else "started",
        server_flags=server_flags, model=model, num_requests=len(requests), concurrency=args.concurrency,
        disconnect_fraction=args.disconnect_fraction, chat_fraction=args.chat_fraction, max_tokens=args.max_tokens,
        sent=len(requests), **counts, mismatched=len(bad_prefix), seconds=round(seconds, 2),
        requests_per_second=round(len(requests) / seconds, 2),
        server=dict(finished_by_reason={k: int(v) for k, v in sorted(reasons.items())},
                    finished=int(sum(reasons.values())), running=gauge("running"), waiting=gauge("waiting"),
                    settled=settled,
                    acceptance_length=round(1 + (drafts[3] - drafts[1]) / (drafts[2] - drafts[0]), 3)
                    if drafts[2] > drafts[0] else None),
        problems=problems[:20])


def main(argv=None) -> int:
    args = parse_args(argv)
    with contextlib.ExitStack() as stack:
        if args.start_server:
            workdir = Path(args.workdir) if args.workdir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
            url, flags = stack.enter_context(tiny_server.started_server(workdir, args.max_num_seqs, args.steps_per_call))
        else:
            url, flags = args.url.rstrip("/"), None
        row = soak(args, url, flags)
    server = row["server"]
    for name in ("sent", "completed", "disconnected", "lost", "duplicated", "errors", "mismatched", "seconds",
                 "requests_per_second"):
        print(f"{name:>19} {row[name]}")
    print(f"{'server':>19} finished {server['finished']} {server['finished_by_reason']}, running {server['running']}, "
          f"waiting {server['waiting']}, acceptance length {server['acceptance_length']}")
    for problem in row["problems"]:
        print("  " + problem)
    append_rows(args.out, [row])
    print(f"appended to {args.out}")
    clean = not (row["lost"] or row["duplicated"] or row["errors"] or row["mismatched"]) and server["settled"]
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(script_errors.run(main))
