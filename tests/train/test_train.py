"""EAGLE training (`train.trainer`): loss falls and acceptance rises on a tiny target; export round-trips;
training continues from an exported head; a diverging run or out-of-vocabulary data stops with an
error naming where. Resuming is `test_resume.py`'s, the draft vocabulary and grown heads their own."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle_jax.io import models
from eagle_jax.model import eagle
from eagle_jax.train import divergence
from eagle_jax.train import draft_vocabulary
from eagle_jax.train import objective as train_objective
from eagle_jax.train import trainer as train


@pytest.mark.parametrize("method,unroll", [("eagle", 2), ("eagle3", 3)])  # unroll 1 trains in the resume tests
def test_training_reduces_loss_and_raises_acceptance(target_and_data, tmp_path, method, unroll):
    target, dataset, eval_prompts = target_and_data
    cfg = train.TrainConfig(method=method, steps=100, batch_size=8, learning_rate=3e-3, warmup_steps=10,
                            draft_vocab_size=40, objective=train_objective.Objective(num_steps=unroll))
    head = train.new_head(target.config, cfg, draft_vocabulary.token_counts(dataset, 61))
    before = train.acceptance_length(target, head, eval_prompts, k=3, max_new_tokens=24)["acceptance_length"]
    trainer, log = train.train(target, dataset, cfg, tmp_path, progress=False, head=head)
    after = train.acceptance_length(target, trainer.head(), eval_prompts, k=3, max_new_tokens=24)["acceptance_length"]
    assert log[-1]["loss"] < 0.9 * log[0]["loss"]
    assert after > before + 0.2, (before, after)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_export_then_load_gives_identical_logits(target_and_data, tmp_path, method):
    target, dataset, prompts = target_and_data
    cfg = train.TrainConfig(method=method, draft_vocab_size=40)
    head = train.new_head(target.config, cfg, draft_vocabulary.token_counts(dataset, 61))
    exported = models.load_head(models.export_head(head, target.config, tmp_path / "head", dtype="float32"), target)
    tokens = np.asarray(prompts[0][None, :], np.int32)
    features = np.random.default_rng(1).normal(size=(1, tokens.shape[1], 32)).astype(np.float32)
    positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
    outputs = []
    for module in (head, exported):
        cache = eagle.init_cache(module.config, 1, 16, np.float32)
        outputs.append(module(tokens, module.project(features) if method == "eagle" else features, positions, cache,
                              target)[1])
    np.testing.assert_array_equal(np.asarray(outputs[0]), np.asarray(outputs[1]))
    assert exported.config.method == method


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_training_continues_from_an_exported_head(target_and_data, tmp_path, method, jax_leaves):
    """`--init-head`: an exported head loads with float32 params and trains on from where it was."""
    import jax.numpy as jnp

    target, dataset, _ = target_and_data
    cfg = train.TrainConfig(method=method, steps=40, batch_size=8, learning_rate=3e-3, warmup_steps=5,
                            draft_vocab_size=40)
    trained, log = train.train(target, dataset, cfg, tmp_path / "first", progress=False)
    path = models.export_head(trained.head(), target.config, tmp_path / "head", dtype="float32")
    loaded = models.load_head(path, target, "float32", param_dtype="float32")
    assert all(leaf.dtype == jnp.float32 for leaf in jax_leaves(nnx.state(loaded, nnx.Param)))
    short = train.TrainConfig(method=method, steps=1, batch_size=8, learning_rate=3e-3, warmup_steps=1,
                              draft_vocab_size=40)
    _, continued = train.train(target, dataset, short, tmp_path / "second", progress=False, head=loaded)
    _, fresh = train.train(target, dataset, short, tmp_path / "fresh", progress=False)
    # The continued run's first step is measured on the trained weights: its loss is where the first run ended.
    assert continued[0]["loss"] < 0.9 * fresh[0]["loss"]
    assert continued[0]["loss"] == pytest.approx(log[-1]["loss"], rel=0.3)


def test_load_head_keeps_float32_params_under_bfloat16_compute(target_and_data, tmp_path, jax_leaves):
    import jax.numpy as jnp

    target, dataset, _ = target_and_data
    cfg = train.TrainConfig(method="eagle3", draft_vocab_size=40)
    head = train.new_head(target.config, cfg, draft_vocabulary.token_counts(dataset, 61))
    path = models.export_head(head, target.config, tmp_path / "head", dtype="float32")
    mixed = models.load_head(path, target, "bfloat16", param_dtype="float32")
    assert {leaf.dtype for leaf in jax_leaves(nnx.state(mixed, nnx.Param))} == {np.dtype(np.float32)}
    assert mixed.fc.dtype == jnp.bfloat16  # compute dtype
    assert {leaf.dtype for leaf in jax_leaves(nnx.state(models.load_head(path, target, "bfloat16"), nnx.Param))} \
        == {np.dtype(jnp.bfloat16)}


def test_a_wider_head_exports_and_loads_its_width(target_and_data, tmp_path):
    target, dataset, _ = target_and_data
    cfg = train.TrainConfig(method="eagle3", draft_vocab_size=40, head_intermediate_size=96)
    head = train.new_head(target.config, cfg, draft_vocabulary.token_counts(dataset, 61))
    assert head.midlayer.mlp.down_proj.kernel.shape == (96, 32)  # the target's MLP is 64 wide
    loaded = models.load_head(models.export_head(head, target.config, tmp_path / "head", dtype="float32"), target)
    assert loaded.config.layer.intermediate_size == 96
    np.testing.assert_array_equal(np.asarray(loaded.midlayer.mlp.down_proj.kernel),
                                  np.asarray(head.midlayer.mlp.down_proj.kernel))


def test_auto_attention_is_cudnn_only_on_a_gpu_in_half_precision(monkeypatch):
    assert train.attention_implementation("auto", "bfloat16") == "xla"  # these tests run on a CPU
    assert train.attention_implementation("cudnn", "float32") == "cudnn"  # an explicit choice stands
    monkeypatch.setattr(train.jax, "default_backend", lambda: "gpu")
    assert train.attention_implementation("auto", "bfloat16") == "cudnn"
    assert train.attention_implementation("auto", "float32") == "xla"  # cuDNN's kernel takes bf16/fp16 only


@pytest.mark.parametrize("learning_rate", [float("nan"), 1e30])
def test_a_diverging_run_stops_at_its_step_and_saves_nothing_after_it(target_and_data, tmp_path, learning_rate):
    """A NaN learning rate makes the first update NaN (its loss still finite); a huge one makes the
    loss overflow later. Either stops training at that step, with no checkpoint of it or after it."""
    target, dataset, _ = target_and_data
    cfg = train.TrainConfig(method="eagle", steps=10, batch_size=4, learning_rate=learning_rate, warmup_steps=1,
                            checkpoint_every=2)
    with pytest.raises(divergence.DivergedError, match=r"training diverged at step \d") as raised:
        train.train(target, dataset, cfg, tmp_path, progress=False)
    assert isinstance(raised.value, ValueError) and f"step {raised.value.step}:" in str(raised.value)
    # The NaN rate poisons step 1's update; warmup gives the huge one a rate of 0 at step 1, so its
    # step 2 makes the parameters huge (finite, saved) and step 3's loss overflows.
    assert raised.value.step == (1 if np.isnan(learning_rate) else 3)
    trainer = train.Trainer(target, train.new_head(target.config, cfg), cfg)
    manager = trainer.checkpoint_manager(tmp_path / "checkpoints")
    assert all(step < raised.value.step for step in manager.all_steps())


def test_a_head_with_non_finite_parameters_is_not_handed_out_for_export(target_and_data):
    target, dataset, _ = target_and_data
    cfg = train.TrainConfig(method="eagle", steps=0)
    head = train.new_head(target.config, cfg)
    head.fc.kernel[...] = head.fc.kernel[...].at[0, 0].set(jnp.inf)
    trainer = train.Trainer(target, head, cfg)
    with pytest.raises(divergence.DivergedError, match="non-finite parameters .*fc.*not exported"):
        trainer.checked_head()


def test_training_refuses_ids_past_the_vocabulary(target_and_data, tmp_path):
    target, dataset, _ = target_and_data
    bad = dict(dataset, input_ids=dataset["input_ids"].copy())
    bad["input_ids"][5, 7] = 61  # the vocabulary has 61 ids
    cfg = train.TrainConfig(method="eagle", steps=2, batch_size=4, warmup_steps=1)
    with pytest.raises(ValueError, match="row 5 holds token id 61 at position 7, outside the target's vocabulary "
                                         "of 61"):
        train.train(target, bad, cfg, tmp_path, progress=False)
    assert not (tmp_path / "checkpoints").exists()
