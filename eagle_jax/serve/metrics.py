"""Prometheus metrics of the server, under vLLM's names (prefix `eagle_jax:` where vLLM's is `vllm:`).

One registry per server (not prometheus-client's global one), so several servers in one process
(tests) do not collide. Latency buckets follow vLLM's.
"""

from __future__ import annotations

import prometheus_client as prom

from eagle_jax.serve import device_calls

PREFIX = "eagle_jax:"
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
TOKEN_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                         0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class Metrics:
    """The server's counters, gauges and histograms, and its `/metrics` text."""

    def __init__(self, model_name: str, num_speculative_tokens: int):
        self.registry = prom.CollectorRegistry()
        label = {"model_name": model_name}
        opts = dict(registry=self.registry, labelnames=("model_name",))

        def metric(kind, name, doc, **extra):
            return kind(PREFIX + name, doc, **opts, **extra).labels(**label)

        self.requests = prom.Counter(PREFIX + "request_success", "Completed requests, by finish reason",
                                     registry=self.registry, labelnames=("model_name", "finished_reason"))
        self._label = model_name
        self.prompt_tokens = metric(prom.Counter, "prompt_tokens", "Prefilled prompt tokens")
        self.generation_tokens = metric(prom.Counter, "generation_tokens", "Generated tokens")
        self.running = metric(prom.Gauge, "num_requests_running", "Requests in decode slots")
        self.waiting = metric(prom.Gauge, "num_requests_waiting", "Requests queued for a slot")
        self.time_to_first_token = metric(prom.Histogram, "time_to_first_token_seconds",
                                          "Arrival to first token", buckets=LATENCY_BUCKETS)
        self.inter_token_latency = metric(prom.Histogram, "inter_token_latency_seconds",
                                          "Time between streamed chunks, divided by their tokens",
                                          buckets=TOKEN_LATENCY_BUCKETS)
        self.e2e_latency = metric(prom.Histogram, "e2e_request_latency_seconds", "Arrival to last token",
                                  buckets=LATENCY_BUCKETS)
        self.num_drafts = metric(prom.Counter, "spec_decode_num_drafts", "Speculative steps (drafts verified)")
        self.num_draft_tokens = metric(prom.Counter, "spec_decode_num_draft_tokens", "Drafted tokens verified")
        self.num_accepted_tokens = metric(prom.Counter, "spec_decode_num_accepted_tokens", "Drafted tokens accepted")
        per_position = prom.Counter(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                    "Drafted tokens accepted, by draft position", registry=self.registry,
                                    labelnames=("model_name", "position"))
        self.accepted_per_position = [per_position.labels(model_name=model_name, position=str(i))
                                      for i in range(num_speculative_tokens)]
        self.num_speculative_tokens = num_speculative_tokens
        # The device loop's own account (`device_calls.CallCounts`), to tell where a round's time goes.
        calls = prom.Counter(PREFIX + "device_calls", "Device calls of the decode loop, by kind (argmax_run: "
                             "run calls that took the argmax step; row_run: run calls over fewer rows than the "
                             "slots)", registry=self.registry,
                             labelnames=("model_name", "call"))
        self.device_calls = {name: calls.labels(model_name=model_name, call=name)
                             for name in ("run", "argmax_run", "row_run", "prefill", "insert", "fetch")}
        loop_seconds = prom.Counter(PREFIX + "device_loop_seconds", "Wall time of the decode loop's rounds, by part: "
                                    "run calls, prefill and insert calls, fetches (waiting for the device), the rest "
                                    "on the host", registry=self.registry, labelnames=("model_name", "part"))
        self.device_loop_seconds = {name: loop_seconds.labels(model_name=model_name, part=name)
                                    for name in ("run", "prefill", "fetch", "host")}
        self.decode_steps = metric(prom.Counter, "decode_steps", "Device-loop steps (each one token, or one "
                                   "verified draft, per running request)")

    def finished(self, reason: str) -> None:
        self.requests.labels(model_name=self._label, finished_reason=reason).inc()

    def speculation(self, stats: dict) -> None:
        """Adds one request's acceptance counters (`Result.stats`: num_drafts, num_draft_tokens,
        num_accepted_tokens, per position)."""
        drafts = int(stats.get("num_drafts", 0))
        if not drafts or not self.num_speculative_tokens:
            return
        self.num_drafts.inc(drafts)
        self.num_draft_tokens.inc(int(stats.get("num_draft_tokens", 0)))
        self.num_accepted_tokens.inc(int(stats.get("num_accepted_tokens", 0)))
        for counter, rate in zip(self.accepted_per_position, stats.get("acceptance_rate_per_position", [])):
            counter.inc(round(rate * drafts))

    def device_round(self, before: device_calls.CallCounts, after: device_calls.CallCounts, seconds: float) -> None:
        """Adds one round of the device loop: its counts from `before` to `after`, `seconds` its wall time."""
        for name, field in (("run", "run_calls"), ("argmax_run", "argmax_run_calls"), ("row_run", "row_run_calls"),
                            ("prefill", "prefill_calls"), ("insert", "insert_calls"), ("fetch", "syncs")):
            self.device_calls[name].inc(getattr(after, field) - getattr(before, field))
        parts = {name: getattr(after, field) - getattr(before, field)
                 for name, field in (("run", "run_seconds"), ("prefill", "prefill_seconds"), ("fetch", "sync_seconds"))}
        for name, value in parts.items():
            self.device_loop_seconds[name].inc(value)
        self.device_loop_seconds["host"].inc(max(0.0, seconds - sum(parts.values())))
        self.decode_steps.inc(after.run_steps - before.run_steps)

    def exposition(self) -> tuple[bytes, str]:
        return prom.generate_latest(self.registry), prom.CONTENT_TYPE_LATEST
