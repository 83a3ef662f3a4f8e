"""Loading a model directory's tokenizer: generic fast tokenizers skip AutoTokenizer, others use it."""

import json

import pytest
import transformers

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
