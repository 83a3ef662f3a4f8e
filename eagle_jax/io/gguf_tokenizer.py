"""Builds a Hugging Face fast tokenizer from a GGUF's tokenizer metadata, without torch.

A GGUF has no `tokenizer.json`: llama.cpp stores the vocabulary, merges, token types and
special token ids as `tokenizer.ggml.*` metadata, and names the pre-tokenizer (the regex that
cuts text into words before BPE) by a short string, `tokenizer.ggml.pre`. This module turns
that back into a `tokenizer.json` and `tokenizer_config.json` with the `tokenizers` package,
which transformers' `PreTrainedTokenizerFast` then loads.

transformers can read a GGUF's tokenizer too, but its reader imports torch, and it ignores
`pre` names it does not list (SmolLM2's "smollm" among them), falling back to GPT-2's
regex. Here each supported `pre` means what llama.cpp's `llama-vocab.cpp` makes it mean
(llama.cpp checks each name against the model's own tokenizer when adding it); an unknown
name is an error, not a guess.

Only byte-level BPE vocabularies (`tokenizer.ggml.model` "gpt2") are supported.
"""

import json
import pathlib

import gguf
import tokenizers
from tokenizers import decoders, pre_tokenizers, processors

from eagle_jax.io import hf_files

# GGUF token types (gguf.TokenType): control tokens such as <|im_start|> are special; a
# user-defined one such as <think> is matched whole in text but is not special.
_CONTROL = 3
_USER_DEFINED = 4

# The original Hugging Face regexes (llama.cpp's equivalents are rewritten for its own regex
# engine, which lacks `(?i:...)`).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# `pre` name -> how text is cut into words, grouped as llama-vocab.cpp groups them:
# "gpt2" is GPT-2's regex (byte-level's own), "digits+gpt2" splits off every digit first,
# anything else is a regex used in place of GPT-2's.
_PRE_TOKENIZERS = {
    # "default" is what a converter writes when it did not recognise the tokenizer. llama.cpp
    # then stacks extra punctuation and digit splits on GPT-2's regex; we follow transformers,
    # which uses GPT-2's alone, as the likelier intent of a byte-level vocabulary.
    **dict.fromkeys(["default", "gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4"], "gpt2"),
    **dict.fromkeys(["smollm", "starcoder", "refact", "codeshell", "exaone", "minerva-7b"], "digits+gpt2"),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "dbrx", "smaug-bpe"], _LLAMA3_SPLIT),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "megrez", "stablelm2"], _QWEN2_SPLIT),
}
# llama.cpp's Llama 3 group: a whole word found in the vocabulary is taken before any merging
# (as Llama 3's tokenizer.json says), and BOS is added unless the file says otherwise.
_LLAMA3_NAMES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"}
_SPECIAL_TOKEN_KEYS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
                       "unk_token": "unknown_token_id", "pad_token": "padding_token_id"}


def read_tokenizer(reader):
    """Builds the tokenizer a GGUF describes.

    Args:
        reader: An open `gguf.GGUFReader`.

    Returns:
        (tokenizer, config): a `tokenizers.Tokenizer` and the `tokenizer_config.json` entries
        for it (special token strings, `add_bos_token`, `add_eos_token`, `chat_template`).

    Raises:
        CheckpointError: If the tokenizer model or pre-tokenizer is not supported, or the
            metadata is incomplete.
    """
    filename = reader.data.filename
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise hf_files.CheckpointError(
            f"{filename}: tokenizer model {model!r} is not supported (only 'gpt2', byte-level BPE)")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise hf_files.CheckpointError(
            f"{filename}: pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(_PRE_TOKENIZERS))})")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = _field(reader, "tokenizer.ggml.merges")
    if not tokens or merges is None:
        raise hf_files.CheckpointError(f"{filename}: no tokenizer.ggml.tokens or tokenizer.ggml.merges")
    token_types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    added = {index: token_type for index, token_type in enumerate(token_types)
             if token_type in (_CONTROL, _USER_DEFINED)}

    # Added tokens keep the raw text they match; the rest are in byte-level spelling already
    # (respelling is for a converter that stored one as raw text).
    vocabulary = {(token if index in added else _byte_level_spelling(token)): index
                  for index, token in enumerate(tokens)}
    if len(vocabulary) != len(tokens):
        raise hf_files.CheckpointError(f"{filename}: tokenizer.ggml.tokens has duplicates")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(
        vocabulary, [_merge_pair(merge, filename) for merge in merges], fuse_unk=False,
        ignore_merges=pre in _LLAMA3_NAMES))
    tokenizer.pre_tokenizer = _pre_tokenizer(_PRE_TOKENIZERS[pre])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([tokenizers.AddedToken(tokens[index], special=True, normalized=False)
                                  for index, token_type in added.items() if token_type == _CONTROL])
    tokenizer.add_tokens([tokenizers.AddedToken(tokens[index], special=False, normalized=False)
                          for index, token_type in added.items() if token_type == _USER_DEFINED])
    if tokenizer.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise hf_files.CheckpointError(f"{filename}: an added token has no id of its own")

    config, special_ids = {}, {}
    for name, key in _SPECIAL_TOKEN_KEYS.items():
        if (index := _field(reader, f"tokenizer.ggml.{key}")) is not None:
            if not 0 <= index < len(tokens):
                raise hf_files.CheckpointError(f"{filename}: tokenizer.ggml.{key} {index} is out of range")
            config[name], special_ids[name] = tokens[index], index
    # llama.cpp's defaults when the file has no flag (transformers' GGUF reader never adds BOS then).
    config["add_bos_token"] = bool(_field(reader, "tokenizer.ggml.add_bos_token", pre in _LLAMA3_NAMES))
    config["add_eos_token"] = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))
    tokenizer.post_processor = _post_processor(config, special_ids, filename)
    if chat_template := _field(reader, "tokenizer.chat_template"):
        config["chat_template"] = chat_template
    return tokenizer, config


