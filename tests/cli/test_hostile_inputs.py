"""`python -m eagle_jax.generate` against hostile and broken input: one `error:` line and status 2, never a
traceback; a Ctrl-C or a reader that goes away ends the run cleanly, keeping what was written.

The subprocess tests make their own stdout pipe, shrunk to one page, and print more than a page after the
first line: the command cannot finish before the test has read that line and acted, so the outcome never
depends on timing.
"""

import contextlib
import fcntl
import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eagle_jax.cli import generate
from eagle_jax.io import tokenization
from eagle_jax.serve import scheduler
from eagle_jax.serve import static_batch
from tests.cli.test_generate_cli import cache_dir, model_dir, records  # noqa: F401  (the first two: fixtures)

REPO = Path(__file__).parents[2]
PIPE_SIZE = 4096
NUM_PROMPTS = 16
HANG_GUARD_S = 600  # only against a hang: nothing here is timed


def start(*argv, **popen) -> subprocess.Popen:
    """The CLI in a new Python process, importing this checkout."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    return subprocess.Popen([sys.executable, "-m", "eagle_jax.generate", *map(os.fsencode, argv)], env=env, **popen)


def one_page_pipe() -> tuple[int, int]:
    if not hasattr(fcntl, "F_SETPIPE_SZ"):
        pytest.skip("needs Linux pipes (F_SETPIPE_SZ)")
    read, write = os.pipe()
    fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
    assert fcntl.fcntl(write, fcntl.F_GETPIPE_SZ) == PIPE_SIZE
    return read, write


def read_bytes(fd: int, process: subprocess.Popen, until_newline: bool) -> bytes:
    """One line (read a byte at a time, so nothing after it leaves the pipe), or everything to EOF."""
    data, deadline = b"", time.monotonic() + HANG_GUARD_S
    while True:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            process.kill()
            pytest.fail(f"no output for {HANG_GUARD_S} s; read so far: {data[-300:]!r}")
        chunk = os.read(fd, 1 if until_newline else 65536)
        data += chunk
        if not chunk or (until_newline and chunk == b"\n"):
            return data


@pytest.fixture
def long_run(model_dir, cache_dir, tmp_path):  # noqa: F811
    """Arguments for a --json run of NUM_PROMPTS prompts, one at a time."""
    path = tmp_path / "prompts.jsonl"
    words = ["sea", "sky", "poem", "blue"]
    path.write_text("".join(json.dumps({"prompt": f"write a short poem about the {words[i % 4]} {i}"}) + "\n"
                            for i in range(NUM_PROMPTS)))
    return ["--model", model_dir, "--cache-dir", cache_dir, "--prompts-file", path, "--json", "--ignore-eos",
            "--max-new-tokens", "12"]


@pytest.mark.parametrize("batching, spied", [(["--max-num-seqs", "1"], "generate_static"),
                                             (["--max-num-seqs", "2"], "SlotLoop.step")])
def test_each_json_line_is_out_before_the_last_prompt_is_done(model_dir, cache_dir, capsys, monkeypatch,  # noqa: F811
                                                              batching, spied):
    """Static batches of one, and continuous slots (three prompts through two): at the start of the last
    device work, a finished prompt's line is already on stdout."""
    owner, name = (scheduler.SlotLoop, "step") if "." in spied else (static_batch, spied)
    real, lines_before = getattr(owner, name), []

    def spy(*args, **kwargs):
        lines_before.append(sys.stdout.getvalue().count("\n"))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    texts = ["the sea", "a short poem about the blue sky", "the sky"]
    code = generate.main(["--model", str(model_dir), "--cache-dir", str(cache_dir), "--json", "--ignore-eos",
                          "--max-new-tokens", "4", *batching, *[arg for text in texts for arg in ("--prompt", text)]])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert lines_before[0] == 0 and lines_before[-1] >= 1
    assert sorted(record["index"] for record in records(out)) == [0, 1, 2]


def test_ctrl_c_keeps_the_written_results_and_exits_130(long_run):
    read, write = one_page_pipe()
    process = start(*long_run, stdout=write, stderr=subprocess.PIPE)
    os.close(write)
    try:
        first = read_bytes(read, process, until_newline=True)
        assert first.endswith(b"\n"), process.communicate(timeout=HANG_GUARD_S)[1].decode()
        # The rest cannot fit the pipe, so the command is still running now.
        assert len(first) * (NUM_PROMPTS - 1) > 2 * PIPE_SIZE
        process.send_signal(signal.SIGINT)
        rest = read_bytes(read, process, until_newline=False)
    finally:
        os.close(read)
    _, err = process.communicate(timeout=HANG_GUARD_S)
    err = err.decode()
    assert process.returncode == 130, err
    lines = (first + rest).decode().splitlines()
    written = [json.loads(line) for line in lines]  # every line whole
    assert [record["index"] for record in written] == list(range(len(written)))
    assert 1 <= len(written) < NUM_PROMPTS
    assert f"interrupted: {len(written)} of {NUM_PROMPTS} prompts finished\n" in err
    assert "Traceback" not in err


