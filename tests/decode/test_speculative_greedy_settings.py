"""Greedy rows with per-request settings: speculation (chains and trees, EAGLE-1 and EAGLE-3 heads)
gives plain greedy decoding's tokens, token for token, under penalties, stop token ids, stop
strings, EOS, ignore_eos and min_tokens, all mixed in one batch; and plain greedy decoding under penalties and
min_tokens is what a NumPy reference over full forwards gives.

Heads and target are test_speculative_stops.py's (conftest's `speculation_target`, an EAGLE-1
head that agrees with it, an EAGLE-3 head biased to its frequent tokens), so steps accept drafts
that the penalties and the stop rules then have to treat exactly as plain decoding does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.decode import sampling
from eagle_jax.decode import tree as tree_lib
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib

MAX_NEW = 14
PROMPT_LENGTHS = (4, 9, 14, 6)
DRAFT_VOCAB = 64
PENALTIES = sampling.Sampling(repetition_penalty=1.8, presence_penalty=0.6, frequency_penalty=0.4)
DRAFTING = {  # (head kind, chain length or tree)
    "eagle-chain": ("eagle", 3), "eagle3-chain": ("eagle3", 4),
    "eagle-tree": ("eagle", tree_lib.TreeOptions(2, 3, 6)), "eagle3-tree": ("eagle3", tree_lib.TreeOptions(3, 3, 8)),
}


@pytest.fixture(scope="module")
def target(speculation_target):
    return speculation_target


@pytest.fixture(scope="module")
def prompts(random_prompts):
    return random_prompts(PROMPT_LENGTHS)


@functools.cache
def _engine(target, head, drafting):
    speculation = dict(tree=drafting) if isinstance(drafting, tree_lib.TreeOptions) else dict(
        num_speculative_tokens=drafting)
    return engine_lib.Engine(target, head, config=config_lib.EngineConfig(
        max_length=64, batch_size=len(PROMPT_LENGTHS), steps_per_call=3, **speculation))


def generate(target, head, drafting, prompts, settings, eos, tokenizer):
    return _engine(target, head, drafting).generate(prompts, max_new_tokens=MAX_NEW, sampling=settings, eos_ids=[eos],
                                                     tokenizer=tokenizer)


def outcome(results):
    return [(r.token_ids, r.finish_reason, r.stop_reason, r.text) for r in results]


@pytest.fixture(scope="module")
def free(target, prompts):
    """Plain greedy tokens without settings or EOS."""
    results = _engine(target, None, 0).generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
    tokens = [r.token_ids for r in results]
    assert all(len(set(t)) > 4 for t in tokens)  # not one repeated token: bookkeeping errors would show
    return tokens


@pytest.fixture(scope="module")
def mixed(free, chat_tokenizer):
    """(settings per row, EOS id): row 0 stops at a token it first emits at index 5, row 1 at the
    text of its tokens 3 and 4 (chat_tokenizer: one token a byte), row 2 is held by min_tokens past
    the EOS it first emits at index 2, and row 3, which emits that EOS early and repeats tokens
    later, is penalised and ignores EOS."""
    def first_new(row, index):
        return next(free[row][i] for i in range(index, MAX_NEW) if free[row][i] not in free[row][:i])

    eos = first_new(2, 2)
    assert eos in free[3][:5] and len(set(free[3])) < MAX_NEW  # row 3 would stop early, and repeats itself
    stop = chat_tokenizer.decode(free[1][3:5])
    assert len(stop) == 2 and stop not in chat_tokenizer.decode(free[1][:4])
    settings = [sampling.Sampling(stop_token_ids=(first_new(0, 5),)), sampling.Sampling(stop=stop),
                sampling.Sampling(min_tokens=free[2].index(eos) + 5), dataclasses.replace(PENALTIES, ignore_eos=True)]
    return settings, eos


def reference(target, prompt, settings: sampling.Sampling, eos: int) -> list[int]:
    """Greedy decoding by full forwards and NumPy penalties (HF's repetition penalty, OpenAI's
    presence and frequency), with EOS masked before min_tokens and ending the row after it."""
    forward = jax.jit(lambda tokens: target.logits(target(tokens, jnp.arange(tokens.shape[1])[None],
                                                          target.init_cache(1, tokens.shape[1]))[0])[0, -1])
    output = []
    while len(output) < MAX_NEW:
        logits = np.asarray(forward(jnp.asarray([list(prompt) + output], jnp.int32)), np.float64)
        counts = np.bincount(np.asarray(output, np.int64), minlength=len(logits))
        seen = (counts > 0) | np.isin(np.arange(len(logits)), prompt)
        logits = np.where(seen, np.where(logits > 0, logits / settings.repetition_penalty,
                                         logits * settings.repetition_penalty), logits)
        logits -= settings.frequency_penalty * counts + settings.presence_penalty * (counts > 0)
        if len(output) < settings.min_tokens:
            logits[eos] = -np.inf
        output.append(int(np.argmax(logits)))
        if output[-1] == eos and not settings.ignore_eos:
            break
    return output


def test_plain_greedy_follows_the_numpy_reference(target, prompts, free, mixed, chat_tokenizer):
    settings, eos = mixed
    results = generate(target, None, 0, prompts, settings, eos, chat_tokenizer)
    tokens, reasons = [r.token_ids for r in results], [r.finish_reason for r in results]
    stop = settings[0].stop_token_ids[0]
    assert tokens[0] == free[0][:free[0].index(stop) + 1] and (reasons[0], results[0].stop_reason) == ("stop", stop)
    assert tokens[1] == free[1][:5] and results[1].text == chat_tokenizer.decode(free[1][:3])
    assert (reasons[1], results[1].stop_reason) == ("stop", settings[1].stop[0])
    assert tokens[2] == reference(target, prompts[2], settings[2], eos)
    assert eos not in tokens[2][:settings[2].min_tokens] and eos in free[2][:settings[2].min_tokens]
    assert tokens[3] == reference(target, prompts[3], settings[3], eos)
    assert tokens[3] != free[3] and len(tokens[3]) == MAX_NEW and reasons[3] == "length"  # penalised, EOS ignored


@pytest.mark.parametrize("drafting", sorted(DRAFTING))
def test_speculation_equals_plain_greedy(target, prompts, mixed, agreeing_head, biased_eagle3_head, free, drafting,
                                        chat_tokenizer):
    settings, eos = mixed
    kind, steps = DRAFTING[drafting]
    frequent = np.argsort(-np.bincount(np.concatenate(free), minlength=target.config.vocab_size))[:2]
    head = (agreeing_head(target.config, 0.0) if kind == "eagle"
            else biased_eagle3_head(target.config, frequent, DRAFT_VOCAB, seed=3))
    results = generate(target, head, steps, prompts, settings, eos, chat_tokenizer)
    assert outcome(results) == outcome(generate(target, None, 0, prompts, settings, eos, chat_tokenizer))
    if kind == "eagle":  # drafts were accepted, so the penalties and stops saw accepted drafts
        assert sum(r.stats["num_accepted_tokens"] for r in results) > 0
