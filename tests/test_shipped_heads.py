"""The heads shipped for the default model load and speculate usefully on a short CPU run.

Needs the default model (downloaded once from PyPI and converted into the cache, ~100 MB).
"""

from __future__ import annotations

import numpy as np
import pytest

from eagle_jax import heads
from eagle_jax import models
from eagle_jax import tokenization
from eagle_jax import train

PROMPTS = [
    "Compose an engaging travel blog post about a recent trip to Hawaii.",
    "Explain the difference between a list and a tuple in Python.",
    "Give me three tips for staying productive when working from home.",
]


@pytest.fixture(scope="module")
def default_target():
    target, tokenizer_dir = models.load_target(None, "float32")
    tokenizer = tokenization.load(tokenizer_dir)
    return target, [np.asarray(tokenization.encode(tokenizer, text, chat=True)) for text in PROMPTS]


@pytest.mark.parametrize("method", [
    # A known gap, tracked on the training issue: this EAGLE-1 head reaches 1.42-1.49 on these
    # short CPU runs (1.84 on MT-Bench at 256 tokens on the GPU). Strict, so a better head shows up.
    pytest.param("eagle", marks=pytest.mark.xfail(strict=True, reason="shipped EAGLE-1 head is undertrained")),
    "eagle3",
])
def test_shipped_head_accepts_more_than_half_a_token_per_step(default_target, method):
    target, prompts = default_target
    path = heads.shipped_head(method)
    assert path is not None, f"no shipped {method} head"
    head = models.load_head(path, target, "float32")
    result = train.acceptance_length(target, head, prompts, k=5, max_new_tokens=128)
    assert result["acceptance_length"] > 1.5, result


def test_cli_defaults_to_a_shipped_head():
    path, method = heads.choose_draft(None, None, None)
    assert path == heads.shipped_head(heads.DEFAULT_METHOD) and method == heads.DEFAULT_METHOD
    assert heads.choose_draft(None, "none", None) == (None, "none")
    assert heads.choose_draft("some/other/model", None, None) == (None, "none")


def test_plain_decoding_is_the_default_only_where_it_measured_faster():
    shipped = heads.shipped_head(heads.DEFAULT_METHOD)
    path, method, k, note = heads.draft_plan(None, None, None, None, "gpu")
    assert (path, method, k, note) == (shipped, heads.DEFAULT_METHOD, heads.best_k(heads.DEFAULT_METHOD, "gpu"), None)
    assert k == 5
    path, method, k, note = heads.draft_plan(None, None, None, None, "cpu")
    assert (path, method, k) == (None, "none", 0) and "--method eagle3" in note
    # Asking for speculation on a CPU speculates, with the CPU's measured best k unless k is given.
    assert heads.draft_plan(None, None, "eagle3", None, "cpu") == (shipped, "eagle3", 1, None)
    assert heads.draft_plan(None, None, None, 4, "cpu") == (shipped, "eagle3", 4, None)
    assert heads.draft_plan(None, None, "eagle", 0, "gpu") == (None, "none", 0, None)
    assert heads.draft_plan("some/other/model", None, None, None, "gpu") == (None, "none", 0, None)
    assert heads.best_k("eagle3", "tpu") == heads.best_k("eagle3", "gpu")  # unmeasured platforms take the GPU's