def test_a_reader_that_goes_away_ends_the_run_quietly(long_run):
    read, write = one_page_pipe()
    process = start(*long_run, stdout=write, stderr=subprocess.PIPE)
    os.close(write)
    first = read_bytes(read, process, until_newline=True)
    os.close(read)  # as `| head -1` does; what is still to come cannot fit the pipe, so a write fails
    _, err = process.communicate(timeout=HANG_GUARD_S)
    err = err.decode()
    assert json.loads(first)["index"] == 0, err
    assert process.returncode == 0, err
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err


def test_a_prompt_that_is_not_utf8_exits_2(tmp_path):
    process = start("--model", tmp_path / "missing", "--prompt", "the sea", "--prompt", b"\xff\xfe the sky",
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = process.communicate(timeout=HANG_GUARD_S)
    assert process.returncode == 2 and out == b""
    assert err.decode() == "error: --prompt number 2 is not UTF-8 text (byte 0xff at byte 1)\n"


def run_main(*argv) -> tuple[int, str, str]:
    """The CLI in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = generate.main(list(map(str, argv)))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("content, message", [
    (None, "{path}: is a directory, not a prompts file"),
    (b"", "{path}: no prompts in the file"),
    (b'{"prompt": "fine"}\n\xff\xfe\n', "{path}:2: not UTF-8 text (byte 0xff at column 1)"),
    (b'{"prompt": "fine"}\n["a list"]\n', "{path}:2: expected JSON with 'prompt' or 'turns', got a JSON array"),
    (b'{"prompt": "fine"}\n\n{"text": "no prompt"}\n', "{path}:3: expected JSON with 'prompt' or 'turns', got the "
                                                        "keys 'text'"),
    (b'{"turns": []}\n', "{path}:1: 'turns' must be a string or a non-empty list of strings, got []"),
])
def test_a_bad_prompts_file_exits_2_naming_the_file_and_line(tmp_path, content, message):
    path = tmp_path / "prompts.jsonl"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    # The model does not exist: the prompts are read, and refused, before anything is loaded.
    code, out, err = run_main("--model", tmp_path / "missing", "--prompts-file", path)
    assert (code, out) == (2, "")
    assert err == f"error: {message.format(path=path)}\n"


def test_a_missing_prompts_file_exits_2(tmp_path):
    path = tmp_path / "missing.jsonl"
    code, out, err = run_main("--model", tmp_path / "missing", "--prompts-file", path)
    assert (code, out, err) == (2, "", f"error: {path}: cannot be read (No such file or directory)\n")


@pytest.mark.parametrize("seed", [2**63, -2**63 - 1])
def test_a_seed_outside_int64_exits_2(tmp_path, seed):
    code, out, err = run_main("--model", tmp_path / "missing", "--seed", seed)
    assert (code, out) == (2, "")
    assert err == f"error: --seed must be an integer from -2^63 to 2^63 - 1, got {seed}\n"


def test_string_turns_and_a_byte_order_mark(model_dir, cache_dir, tmp_path):  # noqa: F811
    """MT-Bench lines whose `turns` is one string, in a file saved with a BOM; the largest seed, which the
    second prompt (decoded on its own, at seed + 1) wraps past."""
    path = tmp_path / "questions.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(question) for question in [
        {"question_id": 1, "category": "writing", "turns": "write a short poem"},
        {"question_id": 2, "category": "writing", "turns": ["the blue sky", "now shorter"]}]).encode())
    argv = ["--model", model_dir, "--cache-dir", cache_dir, "--prompts-file", path, "--max-new-tokens", 2,
            "--temperature", 1, "--seed", 2**63 - 1]
    code, out, err = run_main(*argv, "--json")
    assert code == 0, err
    assert [record["prompt"] for record in records(out)] == ["write a short poem", "the blue sky"]
    code, out, err = run_main(*argv)  # text, one prompt at a time
    assert code == 0, err
    assert ">>> write a short poem" in out and ">>> the blue sky" in out


@pytest.mark.parametrize("template, raised", [
    ("{{ raise_exception('no system prompts here') }}", "(TemplateError: no system prompts here)"),
    ("{% macro down(n) %}{{ down(n + 1) }}{% endmacro %}{{ down(0) }}", "(RecursionError: maximum recursion depth"),
])
def test_a_chat_template_that_raises_exits_2_naming_it(model_dir, tmp_path, template, raised):  # noqa: F811
    broken = tmp_path / "model"
    shutil.copytree(model_dir, broken)
    tokenizer = tokenization.load(broken)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(broken)
    template_file = tokenization.template_file(tokenization.load(broken))
    assert template in Path(template_file).read_text()
    code, out, err = run_main("--model", broken, "--prompt", "the sea", "--no-compile-cache")
    assert (code, out) == (2, "")
    assert err.startswith(f"error: {template_file}: the chat template failed on these messages {raised}"), err
    assert err.count("\n") == 1 and "Traceback" not in err
