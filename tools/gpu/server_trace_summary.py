"""The traced serve_bench setting's kernels a step against its run ms a step.

Reads the last row of RESULTS/serve.json (its device-loop steps, from /metrics) and the
`jax.profiler` trace under TRACE_DIR, appends a summary to RESULTS/server_trace_summary.jsonl and
prints it.

    python3 tools/gpu/server_trace_summary.py RESULTS TRACE_DIR
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import step_trace  # noqa: E402


def main(results: str, trace_dir: str) -> None:
    row = json.load(open(f"{results}/serve.json"))[-1]
    steps = row["device_loop"]["steps"]
    trace = step_trace.load_trace(step_trace.find_trace_file(trace_dir))
    summary = dict(step_trace.summarize(trace, steps), label=row["label"], steps=steps,
                   run_ms_per_step=row["device_loop"]["run_ms_per_step"])
    with open(f"{results}/server_trace_summary.jsonl", "a") as file:
        file.write(json.dumps(summary) + "\n")
    print(f"traced: {steps} steps, {summary['kernels_per_step']} kernels a step, busy {summary['busy_us_per_step']} us, "
          f"span {summary['span_us_per_step']} us, run {summary['run_ms_per_step']:.2f} ms a step")


if __name__ == "__main__":
    main(*sys.argv[1:])
