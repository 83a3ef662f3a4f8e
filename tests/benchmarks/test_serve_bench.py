"""`benchmarks/serve_bench.py`'s arithmetic and plot on made-up request timings (no server)."""

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO / "benchmarks"))

import serve_bench  # noqa: E402


def request(first: float, gaps: list[float], tokens: int) -> dict:
    times = [first]
    for gap in gaps:
        times.append(times[-1] + gap)
    return {"sent": 0.0, "chunk_times": times, "tokens": tokens, "error": None}


def test_summarise_times_each_request_from_its_chunks():
    """TTFT is the first chunk; TPOT spreads the time after it over the tokens after the first; a
    failed request counts as failed and adds no tokens."""
    results = [request(0.010, [0.002] * 4, 5),  # TPOT (0.008) / 4 = 2 ms
               request(0.030, [0.006, 0.006], 7),  # chunks of 3 tokens: TPOT 12 ms / 6 = 2 ms
               {"error": "HTTP 400: bad"}]
    row = serve_bench.summarise(results, seconds=2.0)
    assert row["num_requests"] == 3 and row["failed"] == 1
    assert row["output_tokens"] == 12 and row["output_tokens_per_second"] == pytest.approx(6.0)
    assert row["request_throughput"] == pytest.approx(1.0)
    assert row["ttft_seconds"]["p50"] == pytest.approx(0.020)
    assert row["tpot_seconds"]["p50"] == pytest.approx(0.002)
    assert row["itl_seconds"]["mean"] == pytest.approx(0.002)


def test_plot_draws_one_line_per_label(tmp_path):
    rows = []
    for label, base in (("eagle3", 1.0), ("plain", 2.0)):
        for rate, kind in ((1.0, "request_rate"), (16.0, "request_rate"), (32, "concurrency")):
            row = serve_bench.summarise([request(0.03 * base, [0.001 * base] * 8, 9)], seconds=1 / rate)
            rows.append(dict(row, label=label, model="m", **{kind: rate}))
    path = tmp_path / "serve.png"
    figure = serve_bench.plot(rows, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [text.get_text() for text in figure.axes[0].get_legend().get_texts()] == ["eagle3", "plain"]
    tpot_line = [line for line in figure.axes[0].get_lines() if line.get_label() == "plain"][0]
    assert len(tpot_line.get_xdata()) == 2  # its two request rates; the closed loop is a cross apart


def test_a_closed_loop_opens_its_connections_before_the_clock_starts():
    """Every client's GET /health comes before the first request, and the results are the requests'."""
    import asyncio
    import json

    import httpx

    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path == "/health":
            return httpx.Response(200)
        chunks = [{"choices": [{"delta": {"content": "a"}}]}, {"choices": [], "usage": {"completion_tokens": 1}}]
        body = "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=body, headers={"content-type": "text/event-stream"})

    results, seconds = asyncio.run(serve_bench.run_setting(
        "http://server", "m", ["p"] * 5, 1, concurrency=3, transport=httpx.MockTransport(handler)))
    assert seen == ["/health"] * 3 + ["/v1/chat/completions"] * 5
    assert [r["tokens"] for r in results] == [1] * 5 and seconds > 0


METRICS = """# HELP eagle_jax:device_loop_seconds_total ...
eagle_jax:device_loop_seconds_total{model_name="m",part="run"} {run}
eagle_jax:device_loop_seconds_total{model_name="m",part="host"} {host}
eagle_jax:device_loop_seconds_total{model_name="m",part="prefill"} {prefill}
eagle_jax:device_loop_seconds_created{model_name="m",part="run"} 1.7e+09
eagle_jax:device_calls_total{call="run",model_name="m"} {runs}
eagle_jax:device_calls_total{call="prefill",model_name="m"} {prefills}
eagle_jax:decode_steps_total{model_name="m"} {steps}
eagle_jax:spec_decode_num_drafts_total{model_name="m"} {drafts}
"""


def metrics_text(**values) -> str:
    text = METRICS
    for name, value in values.items():
        text = text.replace("{" + name + "}", str(value))
    return text


def test_device_loop_is_the_change_of_the_server_s_counters_over_a_setting():
    before = serve_bench.counters(metrics_text(run=1.0, host=0.5, prefill=0.25, runs=10, prefills=4, steps=100,
                                               drafts=7))
    after = serve_bench.counters(metrics_text(run=3.0, host=0.7, prefill=0.45, runs=20, prefills=8, steps=300,
                                              drafts=9))
    assert after["spec_decode_num_drafts_total"] == 9 and "device_loop_seconds_created/run" not in after
    loop = serve_bench.device_loop(before, after)
    assert loop["seconds"] == pytest.approx({"run": 2.0, "host": 0.2, "prefill": 0.2})
    assert loop["calls"] == {"run": 10, "prefill": 4} and loop["steps"] == 200
    assert loop["run_ms_per_step"] == pytest.approx(10.0)  # 2 s over 200 steps
    assert loop["host_ms_per_run_call"] == pytest.approx(20.0) and loop["prefill_ms_per_refill"] == pytest.approx(50.0)
    assert loop["fetch_ms_per_fetch"] is None  # no fetch counted
    assert serve_bench.loop_summary(loop) == "run 10.00 ms a step, host 20.00 ms a call, prefill 50.00 ms a refill"
