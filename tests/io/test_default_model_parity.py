"""Slow: the embedded default model against HF transformers reading the same GGUF by its own path.

transformers dequantizes the GGUF itself (`from_pretrained(..., gguf_file=...)`), so this checks
our reader, name table, permutation undo and model together. Enable with EAGLE_JAX_SLOW=1.
"""

from __future__ import annotations

import numpy as np
import pytest

from eagle_jax.io import default_model
from eagle_jax.serve import engine
from eagle_jax.io import models

pytestmark = pytest.mark.slow  # skipped unless EAGLE_JAX_SLOW=1 (conftest.py)


def test_default_model_matches_hf_transformers_on_the_same_gguf():
    import jax.numpy as jnp
    import torch
    import transformers

    gguf = default_model.default_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                           dtype=torch.float32).eval()
    target, _ = models.load_target(None, "float32")
    ids = np.array([1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 30, 2, 198, 1, 4093, 198], np.int32)
    with torch.no_grad():
        expected = hf(torch.from_numpy(ids[None]).long()).logits[0].numpy()
    positions = jnp.arange(len(ids), dtype=jnp.int32)[None]
    hidden, _, _ = target(jnp.asarray(ids[None]), positions, target.init_cache(1, 32))
    logits = np.asarray(target.logits(hidden))[0]
    assert np.abs(logits - expected).max() / np.abs(expected).max() < 1e-4

    with torch.no_grad():
        hf_tokens = hf.generate(torch.from_numpy(ids[None]).long(), max_new_tokens=24, do_sample=False,
                                min_new_tokens=24)[0, len(ids):].tolist()
    [ours] = engine.Engine(target).generate([ids], max_new_tokens=24, ignore_eos=True)
    assert ours.token_ids == hf_tokens