def save_tokenizer(reader_or_path, out_dir, max_length):
    """Writes `tokenizer.json` and `tokenizer_config.json` for a GGUF's tokenizer.

    Args:
        reader_or_path: An open `gguf.GGUFReader` or the path of a `.gguf` file.
        out_dir: An existing directory to write into.
        max_length: The model's context length, saved as `model_max_length`.

    Raises:
        CheckpointError: As `read_tokenizer`.
    """
    reader = reader_or_path
    if not isinstance(reader, gguf.GGUFReader):
        reader = gguf.GGUFReader(reader_or_path)
    tokenizer, config = read_tokenizer(reader)
    out_dir = pathlib.Path(out_dir)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        # The generic class reads tokenizer.json alone in transformers 4 and 5 alike.
        "tokenizer_class": "PreTrainedTokenizerFast",
        **config,
        "model_max_length": max_length,
        # Cleaning up would turn " ." into "." and break decode(encode(text)) == text.
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def _field(reader, key, default=None):
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _pre_tokenizer(split):
    """The pre-tokenizer for one `_PRE_TOKENIZERS` value; all end in byte-level spelling."""
    if split == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split == "digits+gpt2":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def _post_processor(config, special_ids, filename):
    """Adds BOS/EOS around encoded text as the config says (transformers 4 reads only this)."""
    edges = {}
    for name in ("bos", "eos"):
        edges[name] = []
        if config[f"add_{name}_token"]:
            if f"{name}_token" not in config:
                raise hf_files.CheckpointError(f"{filename}: add_{name}_token is set but there is no {name} token")
            edges[name] = [config[f"{name}_token"]]
    bos, eos = edges["bos"], edges["eos"]
    return processors.TemplateProcessing(
        single=bos + ["$A"] + eos, pair=bos + ["$A"] + eos + bos + ["$B:1"] + eos,
        special_tokens=[(config[f"{name}_token"], special_ids[f"{name}_token"]) for name in edges if edges[name]])


def _merge_pair(merge, filename):
    """Splits "a b" into ("a", "b"); searching from 1 as llama.cpp does allows a space-led left part."""
    cut = merge.find(" ", 1)
    if cut < 0:
        raise hf_files.CheckpointError(f"{filename}: merge {merge!r} is not two tokens")
    return merge[:cut], merge[cut + 1:]


def _byte_unicode_table():
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE's alphabet).

    Printable Latin-1 bytes stand for themselves; the others take the characters from U+0100 on.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHARACTER = _byte_unicode_table()
_ALPHABET = frozenset(_BYTE_TO_CHARACTER.values())


def _byte_level_spelling(token):
    """A token as byte-level BPE spells it: itself if already so, else its UTF-8 bytes mapped."""
    if set(token) <= _ALPHABET:
        return token
    return "".join(_BYTE_TO_CHARACTER[byte] for byte in token.encode("utf-8"))
