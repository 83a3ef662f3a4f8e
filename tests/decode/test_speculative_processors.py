"""Sampled speculative decoding under top-k, min-p and penalties, end to end: every generated
token is distributed as plain sampling from the target's processed distribution, for chains and
trees, EAGLE-1 and EAGLE-3 heads, with two settings mixed in one batch (each row its own).

As in test_speculative_sampling.py, the reference is exact: with a 10-token vocabulary the
target's logits after every continuation of NEW - 1 tokens give its distribution at every
position after every prefix; the NumPy references of test_processors.py process them (the
penalties count the prompt, for the repetition penalty, and every token generated before the
position). The joint law of the first NEW tokens follows, and each group of rows' empirical
law of each token, and of each pair of neighbouring tokens, is compared with it by chi-square.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from eagle_jax.decode import sampling
from eagle_jax.decode import tree
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine
from tests.decode import test_processors as references
from tests.decode.test_speculative_sampling import K, NEW, PROMPT, V, branch_counts  # noqa: F401
from tests.decode.test_speculative_sampling import continuation_logits, target  # noqa: F401 (fixtures)

ROWS = 8192  # split evenly between the case's settings, alternating rows
ALPHA = 1e-4  # significance of every chi-square here; seeds are fixed, so the outcome is too
MIN_EVENTS = 30  # accepted and rejected drafts at each depth, per case


def processed_probs(logits: np.ndarray, generated: tuple, settings: sampling.Sampling) -> np.ndarray:
    """The target's processed distribution [V] after PROMPT and the tokens `generated` before it."""
    padded = np.pad(logits, (0, references.V - V), constant_values=-1e9)  # the references' vocabulary is larger
    z = references.penalised_reference(padded, list(generated), PROMPT.tolist(), settings.repetition_penalty,
                                       settings.presence_penalty, settings.frequency_penalty)[:V]
    z = references.masked_reference(z, settings.temperature, settings.min_p, settings.top_k, settings.top_p)
    probs = np.exp(z - z.max())
    return probs / probs.sum()


def exact_joints(logits: np.ndarray, settings: sampling.Sampling) -> list[np.ndarray]:
    """Plain sampling's joint law of the first i+1 generated tokens, [V]*(i+1), for i < NEW."""
    joints, joint = [], np.ones(())
    for i in range(NEW):
        step = np.zeros((V,) * i + (V,))
        for generated in itertools.product(range(V), repeat=i):  # later grid coordinates fixed at 0: unseen
            step[generated] = processed_probs(logits[generated + (0,) * (NEW - 1 - i) + (i,)], generated, settings)
        joint = joint[..., None] * step
        joints.append(joint)
    return joints


CASES = {  # (method, the settings whose rows alternate in one batch, tree or None for the chain of K drafts)
    "eagle-top_k|penalties": ("eagle", (sampling.Sampling(temperature=1.0, top_k=3), sampling.Sampling(
        temperature=1.0, repetition_penalty=1.6, presence_penalty=0.6, frequency_penalty=0.5)), None),
    "eagle3-min_p|top_k_top_p": ("eagle3", (sampling.Sampling(temperature=0.8, min_p=0.1),
                                            sampling.Sampling(temperature=1.2, top_k=4, top_p=0.8)), None),
    "eagle-tree-penalties|min_p": ("eagle", (sampling.Sampling(temperature=1.0, repetition_penalty=2.0,
                                                               presence_penalty=1.5, frequency_penalty=1.0),
                                             sampling.Sampling(temperature=1.0, min_p=0.15)), tree.TreeOptions(2, K, 10)),
    "eagle3-tree-top_k|all": ("eagle3", (sampling.Sampling(temperature=1.0, top_k=2), sampling.Sampling(
        temperature=1.1, top_k=5, min_p=0.05, repetition_penalty=0.6, presence_penalty=-1.5)), tree.TreeOptions(3, K, 21)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tokens_follow_plain_processed_sampling(target, continuation_logits, random_head, chi_square,  # noqa: F811
                                                case):
    method, settings, draft_tree = CASES[case]
    head = random_head(target.config, method, seed=3, draft_vocab_size=8)
    speculation = dict(tree=draft_tree) if draft_tree else dict(num_speculative_tokens=K)
    generator = engine.Engine(target, head, config=config_lib.EngineConfig(batch_size=ROWS, max_length=32, **speculation))
    rows = [settings[row % len(settings)] for row in range(ROWS)]
    results = generator.generate([PROMPT] * ROWS, max_new_tokens=NEW, seed=13, sampling=rows)
    tokens = np.array([r.token_ids for r in results])  # [ROWS, NEW]: token 0 from prefill, the rest from steps
    accepted, rejected = branch_counts(results)
    assert (accepted >= MIN_EVENTS).all() and (rejected >= MIN_EVENTS).all(), (accepted, rejected)
    for group, setting in enumerate(settings):
        mine = tokens[group::len(settings)]
        joints = exact_joints(continuation_logits, setting)
        p_values = []  # token i, then (token i-1, token i), for each position i
        for i in range(NEW):
            p_values.append(chi_square(np.bincount(mine[:, i], minlength=V), joints[i].reshape(-1, V).sum(0)))
            if i:
                pairs = joints[i].reshape(-1, V * V).sum(0)
                p_values.append(chi_square(np.bincount(mine[:, i - 1] * V + mine[:, i], minlength=V * V), pairs))
        assert min(p_values) > ALPHA, (setting, np.round(p_values, 5))
