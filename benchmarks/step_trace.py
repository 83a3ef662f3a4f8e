"""Kernels per decode step and the time they keep the device busy, from a `jax.profiler` trace.

`measure` runs an Engine's own step program (the one `generate` runs) under
`jax.profiler.trace` and `summarize` reads the trace it leaves: a Chrome-trace JSON
(`log_dir/plugins/profile/<run>/<host>.trace.json.gz`) whose processes ("pid") are the host
("/host:CPU") and, on GPU, one per device ("/device:GPU:0", ...), each with named threads
("tid"). Which events count as kernels (`kernel_events`, `device=`):

  * "gpu": complete events on a "/device:GPU:*" process, on its "Stream #..." threads (one per
    CUDA stream, written by XLA's CUPTI collector). Memory copies and sets on those streams
    ("Memcpy*"/"Memset*" names or `memcpy_details`/`memset_details` args) are counted apart as
    copies; "CUPTI overhead" and counter threads, and every host event (launches, the Python
    and PjRt threads, host-side thunk annotations), are ignored.
  * "cpu": XLA:CPU has no device process; its thunk executor records each executed HLO op on
    the host process's worker threads ("tf_XLAEigen/...", "tf_XLAPjRtCpuClient/...") as a
    complete event with an `hlo_op` arg (alongside "end: <op>" markers, thread-pool regions and
    PjRt bookkeeping, which carry none). `while.N` and `conditional.N` events are dropped: they
    cover only the loop's or branch's own bookkeeping (the body's ops, recorded on their own,
    may run on other threads after the `while` event has ended).
  * "auto" (default): "gpu" if the trace has a "/device:GPU" process, else "cpu".
In both, an event that wholly encloses another selected event on the same thread is a container
(an XLA:CPU op around its nested computation's ops; a whole-graph record around its kernels,
should a GPU trace hold one), not a kernel: only the innermost events count.

Per step: kernels = kernel events / steps; busy = the union of their intervals (overlaps
merged, so concurrent streams or threads are not counted twice) / steps; span = first kernel
start to last kernel end / steps; wall = host wall time of the traced calls / steps (includes
dispatch and the profiler's own overhead). The ten heaviest kernels are listed by name and
by kind (the name without XLA's instance number: all layers' `input_reduce_fusion_*` as one).
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import math
import os
import re
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib
from eagle_jax.serve import inputs

DEVICES = ("auto", "gpu", "cpu")
# XLA:CPU control flow: its events time the loop's or branch's bookkeeping; the body's ops have their own.
CPU_CONTROL_FLOW = re.compile(r"(while|conditional)(\.\d+)?")
# XLA numbers each instance of a fusion ("dot.904", "input_reduce_fusion_12"): the kind drops it.
INSTANCE_SUFFIX = re.compile(r"([._]\d+)+$")


@dataclasses.dataclass(frozen=True)
class Event:
    """One selected trace event; times in microseconds, thread = (pid, tid)."""

    name: str
    start_us: float
    end_us: float
    thread: tuple  # (pid, tid)
    module: str = ""  # the XLA program that ran it (`hlo_module`, e.g. "jit__run")


def find_trace_file(log_dir: str | Path) -> Path:
    """The newest run's `*.trace.json.gz` under `log_dir/plugins/profile/`."""
    runs = [path for path in (Path(log_dir) / "plugins" / "profile").glob("*") if path.is_dir()]
    if not runs:
        raise FileNotFoundError(f"no profiler run under {log_dir}/plugins/profile")
    newest = max(runs, key=os.path.getmtime)
    files = sorted(newest.glob("*.trace.json.gz"))
    if not files:
        raise FileNotFoundError(f"no *.trace.json.gz in {newest}")
    return files[0]


