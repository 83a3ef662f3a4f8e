"""Growing a trained head (`train.head_growth`): added layers and MLP units start silent, so the head
computes what it did, and export and load keep the new shape."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle_jax.io import models
from eagle_jax.train import draft_vocabulary
from eagle_jax.train import head_growth
from eagle_jax.train import objective as train_objective
from eagle_jax.train import trainer as train


def test_a_deepened_head_computes_what_it_did_and_exports_its_layers(target_and_data, tmp_path):
    """`--init-head` with more `--head-layers`: the added layer starts as the identity (the head's
    logits stay), exports as `layers.1.*` with num_hidden_layers 2, and loads back the same; widening
    a deep head widens every layer's MLP."""
    import json

    import jax

    from eagle_jax.io import hf_files

    target, dataset, _ = target_and_data
    cfg = train.TrainConfig(method="eagle3", draft_vocab_size=40)
    head = train.new_head(target.config, cfg, draft_vocabulary.token_counts(dataset, 61))
    tokens = jnp.asarray(np.asarray(dataset["input_ids"][:2, :24]), jnp.int32)
    _, captured, _ = train_objective.target_outputs(target, tokens, head.config.feature_layers)
    logits = lambda h: np.stack([np.asarray(step[1]) for step in train_objective.unrolled_head(
        h, target, tokens, h.project(captured[:, :23]), 3)])
    before = logits(head)
    deep = head_growth.add_layers(head, 2)
    assert deep.config.num_layers == 2 and len(deep.layers) == 1
    np.testing.assert_allclose(logits(deep), before, rtol=1e-5, atol=1e-5)
    # Trained a little, the added layer changes the logits; export and load keep them.
    state = nnx.state(deep.layers[0])
    nnx.update(deep.layers[0], jax.tree.map(lambda w: w + 0.05 * jax.random.normal(jax.random.key(2), w.shape), state))
    trained = logits(deep)
    assert not np.allclose(trained, before, atol=1e-3)
    path = models.export_head(deep, target.config, tmp_path / "head", dtype="float32")
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 2
    names = set(hf_files.load_tensors(path, progress=False))
    assert {"layers.1.self_attn.q_proj.weight", "layers.1.input_layernorm.weight", "midlayer.hidden_norm.weight"} <= names
    loaded = models.load_head(path, target, "float32")
    np.testing.assert_allclose(logits(loaded), trained, rtol=1e-5, atol=1e-5)
    wide = head_growth.widen_mlp(loaded, 96)
    assert all(layer.mlp.down_proj.kernel.shape == (96, 32) for layer in (wide.midlayer, *wide.layers))
    np.testing.assert_allclose(logits(wide), trained, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="deepens"):
        head_growth.add_layers(wide, 1)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_widened_head_computes_what_it_did(target_and_data, tmp_path, method):
    """`--init-head` with a larger `--head-intermediate-size`: added MLP units start silent, and the
    exported head keeps the new width."""
    import jax

    target, dataset, _ = target_and_data
    cfg = train.TrainConfig(method=method, draft_vocab_size=40)
    head = train.new_head(target.config, cfg, draft_vocabulary.token_counts(dataset, 61))
    mlp = head.midlayer.mlp if method == "eagle3" else head.mlp
    x = jax.random.normal(jax.random.key(1), (5, target.config.hidden_size))
    before = mlp(x)
    wide = head_growth.widen_mlp(head, 96)
    wide_mlp = wide.midlayer.mlp if method == "eagle3" else wide.mlp
    assert wide.config.layer.intermediate_size == 96 and wide_mlp.down_proj.kernel.shape == (96, 32)
    np.testing.assert_allclose(wide_mlp(x), before, rtol=1e-5, atol=1e-6)
    path = models.export_head(wide, target.config, tmp_path / "head", dtype="float32")
    assert models.load_head(path, target, "float32").config.layer.intermediate_size == 96
    with pytest.raises(ValueError, match="widens"):
        head_growth.widen_mlp(wide, 64)
