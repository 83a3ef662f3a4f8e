"""`python -m eagle_jax.generate` on a tiny converted model with a word-level tokenizer and chat template."""

import json

import pytest

from convert import __main__ as convert_cli
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib
from eagle_jax.cli import generate
from eagle_jax.io import models
from eagle_jax.decode import tree as tree_lib

WORDS = ["the", "sea", "a", "poem", "write", "short", "about", "sky", "blue", "and"]
SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MAX_NEW = 6


def save_tokenizer(directory, vocab_size: int):
    """A WordLevel tokenizer over exactly `vocab_size` tokens (ids 1 and 2 are bos and eos, as the model's)."""
    import tokenizers
    import transformers

    words = WORDS + [f"w{i}" for i in range(vocab_size - len(SPECIALS) - len(WORDS))]
    vocab = {token: index for index, token in enumerate(SPECIALS + words)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        additional_special_tokens=SPECIALS[3:])
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    assert len(tokenizer) == vocab_size
    return tokenizer


@pytest.fixture(scope="module")
def model_dir(hf_llama, tmp_path_factory):
    """A converted model directory (via eagle-jax-convert) holding the tokenizer."""
    _, source, _ = hf_llama(seed=21)
    save_tokenizer(source, 101)
    out = tmp_path_factory.mktemp("cli") / "model"
    assert convert_cli.main([str(source), str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def aligned_model_dir(model_dir, aligned_target, tmp_path_factory):
    """`model_dir` (same config and tokenizer) with a target whose next token an `agreeing_head` often drafts."""
    return models.save_converted(aligned_target(), model_dir, tmp_path_factory.mktemp("cli") / "aligned")


@pytest.fixture(scope="module")
def head_dir(aligned_model_dir, agreeing_head, save_head, tmp_path_factory):
    """An EAGLE-1 head whose drafts the aligned target accepts sometimes, not always."""
    target, _ = models.load_target(aligned_model_dir)
    return save_head(agreeing_head(target.config, 0.3, residual=1.0, seed=1), tmp_path_factory.mktemp("cli") / "head")


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """Shared by the calls below: each builds a new engine, whose programs then load from disk."""
    return tmp_path_factory.mktemp("xla")


def run(capsys, model_dir, cache_dir, *argv):
    code = generate.main(["--model", str(model_dir), "--cache-dir", str(cache_dir), "--max-new-tokens", str(MAX_NEW),
                          *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


def records(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def in_input_order(out: str) -> list[dict]:
    """The records sorted by `index` (the continuous scheduler writes each as it finishes), each index once."""
    got = sorted(records(out), key=lambda record: record["index"])
    assert [record["index"] for record in got] == list(range(len(got)))
    return got


def chat_ids(model_dir, text: str) -> list[int]:
    """The ids the CLI should feed the engine: `text` as a user message through the chat template."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(ids, add_special_tokens=False)["input_ids"]
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|user|>")
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    return ids


def test_json_output(model_dir, cache_dir, capsys):
    code, out, err = run(capsys, model_dir, cache_dir, "--prompt", "write a poem", "--prompt", "the blue sky",
                         "--json", "--ignore-eos")
    assert code == 0, err
    first, second = records(out)
    assert [first["prompt"], second["prompt"]] == ["write a poem", "the blue sky"]
    assert [first["index"], second["index"]] == [0, 1]
    for record in (first, second):
        assert set(record) >= {"index", "prompt", "text", "token_ids", "num_tokens", "seconds", "tokens_per_second",
                               "compile_seconds", "method", "num_speculative_tokens", "acceptance_length",
                               "acceptance_rate_per_position", "num_drafts", "num_draft_tokens", "num_accepted_tokens"}
        assert record["num_tokens"] == len(record["token_ids"]) == MAX_NEW
        # The rate is the tokens over the generation time (seconds are rounded to 0.1 ms).
        assert record["seconds"] > 0 and abs(MAX_NEW / record["tokens_per_second"] - record["seconds"]) <= 1e-4
        assert record["method"] == "none" and record["num_speculative_tokens"] == 0
        assert record["acceptance_length"] == 1.0 and record["num_drafts"] == 0
        assert record["acceptance_rate_per_position"] == []
    # Compilation (or loading the programs from disk) is timed apart from generation: the first
    # prompt pays it, the second has the same shapes and reuses the first's programs.
    assert first["compile_seconds"] > 0 and second["compile_seconds"] == 0
    # The CLI applies the chat template, then generates what the engine generates for those ids.
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    ids = chat_ids(model_dir, "write a poem")
    target, _ = models.load_target(model_dir)
    engine = engine_lib.Engine(target, config=config_lib.EngineConfig(max_length=512, cache_dir=cache_dir))  # the CLI's programs, from disk
    [expected] = engine.generate([ids], max_new_tokens=MAX_NEW, ignore_eos=True)
    assert engine.num_compilations == 0
    assert first["token_ids"] == expected.token_ids
    assert first["text"] == tokenizer.decode(expected.token_ids, skip_special_tokens=True)


def test_prompts_file_with_mt_bench_turns(model_dir, cache_dir, tmp_path, capsys):
    prompts = tmp_path / "questions.jsonl"
    prompts.write_text("\n".join([
        json.dumps({"question_id": 81, "category": "writing", "turns": ["write a short poem", "now shorter"]}),
        "",
        json.dumps({"prompt": "the sea and the sky"}),
    ]))
    code, out, err = run(capsys, model_dir, cache_dir, "--prompts-file", prompts, "--json", "--no-chat")
    assert code == 0, err
    assert [r["prompt"] for r in records(out)] == ["write a short poem", "the sea and the sky"]


def test_streams_text_and_summary(model_dir, cache_dir, capsys):
    code, out, err = run(capsys, model_dir, cache_dir, "--prompt", "the sea", "--ignore-eos")
    assert code == 0, err
    assert ">>> the sea" in out and len(out.split(">>> the sea", 1)[1].split()) >= 1  # streamed words
    assert f"{MAX_NEW} tokens in" in err and "tokens/s" in err


def test_draft_reports_acceptance(aligned_model_dir, head_dir, cache_dir, capsys):
    text = "write a poem about the sea"
    common = ("--prompt", text, "--json", "--ignore-eos")
    code, out, err = run(capsys, aligned_model_dir, cache_dir, *common, "--draft", head_dir,
                         "--num-speculative-tokens", 2)
    assert code == 0, err
    [record] = records(out)
    assert record["method"] == "eagle" and record["num_speculative_tokens"] == 2
    # The record carries the engine's counters for this prompt, and this head's drafts are accepted
    # sometimes: a report of no acceptance (1.0, the plain-decoding value) would fail here.
    target, _ = models.load_target(aligned_model_dir)
    head = models.load_head(head_dir, target)
    engine = engine_lib.Engine(target, head, config=config_lib.EngineConfig(num_speculative_tokens=2, max_length=512, cache_dir=cache_dir))
    [expected] = engine.generate([chat_ids(aligned_model_dir, text)], max_new_tokens=MAX_NEW, ignore_eos=True)
    assert {name: record[name] for name in expected.stats} == expected.stats
    assert record["token_ids"] == expected.token_ids
    assert 0 < record["num_accepted_tokens"] < record["num_draft_tokens"] == 2 * record["num_drafts"]
    assert record["acceptance_length"] == 1 + record["num_accepted_tokens"] / record["num_drafts"]
    code, out, err = run(capsys, aligned_model_dir, cache_dir, *common)  # plain decoding: the same tokens
    assert code == 0, err
    assert records(out)[0]["token_ids"] == record["token_ids"]


def test_tree_flags_draft_a_tree(aligned_model_dir, head_dir, cache_dir, capsys):
    text = "write a poem about the sea"
    code, out, err = run(capsys, aligned_model_dir, cache_dir, "--prompt", text, "--json", "--ignore-eos", "--draft",
                         head_dir, "--speculative-eagle-topk", 2, "--speculative-num-steps", 2,
                         "--speculative-num-draft-tokens", 4)
    assert code == 0, err
    [record] = records(out)
    assert record["method"] == "eagle" and record["num_speculative_tokens"] is None
    assert (record["speculative_eagle_topk"], record["speculative_num_steps"],
            record["speculative_num_draft_tokens"]) == (2, 2, 4)
    target, _ = models.load_target(aligned_model_dir)
    engine = engine_lib.Engine(target, models.load_head(head_dir, target), config=config_lib.EngineConfig(tree=tree_lib.TreeOptions(2, 2, 4),
                               max_length=512, cache_dir=cache_dir))
    [expected] = engine.generate([chat_ids(aligned_model_dir, text)], max_new_tokens=MAX_NEW, ignore_eos=True)
    assert engine.num_compilations == 0  # the CLI's programs, from disk
    assert {name: record[name] for name in expected.stats} == expected.stats
    assert record["token_ids"] == expected.token_ids
    assert record["num_draft_tokens"] == 4 * record["num_drafts"] and record["num_accepted_tokens"] > 0
    code, out, err = run(capsys, aligned_model_dir, cache_dir, "--prompt", text, "--json", "--ignore-eos")
    assert code == 0, err
    plain = records(out)[0]
    assert plain["token_ids"] == record["token_ids"]  # greedy: the tree changes nothing but speed
    assert plain["speculative_eagle_topk"] is None and plain["num_speculative_tokens"] == 0


def test_batches_come_back_in_input_order(model_dir, cache_dir, capsys):
    """Three ragged prompts through two rows: each output is the prompt's own batch-1 generation,
    whichever scheduler runs them; with more than one prompt and row the default is continuous.
    Static batches write in input order; continuous slots as they finish, each with its `index`."""
    texts = ["write a short poem about the sea and the sky", "a", "the blue sky"]
    argv = [arg for text in texts for arg in ("--prompt", text)] + ["--json", "--ignore-eos", "--max-num-seqs", 2]
    target, _ = models.load_target(model_dir)
    engine = engine_lib.Engine(target, config=config_lib.EngineConfig(max_length=512))
    expected = [engine.generate([chat_ids(model_dir, text)], max_new_tokens=MAX_NEW, ignore_eos=True)[0].token_ids
                for text in texts]
    assert len(set(map(tuple, expected))) == 3
    for extra, scheduler in (((), "continuous"), (("--scheduler", "static"), "static")):
        code, out, err = run(capsys, model_dir, cache_dir, *argv, *extra)
        assert code == 0, err
        got = in_input_order(out) if scheduler == "continuous" else records(out)
        assert [r["prompt"] for r in got] == texts and [r["index"] for r in got] == [0, 1, 2]
        assert [r["token_ids"] for r in got] == expected
        assert {(r["scheduler"], r["batch_size"]) for r in got} == {(scheduler, 2)}
    # One prompt, or one row: nothing to refill, so static batching.
    for argv in (["--prompt", "a", "--max-num-seqs", 2], ["--prompt", "a", "--prompt", "the sea"]):
        code, out, err = run(capsys, model_dir, cache_dir, *argv, "--json")
        assert code == 0, err
        assert {r["scheduler"] for r in records(out)} == {"static"}


def test_speculation_disabled_by_batch_size(aligned_model_dir, head_dir, cache_dir, capsys):
    """Three prompts through two slots, drafting only while at most one is busy: plain decoding's
    tokens, with drafts in some steps and none in others."""
    texts = ["write a poem about the sea", "the blue sky", "a short poem"]
    argv = [arg for text in texts for arg in ("--prompt", text)] + ["--json", "--ignore-eos", "--max-num-seqs", 2]
    code, out, err = run(capsys, aligned_model_dir, cache_dir, *argv, "--draft", "none")
    assert code == 0, err
    expected = [r["token_ids"] for r in in_input_order(out)]
    code, out, err = run(capsys, aligned_model_dir, cache_dir, *argv, "--draft", head_dir, "--num-speculative-tokens",
                         2, "--speculative-disable-by-batch-size", 1)
    assert code == 0, err
    got = in_input_order(out)
    assert [r["token_ids"] for r in got] == expected
    assert sum(r["num_drafts"] for r in got) > 0
    assert any(r["num_tokens"] - 1 - r["num_drafts"] - r["num_accepted_tokens"] >= 1 for r in got)  # plain steps


def test_default_k_is_looked_up_for_the_batch_size(model_dir, cache_dir, capsys, monkeypatch):
    """The shipped heads' k comes from defaults.json for the batch size asked for (`heads.best_k`)."""
    from eagle_jax import heads

    asked = []
    real = heads.draft_plan
    monkeypatch.setattr(heads, "draft_plan", lambda *args: asked.append(args) or real(*args))
    code, _, err = run(capsys, model_dir, cache_dir, "--prompt", "a", "--max-num-seqs", 4, "--json")
    assert code == 0, err
    assert [args[-1] for args in asked] == [4]


def test_no_compile_cache(model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EAGLE_JAX_CACHE_DIR", str(tmp_path / "unused"))
    code = generate.main(["--model", str(model_dir), "--prompt", "a", "--max-new-tokens", "2", "--json",
                          "--no-compile-cache"])
    assert code == 0, capsys.readouterr().err
    assert not (tmp_path / "unused").exists()


def test_cache_dir_others_can_write_exits_2(model_dir, tmp_path, capsys):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    code = generate.main(["--model", str(model_dir), "--cache-dir", str(shared), "--prompt", "a",
                          "--max-new-tokens", "2", "--json"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and "writable by other users" in err
    assert "Traceback" not in err and list(shared.iterdir()) == []


@pytest.mark.parametrize("argv, message", [
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--prompts-file", "{bad}"], ":2: expected JSON with 'prompt' or 'turns'"),
    (["--model", "{missing}"], "does not exist"),
    (["--batch-size", "0"], "batch_size must be an integer >= 1, got 0"),
])
def test_bad_input_exits_2_without_traceback(model_dir, tmp_path, capsys, argv, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"turns": ["fine"]}) + "\n{not json\n")
    argv = [arg.format(bad=bad, missing=tmp_path / "missing") for arg in argv]
    if "--model" not in argv:
        argv = ["--model", str(model_dir), *argv]
    code = generate.main([*argv, "--no-compile-cache"])
    out, err = capsys.readouterr()
    assert code == 2
    assert err.startswith("error:") and message in err and "Traceback" not in err
    assert out == ""


@pytest.mark.parametrize("argv, message", [
    (["--num-speculative-tokens", "-1"], "num_speculative_tokens must be an integer >= 0, got -1"),
    (["--max-new-tokens", "-5"], "--max-new-tokens must be >= 1, got -5"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
    (["--max-length", "0"], "max_length must be an integer >= 1, got 0"),
    (["--temperature", "-0.5"], "--temperature must be >= 0 and finite, got -0.5"),
    (["--temperature", "nan"], "--temperature must be >= 0 and finite, got nan"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1], got 1.5"),
    (["--top-p", "-0.1"], "--top-p must be in (0, 1], got -0.1"),
    (["--speculative-eagle-topk", "0", "--speculative-num-steps", "2", "--speculative-num-draft-tokens", "2"],
     "--speculative-eagle-topk must be an integer >= 1, got 0"),
    (["--speculative-eagle-topk", "2", "--speculative-num-steps", "2", "--speculative-num-draft-tokens", "7"],
     "--speculative-num-draft-tokens must be an integer from --speculative-num-steps (2) to --speculative-eagle-topk "
     "+ (--speculative-num-steps - 1) * --speculative-eagle-topk^2 (6), got 7"),
    (["--speculative-eagle-topk", "2"], "a draft tree needs all of --speculative-eagle-topk, --speculative-num-steps, "
                                        "--speculative-num-draft-tokens"),
    (["--num-speculative-tokens", "2", "--speculative-eagle-topk", "2", "--speculative-num-steps", "2",
      "--speculative-num-draft-tokens", "3"], "num_speculative_tokens (a chain) and tree exclude each other"),
    (["--max-num-seqs", "0"], "batch_size must be an integer >= 1, got 0"),
    (["--speculative-disable-by-batch-size", "0"], "speculative_disable_by_batch_size must be an integer >= 1, got 0"),
    (["--tensor-parallel-size", "0"], "tensor_parallel_size must be an integer >= 1, got 0"),
])
def test_bad_numeric_flag_exits_2_before_loading(tmp_path, capsys, argv, message):
    # The model path does not exist: a flag checked after loading would report that instead.
    code = generate.main(["--model", str(tmp_path / "missing"), "--no-compile-cache", *argv])
    out, err = capsys.readouterr()
    assert code == 2
    assert err == f"error: {message}\n" and out == ""


def test_an_unknown_scheduler_is_refused_by_the_parser(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        generate.main(["--model", str(tmp_path / "missing"), "--scheduler", "dynamic"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'dynamic'" in capsys.readouterr().err


def test_prompt_longer_than_the_cache_exits_2(model_dir, tmp_path, capsys):
    long_prompt = " ".join(WORDS * 3)
    code = generate.main(["--model", str(model_dir), "--no-compile-cache", "--max-length", "16",
                          "--prompt", long_prompt, "--max-new-tokens", "4"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.startswith("error: prompt 0 has ") and "more than max_length=16" in err and "Traceback" not in err


def test_token_ids_outside_the_model_vocabulary_exit_2(model_dir, tmp_path, capsys):
    """A tokenizer larger than the model's vocabulary yields ids the model has no row for."""
    import shutil

    bigger = tmp_path / "model"
    shutil.copytree(model_dir, bigger)
    tokenizer = save_tokenizer(bigger, 110)
    bad_id = tokenizer.convert_tokens_to_ids("w90")
    assert bad_id >= 101
    code = generate.main(["--model", str(bigger), "--no-compile-cache", "--no-chat", "--prompt", "the sea w90"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err == f"error: token id {bad_id} is outside the vocabulary [0, 101)\n"


@pytest.mark.parametrize("other, message", [
    (dict(hidden_size=48, head_dim=12), "head does not fit target: head hidden_size=48, target hidden_size=32"),
    (dict(vocab_size=120), "head does not fit target: head vocab_size=120, target vocab_size=101"),
])
def test_head_for_another_target_exits_2(model_dir, random_target, tmp_path, capsys, other, message):
    # A well-formed EAGLE-1 head in its published layout, made for a target of another shape.
    from tests.io.test_public_layouts import eagle1_checkpoint, write_checkpoint

    head_dir = write_checkpoint(tmp_path / "head", *eagle1_checkpoint(random_target(seed=3, **other)))
    code = generate.main(["--model", str(model_dir), "--no-compile-cache", "--draft", str(head_dir),
                          "--num-speculative-tokens", "2", "--prompt", "the sea"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err == f"error: {head_dir}: {message}\n"  # the head named, then what does not fit
