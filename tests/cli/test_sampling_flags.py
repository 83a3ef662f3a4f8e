"""`python -m eagle_jax.generate`'s sampling and stopping flags, --messages-file, and no silent
fallback to plain decoding when speculation is asked without a head (the tiny model and word-level
tokenizer of test_generate_cli.py)."""

from __future__ import annotations

import json

import pytest

from eagle_jax.cli import generate
from eagle_jax.decode import sampling
from eagle_jax.io import models, tokenization
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib
from tests.cli.test_generate_cli import MAX_NEW, cache_dir, chat_ids  # noqa: F401 (a fixture)
from tests.cli.test_generate_cli import model_dir, records, run  # noqa: F401 (fixtures, helpers)


@pytest.fixture(scope="module")
def library(model_dir, cache_dir):  # noqa: F811
    """The CLI's model through the library, with the CLI's programs (from the shared cache)."""
    target, tokenizer_dir = models.load_target(model_dir)
    engine = engine_lib.Engine(target, config=config_lib.EngineConfig(max_length=512, cache_dir=cache_dir))
    return engine, tokenization.load(tokenizer_dir)


def test_penalties_and_logprobs_reach_the_engine(model_dir, cache_dir, library, capsys):  # noqa: F811
    flags = ("--repetition-penalty", 1.5, "--presence-penalty", 1.0, "--frequency-penalty", 0.5, "--logprobs", 2,
             "--min-tokens", 3)
    code, out, err = run(capsys, model_dir, cache_dir, "--prompt", "write a poem", "--json", *flags)
    assert code == 0, err
    [record] = records(out)
    engine, tokenizer = library
    settings = sampling.Sampling(repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5, logprobs=2,
                                 min_tokens=3)
    [expected] = engine.generate([chat_ids(model_dir, "write a poem")], max_new_tokens=MAX_NEW, sampling=settings,
                                 tokenizer=tokenizer)
    assert record["token_ids"] == expected.token_ids and record["text"] == expected.text
    assert record["logprobs"] == expected.logprobs and len(record["logprobs"]) == record["num_tokens"]
    assert all(len(entry["top_logprobs"]) == 2 for entry in record["logprobs"])
    assert record["finish_reason"] == expected.finish_reason


def test_n_samples_print_n_records_each(model_dir, cache_dir, capsys):  # noqa: F811
    code, out, err = run(capsys, model_dir, cache_dir, "--prompt", "the sea", "--prompt", "the sky", "--json",
                         "--temperature", 1.0, "--top-k", 5, "--min-p", 0.05, "--n", 3, "--seed", 4, "--ignore-eos")
    assert code == 0, err
    got = records(out)
    assert [r["prompt"] for r in got] == ["the sea"] * 3 + ["the sky"] * 3
    assert all(r["num_tokens"] == MAX_NEW and r["finish_reason"] == "length" for r in got)
    assert len({tuple(r["token_ids"]) for r in got[:3]}) > 1  # the samples draw apart


def test_stop_strings_and_stop_ids(model_dir, cache_dir, capsys):  # noqa: F811
    code, out, err = run(capsys, model_dir, cache_dir, "--prompt", "the sea", "--json", "--ignore-eos")
    assert code == 0, err
    [free] = records(out)
    words = free["text"].split()
    assert len(words) == MAX_NEW and words[2] not in words[:2]
    code, out, err = run(capsys, model_dir, cache_dir, "--prompt", "the sea", "--json", "--ignore-eos",
                         "--stop", "never", "--stop", f" {words[2]}")
    assert code == 0, err
    [cut] = records(out)
    assert cut["text"] == " ".join(words[:2]) and (cut["finish_reason"], cut["stop_reason"]) == ("stop", f" {words[2]}")
    assert cut["token_ids"] == free["token_ids"][:3]
    stop_id = free["token_ids"][2]
    code, out, err = run(capsys, model_dir, cache_dir, "--prompt", "the sea", "--json", "--ignore-eos",
                         "--stop-token-ids", f"{stop_id},{stop_id + 1}")
    [ended] = records(out)
    assert ended["token_ids"] == free["token_ids"][:3] and ended["text"] == " ".join(words[:2])
    assert (ended["finish_reason"], ended["stop_reason"]) == ("stop", stop_id)
    code, out, err = run(capsys, model_dir, cache_dir, "--prompt", "the sea", "--ignore-eos", "--stop", f" {words[2]}")
    assert code == 0 and out.split(">>> the sea\n", 1)[1].strip() == " ".join(words[:2])  # streamed, cut too


