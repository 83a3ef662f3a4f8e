"""`python -m eagle_jax.serve` in a subprocess, driven by the real `openai` client over loopback.

Each server runs a tiny random model on the CPU on a free port; tests wait on its /health, never
on a sleep, and assert behaviour (texts, status codes, counters), never timings.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from eagle_jax.decode import sampling  # noqa: E402
from eagle_jax.io import models, tokenization  # noqa: E402
from eagle_jax.serve import config as config_lib  # noqa: E402
from eagle_jax.serve import engine as engine_lib  # noqa: E402
from tests.cli.test_generate_cli import aligned_model_dir, head_dir, model_dir  # noqa: F401,E402 (fixtures)

MODEL = "tiny"
K = 2
PROMPTS = [f"w{i} w{i + 1} w{2 * i}" for i in range(32)]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running_server(model, draft, tmp_path, *flags, deadline_seconds=600):
    port = free_port()
    command = [sys.executable, "-m", "eagle_jax.serve", "--model", str(model), "--draft", str(draft),
               "--num-speculative-tokens", str(K), "--served-model-name", MODEL, "--port", str(port),
               "--cache-dir", str(tmp_path / "xla"), "--max-length", "256", *flags]
    log = open(tmp_path / f"server-{port}.log", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    began = time.monotonic()
    try:
        while True:  # readiness, not a guess: /health is 200 once every program is compiled
            if process.poll() is not None:
                raise AssertionError(f"server exited with {process.returncode}: {(tmp_path / log.name).read_text()}")
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() - began > deadline_seconds:
                raise AssertionError("server not ready in time")
            time.sleep(0.2)
        yield url, process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        log.close()


@pytest.fixture(scope="module")
def server(aligned_model_dir, head_dir, tmp_path_factory):  # noqa: F811
    with running_server(aligned_model_dir, head_dir, tmp_path_factory.mktemp("server"), "--max-num-seqs", "4",
                        "--steps-per-call", "4") as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(aligned_model_dir, head_dir):  # noqa: F811
    """The same model and head through the library, as `Engine.generate` decodes them offline."""
    target, tokenizer_dir = models.load_target(str(aligned_model_dir), "float32")
    head = models.load_head(str(head_dir), target, "float32")
    engine = engine_lib.Engine(target, head, config_lib.EngineConfig(num_speculative_tokens=K, max_length=256,
                                                                    batch_size=4, scheduler="continuous"))
    return engine, tokenization.load(tokenizer_dir)


def offline_texts(offline, prompt_ids, max_tokens):
    engine, tokenizer = offline
    results = engine.generate(prompt_ids, max_new_tokens=max_tokens)
    return [tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in results]


def metrics(url) -> dict:
    from prometheus_client import parser

    values = {}
    for family in parser.text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            key = sample.name + json.dumps(dict(sorted(sample.labels.items())))
            values[key] = sample.value
    return values


def total(values: dict, name: str, **labels) -> float:
    return sum(v for k, v in values.items() if k.split("{")[0] == name
               and all(f'"{a}": "{b}"' in k for a, b in labels.items()))


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


def test_completions_streamed_and_not_equal_offline(client, offline):
    _, tokenizer = offline
    expected = offline_texts(offline, [tokenization.encode(tokenizer, p, chat=False) for p in PROMPTS[:2]], 12)
    for prompt, text in zip(PROMPTS[:2], expected):
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
        assert whole.choices[0].text == text
        assert whole.usage.completion_tokens <= 12 and whole.usage.prompt_tokens > 0
        pieces = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True))
        assert "".join(c.choices[0].text for c in pieces if c.choices) == text
        assert pieces[-1].choices[0].finish_reason in ("length", "stop")


def test_chat_streamed_and_not_equal_offline(client, offline):
    _, tokenizer = offline
    messages = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": PROMPTS[3]}]
    [expected] = offline_texts(offline, [tokenization.encode_messages(tokenizer, messages)], 10)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert whole.choices[0].message.content == expected and whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_32_concurrent_greedy_requests_equal_offline_generate(client, offline):
    _, tokenizer = offline
    expected = offline_texts(offline, [tokenization.encode(tokenizer, p, chat=False) for p in PROMPTS], 16)
    ask = lambda prompt: client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                                   extra_body={"ignore_eos": False}).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        assert list(pool.map(ask, PROMPTS)) == expected


def test_stop_strings_cut_the_output(client, offline):
    [text] = offline_texts(offline, [tokenization.encode(offline[1], PROMPTS[5], chat=False)], 16)
    words = text.split()
    assert len(words) > 3
    stop = words[2]
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[5], max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, status, fragment", [
    ("{not json", 400, "JSON"),
    (dict(model="other", prompt="w1"), 400, "not served"),
    (dict(model=MODEL, prompt="w1", top_p=2), 400, "top_p"),
    (dict(model=MODEL, prompt="w1", temperature=2.5), 400, "temperature"),
    (dict(model=MODEL, prompt="w1", stop_token_ids=[101]), 400, "stop_token_ids must be below the vocabulary size"),
    (dict(model=MODEL, prompt="w1", stop_token_ids=list(range(9))), 400, "stop_token_ids must be a list of at most 8"),
    (dict(model=MODEL, prompt="w1", stop=[""]), 400, "stop"),
    (dict(model=MODEL, prompt="w1", n=0), 400, "greater than or equal to 1"),
    (dict(model=MODEL, prompt="w1", logprobs=50), 400, "logprobs"),
    (dict(model=MODEL, prompt="w1", frobnicate=1), 400, "frobnicate"),
    (dict(model=MODEL, prompt=" ".join(["w1"] * 300)), 400, "tokens"),
    (dict(model=MODEL, prompt=[10 ** 6]), 400, "vocabulary"),
])
def test_bad_requests_get_400_with_an_openai_error_body(server, body, status, fragment):
    data = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(f"{server}/v1/completions", content=data, headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert fragment in error["message"] and error["type"]


def test_bad_chat_messages_get_400(client):
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "w1"}], max_tokens=4)


def test_metrics_parse_and_add_up(server, client):
    before = metrics(server)
    used = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True}).usage for p in PROMPTS[:3]]
    after = metrics(server)
    delta = lambda name, **labels: total(after, name, **labels) - total(before, name, **labels)
    assert delta("eagle_jax:generation_tokens_total") == sum(u.completion_tokens for u in used) == 24
    assert delta("eagle_jax:prompt_tokens_total") == sum(u.prompt_tokens for u in used)
    assert delta("eagle_jax:request_success_total", finished_reason="length") == 3
    assert delta("eagle_jax:time_to_first_token_seconds_count") == 3
    drafts, accepted = delta("eagle_jax:spec_decode_num_drafts_total"), delta("eagle_jax:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 <= accepted <= K * drafts
    assert delta("eagle_jax:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    assert total(after, "eagle_jax:num_requests_running") == 0
    # The device loop's account. The requests came one at a time: each a prefill and an insert of
    # one row, then run calls (all greedy: every one an argmax call); a fetch after each run call
    # and one of each prefill's first tokens; one request running, every step of the device loop
    # verified one of its drafts.
    calls = lambda call: delta("eagle_jax:device_calls_total", call=call)
    assert calls("prefill") == calls("insert") == 3 and calls("run") >= 3 and calls("argmax_run") == calls("run")
    assert calls("fetch") == calls("run") + calls("prefill")
    assert delta("eagle_jax:decode_steps_total") == drafts
    parts = [delta("eagle_jax:device_loop_seconds_total", part=part) for part in ("run", "prefill", "fetch", "host")]
    assert all(part >= 0 for part in parts) and sum(parts) > 0


def wait_for(condition, what: str, deadline_seconds: float = 120):
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > deadline_seconds:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_one_slot_server_disconnect_queue_full_and_sigterm(aligned_model_dir, head_dir, tmp_path):  # noqa: F811
    with running_server(aligned_model_dir, head_dir, tmp_path, "--max-num-seqs", "1", "--max-queue", "1",
                        "--steps-per-call", "2") as (url, process):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        body = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=200, temperature=0, stream=True, ignore_eos=True)
        # A client that disconnects mid-stream frees its slot: the next request is served.
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            next(response.iter_lines())
        short = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0)
        assert short.choices[0].finish_reason in ("length", "stop")
        wait_for(lambda: total(metrics(url), "eagle_jax:request_success_total", finished_reason="abort") == 1,
                 "the disconnected request to be aborted")
        # SIGTERM: the request in flight finishes whole, then the server exits cleanly.
        body.update(max_tokens=30)
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            first = next(lines)
            process.send_signal(signal.SIGTERM)
            chunks = [json.loads(line[6:]) for line in [first, *lines] if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        # uvicorn re-raises SIGTERM once it has shut down, so the exit is the signal's, not an error's.
        assert process.wait(timeout=120) in (0, -signal.SIGTERM)
    # The start-up line tells its parts apart: compiling (or loading) every program, then running each once.
    log = next(tmp_path.glob("server-*.log")).read_text()
    ready = re.search(r"ready after ([\d.]+) s: (\d+) programs compiled, (\d+) loaded from the compilation cache "
                      r"in ([\d.]+) s \(([\d.]+) s of it lowering them on one thread\), each run once "
                      r"in ([\d.]+) s", log)
    assert ready, "no start-up line in the server's log"
    whole, compiled, loaded, compiling, lowering, warming = (float(group) for group in ready.groups())
    assert compiled + loaded > 0 and compiling + warming <= whole + 0.1 and 0 < lowering <= compiling


def test_a_full_queue_answers_429_and_a_freed_place_is_taken_again(offline):
    """The bound on waiting requests, with the device thread not started, so that nothing leaves the queue."""
    import asyncio

    from eagle_jax.serve import online, server

    engine, tokenizer = offline
    backend = online.OnlineEngine(engine, tokenizer, MODEL, max_queue=2)
    backend.compile()
    app = server.create_app(backend, MODEL)
    body = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)

    async def scenario():
        transport = httpx.ASGITransport(app=app)  # no lifespan: the device thread stays unstarted
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            queued = [asyncio.create_task(http.post("/v1/completions", json=body)) for _ in range(2)]
            while len(backend._inbox) < 2:
                await asyncio.sleep(0)  # let both requests reach the queue (no timing: event-loop turns)
            refused = await http.post("/v1/completions", json=body)
            assert refused.status_code == 429 and "waiting" in refused.json()["error"]["message"]
            queued[0].cancel()
            await asyncio.gather(queued[0], return_exceptions=True)
            backend._inbox.popleft()  # what the device thread does when it takes a request
            again = asyncio.create_task(http.post("/v1/completions", json=body))
            while len(backend._inbox) < 2:
                await asyncio.sleep(0)
            for task in (queued[1], again):
                task.cancel()
            await asyncio.gather(queued[1], again, return_exceptions=True)

    asyncio.run(scenario())


def test_a_request_cancelled_before_the_device_thread_takes_it_leaves_the_gauges_at_0(offline):
    """A client gone while its request is still in the inbox, after a round counted it waiting:
    the device thread adds and cancels it in one pass, and with no round to follow (nothing else
    in flight) must still set the gauges, which a soak reads as 0 once everything is done."""
    import asyncio

    from prometheus_client import parser

    from eagle_jax.serve import online

    engine, tokenizer = offline
    backend = online.OnlineEngine(engine, tokenizer, MODEL)
    backend.compile()

    def gauge(name):
        text = backend.metrics.exposition()[0].decode()
        return sum(s.value for f in parser.text_string_to_metric_families(text) for s in f.samples
                   if s.name == f"eagle_jax:num_requests_{name}")

    async def scenario():
        handle = backend.submit([5, 6, 7], 4, sampling.Sampling())
        backend._set_gauges()  # what a round ending now would set: the request waits in the inbox
        assert gauge("waiting") == 1
        handle.cancel()
        backend._draining = True  # the device thread's loop returns once nothing is left
        backend._run()  # on this thread: one pass takes the request and its cancel
        backend._emit()  # and what the output thread would hand over
        assert [chunk async for chunk in handle.events()] == [] and handle.finish_reason == "abort"

    asyncio.run(scenario())
    assert gauge("waiting") == 0 and gauge("running") == 0
    assert "abort" in backend.metrics.exposition()[0].decode()


def test_the_device_thread_runs_on_while_a_round_is_handed_over(offline):
    """The first hand-over (the request's first token, from inside its first round) is held until
    that round has ended: the device thread does not wait for the output thread, and the request
    still gets every token in order."""
    import asyncio
    import threading

    from eagle_jax.serve import online

    engine, tokenizer = offline
    backend = online.OnlineEngine(engine, tokenizer, MODEL)
    backend.compile()
    loop, stepped = backend._loop, threading.Semaphore(0)
    step, record = loop.step, backend._record

    def counted_step():
        events = step()
        stepped.release()
        return events

    held = []

    def held_record(events):
        if not held:  # waits on the device thread's steps, bounded so that a stall fails the test
            held.append(stepped.acquire(timeout=120))
        record(events)

    loop.step, backend._record = counted_step, held_record
    prompt = tokenization.encode(tokenizer, PROMPTS[0], chat=False)

    async def scenario():
        handle = backend.submit(prompt, 96, sampling.Sampling())
        return [token for chunk in [chunk async for chunk in handle.events()] for token in chunk.token_ids]

    backend.start()
    try:
        tokens = asyncio.run(scenario())
    finally:
        backend.drain(timeout=120)
    assert held == [True]
    assert tokens == engine.generate([prompt], max_new_tokens=96)[0].token_ids


def test_a_device_failure_ends_the_requests_in_flight_and_the_next_is_served(offline):
    """A round that raises ends the requests in flight with "error" and a fresh slot loop takes
    the next request, numbered from 0 again: it gets its own tokens, not a failed request's."""
    import asyncio

    from eagle_jax.serve import online

    engine, tokenizer = offline
    backend = online.OnlineEngine(engine, tokenizer, MODEL)
    backend.compile()

    def failing_step():
        raise RuntimeError("device lost")

    backend._loop.step = failing_step  # the first slot loop only: the failure replaces it
    prompt = tokenization.encode(tokenizer, PROMPTS[1], chat=False)

    async def scenario():
        failed = backend.submit(prompt, 8, sampling.Sampling())
        lost = [chunk async for chunk in failed.events()]
        served = backend.submit(prompt, 8, sampling.Sampling())
        return failed, lost, served, [token for chunk in [c async for c in served.events()] for token in chunk.token_ids]

    backend.start()
    try:
        failed, lost, served, tokens = asyncio.run(scenario())
    finally:
        backend.drain(timeout=120)
    assert lost == [] and failed.finish_reason == "error" and str(backend.last_device_error) == "device lost"
    assert served.request_id == failed.request_id == 0
    assert tokens == engine.generate([prompt], max_new_tokens=8)[0].token_ids and served.finish_reason != "error"


# ---- Per-request settings: every field served, each request its own, in the same programs ----

def offline_results(offline, prompts, max_tokens, settings):
    engine, tokenizer = offline
    ids = [tokenization.encode(tokenizer, p, chat=False) for p in prompts]
    return engine.generate(ids, max_new_tokens=max_tokens, sampling=settings, tokenizer=tokenizer)


def test_greedy_requests_with_penalties_and_min_tokens_equal_offline(client, offline):
    """Each request's penalties and min_tokens, beside plain greedy ones in the same slots."""
    settings = sampling.Sampling(repetition_penalty=1.4, presence_penalty=0.8, frequency_penalty=0.4, min_tokens=6)
    expected = offline_results(offline, PROMPTS[6:9], 12, settings)
    plain = offline_results(offline, PROMPTS[6:9], 12, sampling.Sampling())
    assert [r.text for r in expected] != [r.text for r in plain]  # the settings change the outputs

    def ask(index):
        if index % 2:
            return client.completions.create(model=MODEL, prompt=PROMPTS[6 + index // 2], max_tokens=12,
                                             temperature=0).choices[0].text
        return client.completions.create(
            model=MODEL, prompt=PROMPTS[6 + index // 2], max_tokens=12, temperature=0, presence_penalty=0.8,
            frequency_penalty=0.4, extra_body={"repetition_penalty": 1.4, "min_tokens": 6}).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        texts = list(pool.map(ask, range(6)))
    assert texts[0::2] == [r.text for r in expected] and texts[1::2] == [r.text for r in plain]


def test_seeded_samples_reproduce_and_equal_offline(client, offline):
    """A seeded request draws the same tokens in the server's all-settings programs as offline (the
    keys come from the seed and the token count alone); its n samples draw apart."""
    fields = dict(temperature=1.0, top_p=0.9, seed=5, extra_body={"top_k": 6, "min_p": 0.02})
    first = client.completions.create(model=MODEL, prompt=PROMPTS[9], max_tokens=10, n=3, **fields)
    again = client.completions.create(model=MODEL, prompt=PROMPTS[9], max_tokens=10, n=3, **fields)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1
    request = sampling.Sampling(temperature=1.0, top_p=0.9, top_k=6, min_p=0.02, seed=5, n=3)
    assert [r.text for r in offline_results(offline, PROMPTS[9:10], 10, request)] == texts


def test_logprobs_in_both_apis_equal_offline(client, offline):
    [expected] = offline_results(offline, PROMPTS[10:11], 8, sampling.Sampling(logprobs=2))
    tokenizer = offline[1]
    tokens = [tokenizer.decode([e["token_id"]]) for e in expected.logprobs]
    completion = client.completions.create(model=MODEL, prompt=PROMPTS[10], max_tokens=8, temperature=0, logprobs=2)
    got = completion.choices[0].logprobs
    text_tokens = len(got.tokens)  # an EOS ending the output is no text, so it has no entry
    assert got.tokens == tokens[:text_tokens] and text_tokens >= len(tokens) - 1
    np.testing.assert_allclose(got.token_logprobs, [e["logprob"] for e in expected.logprobs][:text_tokens], atol=1e-5)
    assert [len(top) for top in got.top_logprobs] == [2] * text_tokens
    assert got.text_offset == list(np.cumsum([0] + [len(t) for t in tokens[:text_tokens - 1]]))
    messages = [{"role": "user", "content": PROMPTS[10]}]
    [chat_expected] = offline[0].generate([tokenization.encode_messages(tokenizer, messages)], max_new_tokens=8,
                                          sampling=sampling.Sampling(logprobs=3), tokenizer=tokenizer)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([e["token_id"]]) for e in chat_expected.logprobs][
        :len(content)]
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token for c in content)  # greedy


def test_stop_token_ids_end_a_request(client, offline):
    [free] = offline_results(offline, PROMPTS[11:12], 12, sampling.Sampling(ignore_eos=True))
    stop = free.token_ids[3]
    assert stop not in free.token_ids[:3]
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[11], max_tokens=12, temperature=0,
                                    extra_body={"stop_token_ids": [stop], "ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop" and cut.usage.completion_tokens == 3
    assert cut.choices[0].text == offline[1].decode(free.token_ids[:3], skip_special_tokens=True)


def test_a_greedy_only_server_refuses_what_it_does_not_compile(offline):
    """--greedy-only: the plain argmax programs; requests that sample, penalise or ask for logprobs
    get a 400 naming the field, before anything is queued (nothing here is compiled)."""
    import asyncio

    from eagle_jax.serve import online, server

    engine, tokenizer = offline
    assert engine.config.sampling_mode is None  # a greedy engine: its mode is what greedy requests need
    backend = online.OnlineEngine(engine, tokenizer, MODEL)
    app = server.create_app(backend, MODEL)
    cases = [(dict(temperature=0.7), "temperature > 0: not served by this server, which runs with --greedy-only"),
             (dict(presence_penalty=0.5), "repetition, presence and frequency penalties: not served"),
             (dict(logprobs=1), "logprobs: not served"), (dict(min_tokens=2), "min_tokens: not served")]

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            for fields, message in cases:
                response = await http.post("/v1/completions", json=dict(model=MODEL, prompt="w1", max_tokens=2,
                                                                         **fields))
                assert response.status_code == 400 and message in response.json()["error"]["message"], fields
            response = await http.post("/v1/completions", json=dict(model=MODEL, prompt="w1", max_tokens=2))
            assert response.status_code == 503  # a greedy request passes the checks: the server is not compiled

    asyncio.run(scenario())


def test_profile_routes_write_a_trace_of_what_ran_between_them(offline, tmp_path):
    """With a profile directory, POST /start_profile and /stop_profile bracket a jax.profiler trace
    (one at a time: a second start, or a stop with none running, is a 400 with an error body);
    without one, the routes do not exist."""
    import asyncio

    import jax.numpy as jnp

    from eagle_jax.serve import online, server

    engine, tokenizer = offline
    backend = online.OnlineEngine(engine, tokenizer, MODEL)
    profile_dir = tmp_path / "profile"

    async def scenario(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            return [await http.post(path) for path in ("/start_profile", "/start_profile")], \
                await asyncio.to_thread(lambda: float(jnp.arange(1000.0).sum())), \
                [await http.post("/stop_profile") for _ in range(2)]

    started, total, stopped = asyncio.run(scenario(server.create_app(backend, MODEL, str(profile_dir))))
    assert total == 499500.0
    assert [r.status_code for r in started] == [200, 400] and "profile" in started[1].json()["error"]["message"]
    assert [r.status_code for r in stopped] == [200, 400] and stopped[1].json()["error"]["type"]
    assert list(profile_dir.rglob("*.xplane.pb")), f"no trace under {profile_dir}"
    unprofiled = asyncio.run(scenario(server.create_app(backend, MODEL)))
    assert [r.status_code for r in unprofiled[0] + unprofiled[2]] == [404] * 4
