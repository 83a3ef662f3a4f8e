"""Speculative decoding is lossless: greedy outputs equal plain greedy decoding, for every head kind.

The target is random but "aligned": embedding rows have RMS 1 and the residual branches
(o_proj, down_proj) are scaled down, so its next token is close to argmax(lm_head(embed(t))). An
EAGLE-1 head with fc = [I; 0] and zeroed attention and MLP outputs computes exactly
lm_head(embed(t)), so it agrees with the target most of the time; noise in fc makes it agree
partially, so steps accept varying numbers of drafts (the interesting case for losslessness).
"""

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax import engine as engine_lib

MAX_NEW = 12
# With 12 new tokens and k <= 5 every prompt needs a 32-slot cache and a 16-wide prefill, so
# each engine compiles its two programs once.
PROMPT_LENGTHS = (4, 9, 14)
DRAFT_VOCAB = 64


@pytest.fixture(scope="module")
def target(random_target, set_param):
    model = random_target(seed=1, num_layers=3, head_dim=16)
    embeddings = np.asarray(model.embed_tokens.embedding[...])
    set_param(model, "embed_tokens/embedding", embeddings / np.sqrt(np.mean(embeddings ** 2, -1, keepdims=True)))
    for index, layer in enumerate(model.layers):
        for name in ("self_attn/o_proj/kernel", "mlp/down_proj/kernel"):
            set_param(model, f"layers/{index}/{name}", 0.1 * np.asarray(_get(layer, name)))
    return model


def _get(module, path):
    for part in path.split("/"):
        module = getattr(module, part)
    return module[...]


@pytest.fixture(scope="module")
def prompts():
    return [np.random.default_rng(length).integers(0, 101, length).tolist() for length in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def reference(target, prompts):
    """Plain greedy decoding (k = 0)."""
    results = engine_lib.Engine(target, max_length=64).generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
    tokens = [r.token_ids for r in results]
    assert all(len(set(t)) > 5 for t in tokens)  # non-repetitive continuations: bookkeeping errors would show
    return tokens


@pytest.fixture(scope="module")
def make_head(target, reference, random_head, set_param):
    """Head kinds by name (see module docstring)."""
    cfg = target.config
    hidden = cfg.hidden_size

    def agreeing(noise: float, fc_bias: bool = False, seed: int = 0):
        head = random_head(cfg, "eagle", seed=seed, fc_bias=fc_bias)
        rng = np.random.default_rng(seed)
        fc = np.concatenate([np.eye(hidden), np.zeros((hidden, hidden))])
        set_param(head, "fc/kernel", fc + noise * rng.standard_normal(fc.shape) / np.sqrt(2 * hidden))
        set_param(head, "self_attn/o_proj/kernel", np.zeros((cfg.num_heads * cfg.head_dim, hidden)))
        set_param(head, "mlp/down_proj/kernel", np.zeros((cfg.intermediate_size, hidden)))
        return head

    def eagle3(constant: bool, seed: int = 0):
        head = random_head(cfg, "eagle3", seed=seed, draft_vocab_size=DRAFT_VOCAB, feature_layers=(0, 1, 2))
        if constant:
            # A zero final norm makes every draft logit 0, so the draft is always draft id 0. Map it to
            # the target's most frequent output token: drafts then get accepted now and then, and only
            # if d2t is applied in the right direction.
            set_param(head, "norm/weight", np.zeros(hidden))
            common = np.bincount(np.concatenate(reference), minlength=cfg.vocab_size).argmax()
            targets = np.arange(DRAFT_VOCAB) + np.asarray(head.d2t[...])
            targets = np.where(targets == common, targets[0], targets)
            targets[0] = common
            head.d2t[...] = jnp.asarray(targets - np.arange(DRAFT_VOCAB), jnp.int32)
        return head

    heads = {
        "eagle-agree": lambda: agreeing(0.0),
        "eagle-noisy": lambda: agreeing(0.3, seed=1),
        "eagle-bias": lambda: agreeing(0.3, fc_bias=True, seed=2),
        "eagle3-constant": lambda: eagle3(True, seed=3),
        "eagle3-random": lambda: eagle3(False, seed=4),
    }
    return functools.cache(lambda kind: heads[kind]())


@pytest.fixture(scope="module")
def run(target, prompts, make_head):
    """Memoised speculative generation of all prompts for (head kind, k, batch size)."""

    @functools.cache
    def generate(kind: str, k: int, batch_size: int):
        engine = engine_lib.Engine(target, make_head(kind), num_speculative_tokens=k, max_length=64,
                                   batch_size=batch_size)
        results = engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True, steps_per_call=4)
        assert engine.num_compilations == 2  # one bucket: prefill and speculative step
        return results

    return generate


CASES = [  # k = 1..5, both head kinds and batch sizes; 3 prompts each (batch size 2 leaves an idle row)
    ("eagle-agree", 3, 2),
    ("eagle-noisy", 1, 1),
    ("eagle-noisy", 4, 2),
    ("eagle-bias", 2, 1),
    ("eagle3-constant", 3, 2),
    ("eagle3-random", 5, 1),
]


@pytest.mark.parametrize("kind, k, batch_size", CASES)
def test_speculative_greedy_is_lossless(run, reference, kind, k, batch_size):
    results = run(kind, k, batch_size)
    assert [r.token_ids for r in results] == reference


def test_agreeing_head_has_high_acceptance(run):
    k = 3
    lengths = [r.stats["acceptance_length"] for r in run("eagle-agree", k, 2)]
    assert np.mean(lengths) > 1 + 0.5 * k, lengths  # measured: about 3.5 of the maximum 4
    assert min(lengths) > 1 + 0.3 * k, lengths


def test_partial_agreement_accepts_some_drafts(run):
    """The noisy and EAGLE-3 heads accept some drafts but not all: mixed acceptance per step."""
    for case in [("eagle-noisy", 4, 2), ("eagle-bias", 2, 1), ("eagle3-constant", 3, 2)]:
        lengths = [r.stats["acceptance_length"] for r in run(*case)]
        assert 1 < np.mean(lengths) < case[1] + 1, (case, lengths)


def test_eager_equals_compiled(target, prompts, make_head, run):
    kind, k, batch_size = "eagle-bias", 2, 1
    compiled = run(kind, k, batch_size)[0]
    engine = engine_lib.Engine(target, make_head(kind), num_speculative_tokens=k, max_length=64,
                               batch_size=batch_size, eager=True)
    [eager] = engine.generate(prompts[:1], max_new_tokens=MAX_NEW, ignore_eos=True, steps_per_call=4)
    assert engine.num_compilations == 0
    assert eager.token_ids == compiled.token_ids
    assert eager.stats == compiled.stats


@pytest.mark.parametrize("kind, k, batch_size", CASES)
def test_stats_are_consistent(run, kind, k, batch_size):
    for result in run(kind, k, batch_size):
        stats = result.stats
        drafts, accepted = stats["num_drafts"], stats["num_accepted_tokens"]
        assert 0 < drafts < MAX_NEW
        assert stats["num_draft_tokens"] == k * drafts
        assert stats["acceptance_length"] == pytest.approx(1 + accepted / drafts)
        rates = stats["acceptance_rate_per_position"]
        assert len(rates) == k and all(0 <= r <= 1 for r in rates)
        assert sum(rates) * drafts == pytest.approx(accepted)
        assert all(a >= b for a, b in zip(rates, rates[1:]))  # a draft is kept only after its predecessors
        # 1 token from prefill, then accepted + 1 per step; the last step may overshoot the budget.
        assert MAX_NEW <= 1 + drafts + accepted <= MAX_NEW + k
