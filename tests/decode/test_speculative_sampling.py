"""Sampled speculative decoding end to end: every generated token is distributed as in plain
(non-speculative) sampling from the target, for EAGLE-1 and EAGLE-3 heads, at several
temperatures and with top-p.

The reference is exact, not another sampler: with a 10-token vocabulary, one target forward over
the prompt followed by every continuation of NEW - 1 tokens gives the target's distribution at
each position after every prefix, hence the exact joint law of the first NEW tokens. Many rows
of one batch generate from the same prompt (each row draws its own random numbers), and the
empirical law of each token, and of each pair of neighbouring tokens, is compared with it by
chi-square. One step verifies K = 3 drafts, so tokens 1 to 4 come from accepted drafts at every
depth, from corrections after rejections at every depth, and from bonus tokens; the test counts
that each of these happened often. The tree cases draft EAGLE-2 trees of depth K instead (the
target's choice at each node follows the child that matches it, `tree.accept`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine
from eagle_jax.decode import sampling
from eagle_jax.decode import tree

V, K, NEW, ROWS = 10, 3, 5, 8192
PROMPT = np.array([1, 4, 2, 7, 3], np.int32)
ALPHA = 1e-4  # significance of every chi-square here; seeds are fixed, so the outcome is too
MIN_EVENTS = 30  # accepted and rejected drafts at each depth, per case (the fewest seen: 41, a tree's depth 3)


@pytest.fixture(scope="module")
def target(random_target):
    return random_target(vocab_size=V, hidden_size=32, num_layers=2, eos_token_id=None)


@pytest.fixture(scope="module")
def continuation_logits(target):
    """Target logits [V]*(NEW-1) + [NEW, V]: entry [x_1..x_{NEW-1}, i] follows PROMPT, x_1..x_i."""
    grid = np.stack(np.meshgrid(*[np.arange(V)] * (NEW - 1), indexing="ij"), -1).reshape(-1, NEW - 1)
    tokens = np.concatenate([np.broadcast_to(PROMPT, (len(grid), len(PROMPT))), grid], 1).astype(np.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)

    @jax.jit
    def forward(tokens, positions):
        hidden, _, _ = target(tokens, positions, target.init_cache(*tokens.shape))
        return target.logits(hidden[:, len(PROMPT) - 1:])  # causal: position i sees PROMPT and x_1..x_i only

    return np.asarray(forward(jnp.asarray(tokens), positions)).reshape((V,) * (NEW - 1) + (NEW, V))


def exact_joints(logits: np.ndarray, settings: sampling.Sampling) -> list[np.ndarray]:
    """Plain sampling's joint law of the first i+1 generated tokens, [V]*(i+1), for i < NEW."""
    joints, joint = [], np.ones(())
    for i in range(NEW):
        # The distribution of token i after each prefix of i tokens (later tokens fixed at 0: unseen).
        step = logits[(slice(None),) * i + (0,) * (NEW - 1 - i) + (i,)]
        joint = joint[..., None] * np.asarray(sampling.probabilities(jnp.asarray(step), settings), np.float64)
        joints.append(joint)
    return joints


def branch_counts(results) -> tuple[np.ndarray, np.ndarray]:
    """(accepted drafts [K], rejected drafts [K]) at each draft depth, from the rows' stats.

    A row's per-depth counts say how many of its steps accepted (and emitted) the draft at depth
    j; those that reached depth j (accepted depth j - 1) but did not accept there rejected it (or,
    in a tree, every child there) and emitted a correction, unless the token budget cut that step short. Only a row's last step can
    be cut, and then the row holds one token fewer than 1 + num_drafts + num_accepted_tokens:
    such rows are left out of the rejection counts, which are then exact for the other rows.
    """
    accepted, rejected = np.zeros(K, np.int64), np.zeros(K, np.int64)
    for result in results:
        stats = result.stats
        depth = np.rint(np.asarray(stats["acceptance_rate_per_position"]) * stats["num_drafts"]).astype(np.int64)
        accepted += depth
        if result.num_tokens == 1 + stats["num_drafts"] + stats["num_accepted_tokens"]:
            rejected += np.concatenate([[stats["num_drafts"]], depth[:-1]]) - depth
    return accepted, rejected


CASES = {  # (method, sampling, tree or None for the chain of K drafts)
    "eagle-T0.5": ("eagle", sampling.Sampling(temperature=0.5), None),
    "eagle-T1.5": ("eagle", sampling.Sampling(temperature=1.5), None),
    "eagle3-T1.0": ("eagle3", sampling.Sampling(temperature=1.0), None),
    "eagle3-T1.0-top_p0.8": ("eagle3", sampling.Sampling(temperature=1.0, top_p=0.8), None),
    "eagle-tree-T1.0": ("eagle", sampling.Sampling(temperature=1.0), tree.TreeOptions(2, K, 10)),
    "eagle3-tree-T1.0-top_p0.9": ("eagle3", sampling.Sampling(temperature=1.0, top_p=0.9), tree.TreeOptions(3, K, 21)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tokens_follow_plain_sampling(target, continuation_logits, random_head, chi_square, case):
    method, settings, draft_tree = CASES[case]
    head = random_head(target.config, method, seed=3, draft_vocab_size=8)
    speculation = dict(tree=draft_tree) if draft_tree else dict(num_speculative_tokens=K)
    generator = engine.Engine(target, head, config=config_lib.EngineConfig(batch_size=ROWS, max_length=32, **speculation))
    results = generator.generate([PROMPT] * ROWS, max_new_tokens=NEW, seed=11, sampling=settings)
    tokens = np.array([r.token_ids for r in results])  # [ROWS, NEW]: token 0 from prefill, the rest from steps
    accepted, rejected = branch_counts(results)
    joints = exact_joints(continuation_logits, settings)
    p_values = []  # token i, then (token i-1, token i), for each position i
    for i in range(NEW):
        marginal = joints[i].reshape(-1, V).sum(0)
        p_values.append(chi_square(np.bincount(tokens[:, i], minlength=V), marginal))
        if i:
            pairs = joints[i].reshape(-1, V * V).sum(0)  # (token i-1, token i)
            p_values.append(chi_square(np.bincount(tokens[:, i - 1] * V + tokens[:, i], minlength=V * V), pairs))
    # Both branches of rejection sampling ran at every depth; accepted[K-1] steps went on to a bonus token.
    assert (accepted >= MIN_EVENTS).all() and (rejected >= MIN_EVENTS).all(), (accepted, rejected)
    assert min(p_values) > ALPHA, np.round(p_values, 5)
