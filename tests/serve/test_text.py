"""serve/text.py: streamed text equals the whole decode, whatever the chunking; stop strings cut exactly."""

from __future__ import annotations

import numpy as np
import pytest

from eagle_jax.serve import text as text_lib

CORPUS = ["The sea is wide. Les vagues déferlent — 海は広い 🌊🌊 and the tide turns.",
          "Stop here: END of line, then more text after END.", "naïve café ünïcödé 漢字 emoji 🙂🙃"]


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE (as SmolLM2's): multi-byte characters split across tokens."""
    import tokenizers
    import transformers

    bpe = tokenizers.ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS * 4, vocab_size=270, min_frequency=1, show_progress=False)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)


def chunks(ids, rng):
    cuts = sorted(rng.choice(np.arange(1, len(ids)), size=min(len(ids) - 1, 6), replace=False).tolist())
    return [ids[a:b] for a, b in zip([0] + cuts, cuts + [len(ids)])]


@pytest.mark.parametrize("seed", range(6))
def test_streamed_text_equals_the_whole_decode(tokenizer, seed):
    rng = np.random.default_rng(seed)
    assert any("\ufffd" in tokenizer.decode([i]) for i in tokenizer(CORPUS[0])["input_ids"])  # a token splits a character
    for line in CORPUS:
        ids = tokenizer(line)["input_ids"]
        stream = text_lib.TextStream(tokenizer)
        pieces = [stream.push(chunk) for chunk in chunks(ids, rng)] + [stream.finish()]
        assert "".join(pieces) == tokenizer.decode(ids) == line
        assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("stop", [["END"], [" then", "line,"], ["🌊"], ["ünï"], ["never appears"]])
def test_output_is_cut_before_the_first_stop_string(tokenizer, seed, stop):
    rng = np.random.default_rng(seed)
    for line in CORPUS:
        ids = tokenizer(line)["input_ids"]
        stream = text_lib.TextStream(tokenizer, stop=stop)
        pieces = []
        for chunk in chunks(ids, rng):
            pieces.append(stream.push(chunk))
            if stream.stopped:
                break
        pieces.append(stream.finish())
        hits = [at for at in (line.find(s) for s in stop) if at >= 0]
        assert "".join(pieces) == line[:min(hits)] if hits else line
        assert stream.stopped == bool(hits)


def test_nothing_that_may_start_a_stop_string_is_streamed_early(tokenizer):
    ids = tokenizer("Stop here: END of line")["input_ids"]
    stream = text_lib.TextStream(tokenizer, stop=["END of"])
    streamed = ""
    for token in ids:
        streamed += stream.push([token])
        assert "Stop here: ".startswith(streamed)  # never a character of the stop string, even one token at a time
    assert streamed + stream.finish() == "Stop here: "


def test_stop_token_ids_end_the_output_without_the_token(tokenizer):
    ids = tokenizer("The sea is wide.")["input_ids"]
    stream = text_lib.TextStream(tokenizer, stop_token_ids=[ids[3]])
    out = stream.push(ids) + stream.finish()
    assert stream.stopped and out == tokenizer.decode(ids[:3])
    assert stream.push(ids) == "" and stream.ids == ids[:3]


@pytest.mark.parametrize("stop", [[""], [None], ["ok", ""]])
def test_empty_stop_strings_are_refused(tokenizer, stop):
    with pytest.raises(ValueError, match="non-empty"):
        text_lib.TextStream(tokenizer, stop=stop)


@pytest.mark.parametrize("stop", ["END", " then", "🌊"])
def test_ids_end_with_the_token_that_completed_the_stop_string(tokenizer, stop):
    for line in CORPUS:
        if stop not in line:
            continue
        ids = tokenizer(line)["input_ids"]
        stream = text_lib.TextStream(tokenizer, stop=[stop])
        stream.push(ids)
        kept = stream.ids
        assert stop in tokenizer.decode(kept) and stop not in tokenizer.decode(kept[:-1]).rstrip("\ufffd")
        assert kept == ids[:len(kept)]