def load_trace(path: str | Path) -> dict:
    """A Chrome-trace JSON file (gzipped or not) as a dict with "traceEvents"."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as file:
        trace = json.load(file)
    return trace if isinstance(trace, dict) else {"traceEvents": trace}


def _names(events: list[dict]) -> tuple[dict, dict]:
    """(pid -> process name, (pid, tid) -> thread name) from the metadata events."""
    processes, threads = {}, {}
    for event in events:
        if event.get("ph") != "M":
            continue
        name = event.get("args", {}).get("name", "")
        if event.get("name") == "process_name":
            processes[event.get("pid")] = name
        elif event.get("name") == "thread_name":
            threads[(event.get("pid"), event.get("tid"))] = name
    return processes, threads


def _is_copy(event: dict) -> bool:
    args = event.get("args", {})
    return (event.get("name", "").startswith(("Memcpy", "Memset"))
            or "memcpy_details" in args or "memset_details" in args)


def _innermost(events: list[Event]) -> list[Event]:
    """Drops events that enclose another event of the same thread (events of one thread nest)."""
    containers = set()
    by_thread = collections.defaultdict(list)
    for index, event in enumerate(events):
        by_thread[event.thread].append(index)
    for indices in by_thread.values():
        indices.sort(key=lambda i: (events[i].start_us, -events[i].end_us))
        open_events: list[int] = []  # enclosing events, innermost last
        for index in indices:
            start, end = events[index].start_us, events[index].end_us
            while open_events and events[open_events[-1]].end_us <= start:
                open_events.pop()
            # A container holds the whole event. Merely overlapping is not enough: consecutive
            # kernels on one CUDA stream overlap in their CUPTI timestamps (on the H200, 37,650 of
            # 39,747 in a plain decode trace), and each would otherwise count as its
            # predecessor's container.
            if open_events and end <= events[open_events[-1]].end_us:
                containers.add(open_events[-1])
            open_events.append(index)
    return [event for index, event in enumerate(events) if index not in containers]


def kernel_events(trace: dict, device: str = "auto") -> tuple[str, list[Event], list[Event]]:
    """(the device used, kernel events, copy events) of a trace; see the module docstring."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    events = trace["traceEvents"]
    processes, threads = _names(events)
    gpu_pids = {pid for pid, name in processes.items() if name.startswith("/device:GPU")}
    if device == "auto":
        device = "gpu" if gpu_pids else "cpu"
    kernels, copies = [], []
    for event in events:
        if event.get("ph") != "X" or "dur" not in event:
            continue
        pid, tid = event.get("pid"), event.get("tid")
        if device == "gpu":
            if pid not in gpu_pids or not threads.get((pid, tid), "").startswith("Stream #"):
                continue
        elif (not processes.get(pid, "").startswith("/host:") or "hlo_op" not in event.get("args", {})
              or CPU_CONTROL_FLOW.fullmatch(event.get("name", ""))):
            continue
        start = float(event["ts"])
        selected = Event(event.get("name", ""), start, start + float(event["dur"]), (pid, tid),
                         str(event.get("args", {}).get("hlo_module", "")))
        (copies if device == "gpu" and _is_copy(event) else kernels).append(selected)
    return device, _innermost(kernels), _innermost(copies)


def union_us(events: list[Event]) -> float:
    """Total length of the union of the events' intervals."""
    total, current_start, current_end = 0.0, None, None
    for event in sorted(events, key=lambda e: e.start_us):
        if current_end is None or event.start_us > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = event.start_us, event.end_us
        else:
            current_end = max(current_end, event.end_us)
    if current_end is not None:
        total += current_end - current_start
    return total


def _top(kernels: list[Event], key, num_steps: int, top: int) -> list[dict]:
    """The `top` groups of kernels (by `key(name)`) by total time, per step, with the shortest and
    longest call of each (one kernel run at many layers can cost more at some than at others)."""
    groups = collections.defaultdict(list)
    for event in kernels:
        groups[key(event.name)].append(event.end_us - event.start_us)
    ranked = sorted(groups.items(), key=lambda item: (-sum(item[1]), item[0]))[:top]
    return [dict(name=name, count_per_step=round(len(calls) / num_steps, 2), us_per_step=round(sum(calls) / num_steps, 3),
                 us_min=round(min(calls), 3), us_max=round(max(calls), 3))
            for name, calls in ranked]


def summarize(trace: dict, num_steps: int, device: str = "auto", top: int = 10, exclude: str | None = None) -> dict:
    """Per-step kernel count, busy time and span; the `top` kernels and kernel kinds by total time.
    Kernels whose name starts with `exclude` are left out (e.g. a probe run between the calls traced)."""
    device, kernels, copies = kernel_events(trace, device)
    if exclude:
        kernels = [event for event in kernels if not event.name.startswith(exclude)]
    if not kernels:
        raise ValueError(f"no {device} kernel events in the trace (see benchmarks/step_trace.py for what is selected)")
    span = max(e.end_us for e in kernels) - min(e.start_us for e in kernels)
    return dict(
        trace_device=device,
        kernels_per_step=round(len(kernels) / num_steps, 2),
        busy_us_per_step=round(union_us(kernels) / num_steps, 2),
        span_us_per_step=round(span / num_steps, 2),
        kernel_us_per_step=round(sum(e.end_us - e.start_us for e in kernels) / num_steps, 2),
        copies_per_step=round(len(copies) / num_steps, 2),
        copy_us_per_step=round(union_us(copies) / num_steps, 2),
        top_kernels=_top(kernels, lambda name: name, num_steps, top),
        top_kinds=_top(kernels, lambda name: INSTANCE_SUFFIX.sub("", name), num_steps, top),
    )