def test_messages_file(model_dir, cache_dir, library, tmp_path, capsys):  # noqa: F811
    conversations = [[{"role": "system", "content": "be short"}, {"role": "user", "content": "the sea"}],
                     [{"role": "user", "content": "write"}, {"role": "assistant", "content": "a poem"},
                      {"role": "user", "content": "about the sky"}]]
    path = tmp_path / "messages.jsonl"
    path.write_text(json.dumps(conversations[0]) + "\n\n" + json.dumps({"messages": conversations[1]}) + "\n")
    code, out, err = run(capsys, model_dir, cache_dir, "--messages-file", path, "--json", "--ignore-eos")
    assert code == 0, err
    got = records(out)
    engine, tokenizer = library
    expected = engine.generate([tokenization.encode_messages(tokenizer, c) for c in conversations],
                               max_new_tokens=MAX_NEW, sampling=sampling.Sampling(ignore_eos=True))
    assert [r["token_ids"] for r in got] == [r.token_ids for r in expected]
    assert [r["prompt"] for r in got] == conversations


@pytest.mark.parametrize("lines, message", [
    (['[{"role": "user", "content": "hi"}]', '[{"role": "user"}]'], ":2: message 0's content must be a string"),
    (['{"role": "user", "content": "hi"}'], ":1: messages must be a non-empty list"),
    (['[{"role": "robot", "content": "hi"}]'], ":1: message 0 has role 'robot'"),
    (["[]"], ":1: messages must be a non-empty list"),
    (["{not json"], ":1: Expecting property name"),
    ([""], ": no conversations"),
])
def test_a_bad_messages_file_exits_2(model_dir, tmp_path, capsys, lines, message):  # noqa: F811
    path = tmp_path / "messages.jsonl"
    path.write_text("\n".join(lines) + "\n")
    code = generate.main(["--model", str(model_dir), "--no-compile-cache", "--messages-file", str(path)])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.startswith(f"error: {path}{message}") and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["--top-k", "-1"], "--top-k must be an integer >= 0 (0: off), got -1"),
    (["--min-p", "1.5"], "--min-p must be in [0, 1], got 1.5"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be a finite number > 0 (1: off), got 0.0"),
    (["--presence-penalty", "3"], "--presence-penalty must be in [-2, 2], got 3.0"),
    (["--frequency-penalty", "nan"], "--frequency-penalty must be in [-2, 2], got nan"),
    (["--logprobs", "21"], "--logprobs must be None or an integer in 0..20, got 21"),
    (["--stop", ""], "--stop must be a non-empty string or a list of them, got ('',)"),
    (["--stop-token-ids", "1,2,3,4,5,6,7,8,9"], "--stop-token-ids must be a list of at most 8 token ids >= 0"),
    (["--stop-token-ids", "-3"], "--stop-token-ids must be a list of at most 8 token ids >= 0, got (-3,)"),
    (["--min-tokens", "-1"], "--min-tokens must be an integer >= 0, got -1"),
    (["--n", "0"], "--n must be an integer in 1..128, got 0"),
])
def test_bad_sampling_flags_exit_2_before_loading(tmp_path, capsys, argv, message):
    # The model path does not exist: a flag checked after loading would report that instead.
    code = generate.main(["--model", str(tmp_path / "missing"), "--no-compile-cache", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and err.startswith(f"error: {message}"), err


def test_unparsable_stop_token_ids_are_refused_by_the_parser(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        generate.main(["--model", str(tmp_path / "missing"), "--stop-token-ids", "1,x"])
    assert exit_info.value.code == 2 and "expected comma-separated token ids, got '1,x'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, asked", [
    (["--method", "eagle3"], "--method eagle3"),
    (["--num-speculative-tokens", "2"], "2 drafts per step"),
    (["--speculative-eagle-topk", "2", "--speculative-num-steps", "2", "--speculative-num-draft-tokens", "3"],
     "2 drafts per step"),
])
def test_speculation_without_a_head_is_an_error(model_dir, capsys, argv, asked):  # noqa: F811
    """A model with no shipped head and no --draft: asking to speculate must not decode plainly in silence."""
    code = generate.main(["--model", str(model_dir), "--no-compile-cache", "--prompt", "the sea", *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "Traceback" not in err
    assert err.startswith(f"error: speculation ({asked}) needs a draft head for --model {model_dir}") and "--draft" in err
    assert generate.main(["--model", str(model_dir), "--no-compile-cache", "--prompt", "the sea", "--json",
                          "--max-new-tokens", "2", "--num-speculative-tokens", "0"]) == 0  # k = 0 asks for none
