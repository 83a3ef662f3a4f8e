"""Speculative decoding where rows stop early: at EOS, at the token budget, at the cache's end.

These run the benchmark's configuration (`fixed_shapes=True`, EOS on, float32 and bfloat16), with
heads that often agree with the target (conftest's `aligned_target`, `agreeing_head`,
`biased_eagle3_head`), so steps accept drafts that EOS or the budget then cuts off (the EAGLE-1
head often does; the EAGLE-3 head accepts rarely and mainly checks the rules hold there too).

Statistics count a draft as accepted only if it was emitted. A row gets one token from prefill
and, per step while active (`num_drafts`), its accepted drafts and one more token; only its
last step can be cut, and a cut that drops that one more token leaves the step with accepted
drafts only. So for every row:
    num_tokens - 1 - num_accepted_tokens  is  num_drafts or num_drafts - 1.
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib
from eagle_jax.decode import tree as tree_lib
from tests.decode import speculation_fixtures

MAX_LENGTH = 64  # fixed_shapes: prompts up to 32 tokens, one 32-wide prefill and one 64-slot cache
MAX_NEW = 14  # not a multiple of k + 1 for either k below
PROMPT_LENGTHS = (1, 6, 13, 21)
DRAFT_VOCAB = 64
K = {"eagle": 3, "eagle3": 4}
TREES = {"eagle": tree_lib.TreeOptions(2, 3, 6), "eagle3": tree_lib.TreeOptions(3, 4, 8)}  # EAGLE-2 trees
EOS_STEP = 5  # the EOS id is a token that plain greedy first emits at about this index

target = speculation_fixtures.target
prompts = speculation_fixtures.prompts_fixture(PROMPT_LENGTHS)


@pytest.fixture(scope="module")
def models(target, prompts, agreeing_head, biased_eagle3_head, cast_module):
    """(target, head) by (head kind, dtype name); the bfloat16 ones are casts of the float32 ones."""
    free = plain(target, tuple(map(tuple, prompts)), MAX_NEW, None)
    frequent = np.argsort(-np.bincount(np.concatenate(free), minlength=target.config.vocab_size))[:2]
    heads = {"eagle": agreeing_head(target.config, 0.0),
             "eagle3": biased_eagle3_head(target.config, frequent, DRAFT_VOCAB, seed=3)}
    table = {}
    for kind, head in heads.items():
        table[kind, "float32"] = (target, head)
        table[kind, "bfloat16"] = (cast_module(target, jnp.bfloat16), cast_module(head, jnp.bfloat16))
    return table


@functools.cache
def _engine(target, head, k: int, tree: tree_lib.TreeOptions | None = None):
    drafting = dict(tree=tree) if tree else dict(num_speculative_tokens=k)
    return engine_lib.Engine(target, head, config=config_lib.EngineConfig(max_length=MAX_LENGTH, batch_size=2, fixed_shapes=True,
                                                                          steps_per_call=3, **drafting))


@functools.cache
def plain(target, prompts: tuple[tuple[int, ...], ...], max_new_tokens: int, eos: int | None) -> list[list[int]]:
    """Plain greedy generation (memoised), EOS off when `eos` is None."""
    results = _engine(target, None, 0).generate([list(p) for p in prompts], max_new_tokens=max_new_tokens,
                                                ignore_eos=eos is None, eos_ids=None if eos is None else [eos])
    return [r.token_ids for r in results]


def speculative(target, head, k, prompts, max_new_tokens, eos, tree=None):
    engine = _engine(target, head, k, tree)
    return engine.generate([list(p) for p in prompts], max_new_tokens=max_new_tokens, ignore_eos=eos is None,
                           eos_ids=None if eos is None else [eos])


def stopping_token(outputs: list[list[int]]) -> int:
    """A token some row first emits at index EOS_STEP or soon after: as EOS it cuts that row mid-way."""
    for index in range(EOS_STEP, EOS_STEP + 4):
        for row in outputs:
            if row[index] not in row[:index]:
                return row[index]
    raise AssertionError(f"no row emits a new token at indices {EOS_STEP}..{EOS_STEP + 3}: {outputs}")


def check_stats(result, k: int, draft_tokens: int | None = None) -> None:
    """The invariant of the module docstring, and the per-depth rates adding up to the accepted count.
    A tree's k is its depth; it verifies `draft_tokens` nodes per step."""
    stats = result.stats
    drafts, accepted = stats["num_drafts"], stats["num_accepted_tokens"]
    assert result.num_tokens - 1 - accepted in (drafts - 1, drafts), (result.token_ids, stats)
    assert stats["num_draft_tokens"] == (draft_tokens or k) * drafts
    assert stats["acceptance_length"] == pytest.approx(1 + accepted / drafts if drafts else 1.0)
    rates = stats["acceptance_rate_per_position"]
    assert len(rates) == k and sum(rates) * drafts == pytest.approx(accepted)
    assert all(a >= b for a, b in zip(rates, rates[1:]))


