"""The server's engine in a process of its own (`engine_process`): what crosses the pipe, and what
the HTTP process does when the engine process is gone. Live servers in subprocesses, on free
ports, waited on through /health."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from tests.cli.test_generate_cli import aligned_model_dir, head_dir, model_dir  # noqa: F401,E402 (fixtures)
from tests.serve.test_server import MODEL, PROMPTS, free_port, running_server  # noqa: E402


def engine_pid(tmp_path) -> int:
    log = next(tmp_path.glob("server-*.log")).read_text()
    return int(re.search(r"the engine runs in process (\d+)", log).group(1))


def parent_pid(pid: int) -> int:
    stat = open(f"/proc/{pid}/stat").read()
    return int(stat[stat.rindex(")") + 2:].split()[1])  # after the command name: state, then the parent


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_engine_runs_in_a_child_process_whose_trace_the_profile_routes_write(aligned_model_dir, head_dir,  # noqa: F811
                                                                                  tmp_path):
    profile_dir = tmp_path / "profile"
    with running_server(aligned_model_dir, head_dir, tmp_path, "--max-num-seqs", "2", "--steps-per-call", "2",
                        "--profile-dir", str(profile_dir)) as (url, process):
        pid = engine_pid(tmp_path)
        assert pid != process.pid and parent_pid(pid) == process.pid
        assert httpx.post(f"{url}/start_profile", timeout=120).status_code == 200
        again = httpx.post(f"{url}/start_profile", timeout=120)  # one trace at a time: the engine's error, relayed
        assert again.status_code == 400 and "profile" in again.json()["error"]["message"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        done = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0)
        assert done.usage.completion_tokens == 4
        assert httpx.post(f"{url}/stop_profile", timeout=300).status_code == 200
        assert list(profile_dir.rglob("*.xplane.pb")), f"no trace under {profile_dir}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_dead_engine_process_ends_the_stream_in_flight_and_health_says_so(aligned_model_dir, head_dir,  # noqa: F811
                                                                             tmp_path):
    with running_server(aligned_model_dir, head_dir, tmp_path, "--max-num-seqs", "2",
                        "--steps-per-call", "2") as (url, _):
        body = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=200, temperature=0, stream=True, ignore_eos=True)
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            first = next(lines)
            subprocess.run(["kill", "-KILL", str(engine_pid(tmp_path))], check=True)
            chunks = [json.loads(line[6:]) for line in [first, *lines] if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "error"
        health = httpx.get(f"{url}/health", timeout=30)
        assert health.status_code == 500 and "engine process" in health.json()["error"]["message"]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=4, temperature=0)
        assert refused.value.status_code == 503 and "engine process" in refused.value.message


def test_a_model_the_engine_process_cannot_load_is_one_error_line_and_status_2(tmp_path):
    missing = tmp_path / "no-such-model"
    finished = subprocess.run([sys.executable, "-m", "eagle_jax.serve", "--model", str(missing), "--draft", "none",
                               "--port", str(free_port())], capture_output=True, text=True, timeout=300)
    assert finished.returncode == 2
    assert re.search(r"^error: .*no-such-model", finished.stderr, re.MULTILINE), finished.stderr
    assert "Traceback" not in finished.stderr
