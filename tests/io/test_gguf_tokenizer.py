"""Tests for eagle_jax.gguf_tokenizer: tiny hand-written GGUFs, and the default model against transformers."""

import json
import sys

import gguf
import pytest

from eagle_jax.io import gguf_tokenizer
from eagle_jax.io import hf_files
from eagle_jax.io import tokenization

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# GPT-2's byte alphabet in byte order: printable Latin-1 bytes stand for themselves, the other
# 68 bytes take U+0100.. in order (written out here independently of the module's table).
_PRINTABLE = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
_OTHER_BYTES = [byte for byte in range(256) if byte not in _PRINTABLE]
BYTE_TOKENS = [chr(byte) if byte in _PRINTABLE else chr(0x100 + _OTHER_BYTES.index(byte)) for byte in range(256)]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġ Ġ", "1 2", "12 3"]
USER_DEFINED = "<think>"
TOKENS = SPECIALS + BYTE_TOKENS + [merge.replace(" ", "") for merge in MERGES] + [USER_DEFINED]
TOKEN_TYPES = [3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS) - 1) + [4]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def ids(*tokens):
    return [TOKENS.index(token) for token in tokens]


def write_tokenizer_gguf(path, model="gpt2", pre="smollm", add_bos=None):
    """A GGUF holding only tokenizer metadata: the byte alphabet, MERGES and SmolLM2's special tokens."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(TOKENS)
    writer.add_token_types(TOKEN_TYPES)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny_tokenizer(tmp_path):
    """Factory: `tiny_tokenizer(**write_tokenizer_gguf options)` -> the saved tokenizer, loaded."""
    def make(**options):
        out_dir = tmp_path / "tokenizer"
        out_dir.mkdir()
        gguf_tokenizer.save_tokenizer(write_tokenizer_gguf(tmp_path / "t.gguf", **options), out_dir, 256)
        return tokenization.load(out_dir)
    return make


def test_merges_and_byte_level_spelling(tiny_tokenizer):
    tokenizer = tiny_tokenizer()
    assert tokenizer("hello world")["input_ids"] == ids("hello", "Ġwor", "ld")
    # Unicode becomes its UTF-8 bytes: é is C3 A9, 😀 is F0 9F 98 80.
    assert tokenizer("é😀")["input_ids"] == ids(*(BYTE_TOKENS[byte] for byte in "é😀".encode()))
    assert tokenizer("\t\n")["input_ids"] == ids(BYTE_TOKENS[9], BYTE_TOKENS[10])
    for text in ["hello world", "é😀 日本語", "a  \t\n\n 1234 ", "<thin k>"]:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


@pytest.mark.parametrize("pre, expected", [
    ("smollm", ["a", "ĠĠ", "4", "1", "2", "3"]),  # every digit split off first
    ("gpt-2", ["a", "Ġ", "Ġ", "4", "123"]),  # " 4123" is one word
    ("llama-bpe", ["a", "Ġ", "Ġ", "4", "12", "3"]),  # digits in threes: "412", "3"
    ("qwen2", ["a", "Ġ", "Ġ", "4", "1", "2", "3"]),
])
def test_pre_tokenizer_follows_the_pre_name(tiny_tokenizer, pre, expected):
    assert tiny_tokenizer(pre=pre)("a  4123", add_special_tokens=False)["input_ids"] == ids(*expected)


def test_special_and_user_defined_tokens(tiny_tokenizer):
    tokenizer = tiny_tokenizer()
    text = "<|im_start|>user\nhello<think><|im_end|>"
    assert tokenizer(text)["input_ids"] == ids("<|im_start|>", "u", "s", "e", "r", "Ċ", "hello", USER_DEFINED,
                                              "<|im_end|>")
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == "user\nhello<think>"
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token, tokenizer.pad_token) == (
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>")
    assert len(tokenizer) == len(TOKENS)


def test_config_and_chat_template(tiny_tokenizer, tmp_path):
    tokenizer = tiny_tokenizer()
    config = json.loads((tmp_path / "tokenizer" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and config["chat_template"] == CHAT_TEMPLATE
    assert config["model_max_length"] == tokenizer.model_max_length == 256
    assert tokenization.encode(tokenizer, "hello", chat=False) == ids("hello")
    assert tokenization.encode(tokenizer, "hello", chat=True) == ids(
        "<|im_start|>", "u", "s", "e", "r", "Ċ", "hello", "<|im_end|>", "Ċ", "<|im_start|>", "a", "s", "s", "i", "s",
        "t", "a", "n", "t", "Ċ")


@pytest.mark.parametrize("pre, add_bos, expected", [
    ("smollm", None, ids("hello")), ("smollm", True, ids("<|im_start|>", "hello")),
    ("llama-bpe", None, ids("<|im_start|>", "hello")),  # llama.cpp's default for Llama 3 vocabularies
    ("llama-bpe", False, ids("hello")),
])
def test_add_bos_token(tiny_tokenizer, pre, add_bos, expected):
    assert tiny_tokenizer(pre=pre, add_bos=add_bos)("hello")["input_ids"] == expected


def test_saving_needs_neither_torch_nor_transformers(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # None in sys.modules makes `import torch` fail
    monkeypatch.setitem(sys.modules, "transformers", None)
    gguf_tokenizer.save_tokenizer(write_tokenizer_gguf(tmp_path / "t.gguf"), tmp_path, 256)
    assert (tmp_path / "tokenizer.json").is_file() and (tmp_path / "tokenizer_config.json").is_file()


@pytest.mark.parametrize("model", ["llama", "rwkv"])
def test_unsupported_tokenizer_model_is_an_error(tmp_path, model):
    with pytest.raises(hf_files.CheckpointError, match=f"tokenizer model '{model}'"):
        gguf_tokenizer.save_tokenizer(write_tokenizer_gguf(tmp_path / "t.gguf", model=model), tmp_path, 256)


def test_unknown_pre_tokenizer_is_an_error(tmp_path):
    with pytest.raises(hf_files.CheckpointError, match="pre-tokenizer 'made-up'"):
        gguf_tokenizer.save_tokenizer(write_tokenizer_gguf(tmp_path / "t.gguf", pre="made-up"), tmp_path, 256)


AWKWARD = ["Hello 🌊 world 😀🎉", "日本語のテキスト、中文，한국어", "1234567890123", "pi is 3.14159, not 22/7",
           "a   b    c     d", "\t\ttabs\tand\n\nnewlines\r\n  indented\n\n\n", "   leading and trailing   ",
           "<|im_start|>user hi<|im_end|>", "text <|endoftext|> more", "don't you'll I'M", "naïve café ½ µ",
           "  multiple   spaces", "Hello world! 123", "hello  123", "\n\n1. first\n 2. second"]
# Ids the SmolLM2 tokenizer gives (as published in a third-party tokenizer's self-checks).
KNOWN_IDS = {"Hello, we can use": [19556, 28, 392, 416, 722],
             "Hello world! 123": [19556, 905, 17, 216, 33, 34, 35],
             "  multiple   spaces": [216, 2701, 256, 5600],
             "Café déjà vu.": [51, 1939, 2756, 32564, 90, 16739, 386, 101, 30]}


@pytest.mark.slow
def test_default_model_tokenizer_matches_transformers(tmp_path):
    """Ours against transformers' GGUF tokenizer on the same file (transformers needs torch to read it).

    transformers does not know the pre-tokenizer name "smollm" and falls back to GPT-2's regex,
    which keeps a digit with the whitespace run before it. llama.cpp and SmolLM2's own
    tokenizer.json split every digit off first, so the reference gets that one fix; the
    unfixed one must still agree on all MT-Bench prompts (no digit follows a run of spaces there).
    """
    pytest.importorskip("torch")
    import transformers
    from tokenizers import pre_tokenizers

    from eagle_jax.train import data
    from eagle_jax.io import default_model

    path = default_model.default_gguf_path()
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    unfixed = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    reference.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True), reference.backend_tokenizer.pre_tokenizer])
    gguf_tokenizer.save_tokenizer(path, tmp_path, 8192)
    ours = tokenization.load(tmp_path)

    prompts = [question["turns"][0] for question in data.load_mtbench()]
    assert len(prompts) == 80
    for text in prompts + AWKWARD:
        for chat in (True, False):
            assert tokenization.encode(ours, text, chat) == tokenization.encode(reference, text, chat), (text, chat)
    for text in prompts:
        for chat in (True, False):
            assert tokenization.encode(ours, text, chat) == tokenization.encode(unfixed, text, chat), (text, chat)
    for text in prompts + AWKWARD:
        if "<|" not in text:
            assert ours.decode(ours(text)["input_ids"]) == text
    for text, expected in KNOWN_IDS.items():
        assert ours(text)["input_ids"] == expected
    assert ours("1234567890123")["input_ids"] == [ours.convert_tokens_to_ids(digit) for digit in "1234567890123"]
    assert ours.chat_template == reference.chat_template and len(ours) == len(reference) == 49152