def ended_on_eos(tokens: list[int], eos: int, max_new_tokens: int) -> bool:
    return len(tokens) < max_new_tokens and tokens[-1] == eos


@pytest.mark.parametrize("kind", sorted(K))
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eos_and_budget_cuts(models, prompts, kind, dtype):
    """Greedy speculative output equals plain greedy output with EOS on, and the stats count only
    what was emitted. The EOS id is one that plain greedy emits mid-generation."""
    target, head = models[kind, dtype]
    k = K[kind]
    key = tuple(map(tuple, prompts))
    eos = stopping_token(plain(target, key, MAX_NEW, None))
    expected = plain(target, key, MAX_NEW, eos)
    assert any(ended_on_eos(tokens, eos, MAX_NEW) for tokens in expected)  # EOS cuts mid-generation
    assert any(len(tokens) == MAX_NEW for tokens in expected)  # and the budget cuts another row
    results = speculative(target, head, k, prompts, MAX_NEW, eos)
    for result in results:
        check_stats(result, k)
    assert sum(r.stats["num_accepted_tokens"] for r in results) > 0  # drafts were accepted at all
    tokens = [r.token_ids for r in results]
    if dtype == "float32":
        assert tokens == expected
    else:
        # bf16: verifying k+1 tokens at once and decoding one token at a time may round differently,
        # so the outputs may part at a near tie; they must still stop by the same rules. (They agree
        # on CPU today, but along these outputs the smallest top-2 logit gap, 0.004, is below the
        # bf16 target's logit error, ~0.02: equality would be luck, not a property.)
        assert all(ended_on_eos(t, eos, MAX_NEW) or len(t) == MAX_NEW for t in tokens)
        assert all(eos not in t[:-1] for t in tokens)


BOUNDARY_CASES = [  # (prompt lengths, max_new_tokens, k)
    ((21,), MAX_LENGTH - 21 - 3 - 1, 3),  # prompt + new tokens + k + 1 fills the cache exactly
    ((1,), MAX_NEW, 3),  # a one-token prompt
    ((6, 13), 1, 3),  # only the prefill's token: no step runs
    ((6, 13), 3, 5),  # k > max_new_tokens
]


@pytest.mark.parametrize("kind", sorted(K))
@pytest.mark.parametrize("lengths, max_new_tokens, k", BOUNDARY_CASES)
def test_boundaries_equal_plain_greedy(models, lengths, max_new_tokens, k, kind):
    target, head = models[kind, "float32"]
    prompts = tuple(tuple(np.random.default_rng(length).integers(0, 101, length).tolist()) for length in lengths)
    expected = plain(target, prompts, max_new_tokens, None)
    results = speculative(target, head, k, prompts, max_new_tokens, None)
    assert [r.token_ids for r in results] == expected
    for result in results:
        check_stats(result, k)
        assert result.num_tokens == max_new_tokens
    if max_new_tokens == 1:
        assert all(r.stats["num_drafts"] == 0 and r.stats["acceptance_length"] == 1.0 for r in results)


@pytest.mark.parametrize("kind", sorted(TREES))
def test_trees_stop_by_the_same_rules(models, prompts, kind):
    """EOS and the budget cut tree steps as they cut chains, and a request that fills the cache
    exactly with the tree's headroom (`TreeOptions.cache_headroom`) decodes to its end."""
    target, head = models[kind, "float32"]
    tree = TREES[kind]
    key = tuple(map(tuple, prompts))
    eos = stopping_token(plain(target, key, MAX_NEW, None))
    results = speculative(target, head, tree.num_steps, prompts, MAX_NEW, eos, tree)
    assert [r.token_ids for r in results] == plain(target, key, MAX_NEW, eos)
    for result in results:
        check_stats(result, tree.num_steps, tree.num_draft_tokens)
    assert sum(r.stats["num_accepted_tokens"] for r in results) > 0
    full = (tuple(np.random.default_rng(21).integers(0, 101, 21).tolist()),)
    max_new_tokens = MAX_LENGTH - 21 - tree.cache_headroom
    results = speculative(target, head, tree.num_steps, full, max_new_tokens, None, tree)
    assert [r.token_ids for r in results] == plain(target, full, max_new_tokens, None)
    assert results[0].num_tokens == max_new_tokens
    with pytest.raises(config_lib.InputError, match="more than max_length=64"):
        speculative(target, head, tree.num_steps, full, max_new_tokens + 1, None, tree)
