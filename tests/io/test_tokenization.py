"""Loading a model directory's tokenizer: generic fast tokenizers skip AutoTokenizer, others use it."""

import json

import pytest
import transformers

from eagle_jax.io import hf_files
from eagle_jax.io import tokenization

# A word-level tokenizer with a chat template (tests/ is on sys.path under pytest's default import mode).
from tests.cli.test_generate_cli import save_tokenizer

TEXTS = ["write a short poem about the sea", "the sky and the blue sea"]


def test_generic_fast_tokenizer_matches_auto_tokenizer_without_calling_it(tmp_path, monkeypatch):
    save_tokenizer(tmp_path, 101)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] in (
        "PreTrainedTokenizerFast", "TokenizersBackend")
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    expected = [tokenization.encode(reference, text, chat) for text in TEXTS for chat in (True, False)]

    def refuse(*args, **kwargs):
        raise AssertionError("AutoTokenizer is not needed for a generic fast tokenizer")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    tokenizer = tokenization.load(tmp_path)
    assert [tokenization.encode(tokenizer, text, chat) for text in TEXTS for chat in (True, False)] == expected
    assert tokenizer.chat_template == reference.chat_template and tokenizer.eos_token == reference.eos_token


def test_a_model_specific_tokenizer_class_goes_through_auto_tokenizer(tmp_path, monkeypatch):
    save_tokenizer(tmp_path, 101)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(dict(config, tokenizer_class="LlamaTokenizerFast")))
    calls = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda path, **kw: calls.append(path) or "auto")
    assert tokenization.load(tmp_path) == "auto" and calls == [str(tmp_path)]


@pytest.mark.parametrize("chat", [True, False])
def test_encode_applies_the_chat_template_only_when_asked(tmp_path, chat):
    save_tokenizer(tmp_path, 101)
    tokenizer = tokenization.load(tmp_path)
    ids = tokenization.encode(tokenizer, "the sea", chat)
    assert (tokenizer.convert_tokens_to_ids("<|assistant|>") in ids) == chat


def test_a_chat_template_that_raises_names_its_file_for_the_cli_only(tmp_path):
    save_tokenizer(tmp_path, 101)
    tokenizer = tokenization.load(tmp_path)
    tokenizer.chat_template = "{% macro down(n) %}{{ down(n + 1) }}{% endmacro %}{{ down(0) }}"
    with pytest.raises(tokenization.ChatTemplateError) as error:
        tokenization.encode(tokenizer, "the sea", chat=True)
    assert str(error.value).startswith(f"{tmp_path / 'chat_template.jinja'}: the chat template failed on these "
                                       "messages (RecursionError: maximum recursion depth exceeded")
    # The server sends encode_messages' message to its clients: no path of the machine in it.
    with pytest.raises(tokenization.ChatTemplateError) as error:
        tokenization.encode_messages(tokenizer, [{"role": "user", "content": "the sea"}])
    assert str(error.value).startswith("the chat template failed on these messages (RecursionError:")
    assert str(tmp_path) not in str(error.value)
    assert tokenization.encode(tokenizer, "the sea", chat=False)  # no template, no error


# ---- no code from a model directory ever runs, and nothing is asked ----

EVIL_MODULE = """
import pathlib
pathlib.Path({marker!r}).write_text("code from the model directory ran")
from transformers import PreTrainedTokenizerFast


class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""


class NoStdin:
    def read(self, *args):
        raise AssertionError("asked a question on stdin")

    readline = read


@pytest.mark.parametrize("where", ["tokenizer_config.json", "config.json"])
def test_a_tokenizer_that_needs_the_directorys_code_is_refused_without_asking(tmp_path, monkeypatch, capsys, where):
    save_tokenizer(tmp_path, 101)
    marker = tmp_path / "ran"
    (tmp_path / "evil_tokenizer.py").write_text(EVIL_MODULE.format(marker=str(marker)))
    auto_map = {"AutoTokenizer": [None, "evil_tokenizer.EvilTokenizer"]}
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(dict(config, tokenizer_class="EvilTokenizer",
                                           **({"auto_map": auto_map} if where == "tokenizer_config.json" else {}))))
    if where == "config.json":
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "auto_map": auto_map}))
    monkeypatch.setattr("sys.stdin", NoStdin())
    with pytest.raises(hf_files.CheckpointError, match=rf"{where}: the tokenizer needs code from the model directory "
                                                       r"\(auto_map names evil_tokenizer.EvilTokenizer, in "
                                                       r"evil_tokenizer.py\); eagle_jax never runs code"):
        tokenization.load(tmp_path)
    assert not marker.exists()
    assert capsys.readouterr().out == ""  # no question on stdout (where --json output goes)


def test_transformers_is_always_told_not_to_trust_remote_code(tmp_path, monkeypatch):
    save_tokenizer(tmp_path, 101)
    calls = []
    for cls in (transformers.AutoTokenizer, transformers.PreTrainedTokenizerFast):
        monkeypatch.setattr(cls, "from_pretrained", lambda path, calls=calls, **kwargs: calls.append(kwargs))
    tokenization.load(tmp_path)  # the generic class
    config_path = tmp_path / "tokenizer_config.json"
    config_path.write_text(json.dumps(dict(json.loads(config_path.read_text()), tokenizer_class="LlamaTokenizerFast")))
    tokenization.load(tmp_path)  # through AutoTokenizer
    assert calls == [{"trust_remote_code": False}] * 2


def test_transformers_refusing_remote_code_is_reported_as_ours(tmp_path, monkeypatch):
    save_tokenizer(tmp_path, 101)
    config_path = tmp_path / "tokenizer_config.json"
    config_path.write_text(json.dumps(dict(json.loads(config_path.read_text()), tokenizer_class="LlamaTokenizerFast")))

    def refuse(path, **kwargs):
        raise ValueError("The repository contains custom code ... Please pass the argument `trust_remote_code=True`")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    with pytest.raises(hf_files.CheckpointError, match="eagle_jax never runs code from a model directory") as error:
        tokenization.load(tmp_path)
    assert "trust_remote_code=True" not in str(error.value)  # not the advice to run it