def measure(engine: engine_lib.Engine, prompt, *, trace_steps: int = 64, steps_per_call: int = 64,
            cache_length: int | None = None, device: str = "auto", trace_dir: str | Path | None = None,
            seed: int = 0, top: int = 10) -> dict:
    """Traces `trace_steps` steps of `engine`'s step program on `batch_size` copies of `prompt`.

    The program is the one `generate` compiles: `steps_per_call` steps inside one device loop
    (`speculative.run_steps`), so the trace covers ceil(trace_steps / steps_per_call) calls.
    It runs greedy, without EOS, with a budget no row can reach, after one untraced warm-up
    call. The cache is the smallest power of two that holds the prompt and every step's k + 1
    tokens, unless `cache_length` is given (attention reads all of it every step).

    Args:
        trace_dir: keep the trace there (a new temporary directory, deleted, if None).
        top: kernels and kernel kinds listed (`summarize`).
    Returns:
        `summarize`'s fields plus wall_us_per_step and the settings that shape the step.
    """
    steps_per_call = min(steps_per_call, trace_steps)
    calls = math.ceil(trace_steps / steps_per_call)
    k = engine.k
    prompt = inputs.as_token_ids(prompt, engine.model_config.vocab_size)
    # The warm-up call, the traced ones, and the token the prefill emits: no row may finish.
    max_new_tokens = ((1 + calls) * steps_per_call + 1) * (k + 1)
    needed = len(prompt) + max_new_tokens + engine.headroom
    if cache_length is None:
        cache_length = inputs.bucket_length(needed, engine.max_length)
    if needed > min(cache_length, engine.max_length):
        raise config_lib.InputError(f"{calls + 1} calls of {steps_per_call} steps at k={k} after a {len(prompt)}-token "
                                    f"prompt need {needed} cache slots; cache_length={cache_length}, "
                                    f"max_length={engine.max_length}")
    opts = engine.options(max_new_tokens=max_new_tokens, cache_length=cache_length)  # chain or tree
    programs = engine.batch_programs([prompt] * engine.config.batch_size, jax.random.key(seed), opts, steps_per_call)
    state = programs.step(programs.prefill())  # warm-up
    steps_before = jax.device_get(state.num_steps)
    # The same calls untraced, from a fresh prefill: the profiler adds ~1.5 us a kernel to the wall time.
    # Each call is waited for, as a host loop does between calls (it reads which rows are done), so a
    # call's own cost beside its steps counts once a call.
    untraced = programs.prefill()
    jax.block_until_ready(untraced)
    began = time.perf_counter()
    for _ in range(calls):
        untraced = jax.block_until_ready(programs.step(untraced))
    untraced_wall = time.perf_counter() - began

    with tempfile.TemporaryDirectory(prefix="eagle-jax-trace-") as scratch:
        log_dir = Path(trace_dir) if trace_dir is not None else Path(scratch)
        with jax.profiler.trace(str(log_dir), create_perfetto_trace=True):
            began = time.perf_counter()
            for _ in range(calls):
                state = programs.step(state)
            jax.block_until_ready(state)
            wall = time.perf_counter() - began
        trace_file = find_trace_file(log_dir)
        trace = load_trace(trace_file)

    steps = calls * steps_per_call
    ran = jax.device_get(state.num_steps) - steps_before
    if np.any(ran != steps):  # a row that finished early would make the later steps cheaper
        raise RuntimeError(f"expected {steps} traced steps per row, the rows ran {ran.tolist()}")
    row = dict(summarize(trace, steps, device, top), wall_us_per_step=round(1e6 * wall / steps, 2),
               untraced_us_per_step=round(1e6 * untraced_wall / steps, 2), traced_steps=steps,
               steps_per_call=steps_per_call, calls=calls, cache_length=cache_length, prompt_tokens=len(prompt),
               steps_per_check=engine.config.steps_per_check,
               xla_flags=os.environ.get("XLA_FLAGS", ""))
    if trace_dir is not None:
        row["trace_file"] = str(trace_file)
    return row


def by_module(trace: dict, device: str = "auto") -> dict:
    """Where a whole run's device time went, per XLA program (prefill, insert, the step loop, ...).

    Returns the device used, the union of every kernel's interval (`busy_us`), first start to last
    end (`span_us`), and per `hlo_module`, heaviest first: its kernels and the union of their
    intervals. Time in the span that no kernel covers is the device waiting (on the host, on a
    transfer, or on a loop's exit test).
    """
    device, kernels, _ = kernel_events(trace, device)
    if not kernels:
        raise ValueError(f"no {device} kernel events in the trace (see benchmarks/step_trace.py for what is selected)")
    groups = collections.defaultdict(list)
    for event in kernels:
        groups[event.module].append(event)
    modules = [dict(module=module or "(unnamed)", kernels=len(events), busy_us=round(union_us(events), 1))
               for module, events in groups.items()]
    return dict(trace_device=device, busy_us=round(union_us(kernels), 1),
                span_us=round(max(e.end_us for e in kernels) - min(e.start_us for e in kernels), 1),
                modules=sorted(modules, key=lambda m: (-m["busy_us"], m["module"])))
