"""EAGLE training: loss falls and acceptance rises on a tiny target; checkpoints resume, once verified;
export round-trips; a diverging run or out-of-vocabulary data stops with an error naming where."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle_jax.train import distill
from eagle_jax.serve import config as engine_config
from eagle_jax.serve import engine
from eagle_jax.model import llama
from eagle_jax.io import hf_files
from eagle_jax.io import models
from eagle_jax.train import trainer as train
from eagle_jax.train import objective as train_objective


@pytest.fixture(scope="module")
def target_and_data(tiny_config):
    cfg = tiny_config(vocab_size=61, hidden_size=32, num_layers=4, intermediate_size=64, eos_token_id=None)
    target = llama.Llama(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 61, size=rng.integers(3, 10)).astype(np.int32) for _ in range(48)]
    generator = engine.Engine(target, config=engine_config.EngineConfig(batch_size=16, max_length=64))
    dataset = distill.distill(generator, prompts, max_new_tokens=24, sequence_length=36, pad_id=0, progress=False)
    return target, dataset, prompts[:6]


@pytest.mark.parametrize("method,unroll", [("eagle", 2), ("eagle3", 3)])  # unroll 1 trains in the resume tests
def test_training_reduces_loss_and_raises_acceptance(target_and_data, tmp_path, method, unroll):
    target, dataset, eval_prompts = target_and_data
    cfg = train.TrainConfig(method=method, steps=100, batch_size=8, learning_rate=3e-3, warmup_steps=10,
                            draft_vocab_size=40, objective=train_objective.Objective(num_steps=unroll))
    head = train.new_head(target.config, cfg, train.token_counts(dataset, 61))
    before = train.acceptance_length(target, head, eval_prompts, k=3, max_new_tokens=24)["acceptance_length"]
    trainer, log = train.train(target, dataset, cfg, tmp_path, progress=False, head=head)
    after = train.acceptance_length(target, trainer.head(), eval_prompts, k=3, max_new_tokens=24)["acceptance_length"]
    assert log[-1]["loss"] < 0.9 * log[0]["loss"]
    assert after > before + 0.2, (before, after)


def test_checkpoint_resume_round_trip(target_and_data, tmp_path):
    target, dataset, _ = target_and_data
    cfg = train.TrainConfig(method="eagle", steps=6, batch_size=4, warmup_steps=1, checkpoint_every=3)
    first, _ = train.train(target, dataset, cfg, tmp_path, progress=False)
    resumed = train.Trainer(target, train.new_head(target.config, cfg), cfg)  # fresh random params
    assert resumed.restore(resumed.checkpoint_manager(tmp_path / "checkpoints"))
    assert resumed.step == 6
    for saved, loaded in zip(jax_leaves(first.params), jax_leaves(resumed.params)):
        np.testing.assert_array_equal(saved, loaded)
    # Training further continues from step 6, not from scratch.
    longer = train.TrainConfig(method="eagle", steps=8, batch_size=4, warmup_steps=1, checkpoint_every=3)
    continued, log = train.train(target, dataset, longer, tmp_path, progress=False)
    assert continued.step == 8 and [row["step"] for row in log] == [8]  # no step-1 row: it resumed


@pytest.mark.parametrize("method, unroll", [("eagle", 1), ("eagle3", 2)])
def test_resumed_training_continues_identically(target_and_data, tmp_path, method, unroll):
    """6 steps straight == 3 steps, checkpoint, a fresh Trainer restoring it, 3 more: params and optimizer state."""
    target, dataset, _ = target_and_data
    cfg = train.TrainConfig(method=method, steps=6, batch_size=4, warmup_steps=2, checkpoint_every=3,
                            draft_vocab_size=40, objective=train_objective.Objective(num_steps=unroll))
    straight, straight_log = train.train(target, dataset, cfg, tmp_path, progress=False)
    manager = straight.checkpoint_manager(tmp_path / "checkpoints")
    assert manager.all_steps() == [3, 6]
    manager.delete(6)  # as if the run had stopped after step 3
    manager.close()
    resumed, resumed_log = train.train(target, dataset, cfg, tmp_path, progress=False)  # a new Trainer, new head
    # It restored step 3 (a fresh start would log step 1 too) and trained steps 4..6.
    assert resumed.step == 6 and [row["step"] for row in resumed_log] == [6]
    assert resumed_log[0]["loss"] == pytest.approx(straight_log[-1]["loss"], rel=1e-6)
    for name in ("params", "opt_state"):
        expected, actual = jax_leaves(getattr(straight, name)), jax_leaves(getattr(resumed, name))
        assert len(expected) == len(actual) > 0
        for want, got in zip(expected, actual):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7, err_msg=name)


def jax_leaves(tree):
    import jax

    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_export_then_load_gives_identical_logits(target_and_data, tmp_path, method):
    target, dataset, prompts = target_and_data
    cfg = train.TrainConfig(method=method, draft_vocab_size=40)
    head = train.new_head(target.config, cfg, train.token_counts(dataset, 61))
    exported = models.load_head(models.export_head(head, target.config, tmp_path / "head", dtype="float32"), target)
    tokens = np.asarray(prompts[0][None, :], np.int32)
    features = np.random.default_rng(1).normal(size=(1, tokens.shape[1], 32)).astype(np.float32)
    positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
    outputs = []
    for module in (head, exported):
        cache = engine.speculative.eagle.init_cache(module.config, 1, 16, np.float32)
        outputs.append(module(tokens, module.project(features) if method == "eagle" else features, positions, cache,
                              target)[1])
    np.testing.assert_array_equal(np.asarray(outputs[0]), np.asarray(outputs[1]))
    assert exported.config.method == method


def test_draft_vocabulary_picks_most_frequent_tokens():
    counts = np.array([5, 0, 9, 1, 7, 0])
    d2t = train.draft_vocabulary(counts, 3)
    assert sorted((np.arange(3) + d2t).tolist()) == [0, 2, 4]
    with pytest.raises(ValueError):
        train.draft_vocabulary(counts, 7)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_training_continues_from_an_exported_head(target_and_data, tmp_path, method):
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


def test_load_head_keeps_float32_params_under_bfloat16_compute(target_and_data, tmp_path):
    import jax.numpy as jnp

    target, dataset, _ = target_and_data
    cfg = train.TrainConfig(method="eagle3", draft_vocab_size=40)
    head = train.new_head(target.config, cfg, train.token_counts(dataset, 61))
    path = models.export_head(head, target.config, tmp_path / "head", dtype="float32")
    mixed = models.load_head(path, target, "bfloat16", param_dtype="float32")
    assert {leaf.dtype for leaf in jax_leaves(nnx.state(mixed, nnx.Param))} == {np.dtype(np.float32)}
    assert mixed.fc.dtype == jnp.bfloat16  # compute dtype
    assert {leaf.dtype for leaf in jax_leaves(nnx.state(models.load_head(path, target, "bfloat16"), nnx.Param))} \
        == {np.dtype(jnp.bfloat16)}


def test_a_wider_head_exports_and_loads_its_width(target_and_data, tmp_path):
    target, dataset, _ = target_and_data
    cfg = train.TrainConfig(method="eagle3", draft_vocab_size=40, head_intermediate_size=96)
    head = train.new_head(target.config, cfg, train.token_counts(dataset, 61))
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


def test_an_extended_draft_vocabulary_keeps_trained_columns_and_places_the_added_ones(target_and_data):
    """`--init-head` with a larger `--draft-vocab-size`: the trained tokens keep their columns, the
    most frequent others join, each at the column a least-squares fit over the trained ones puts
    it: where the trained columns are exactly a linear function of (output embedding, log count,
    1), the added columns are that function too."""
    import jax
    import jax.numpy as jnp

    target, dataset, _ = target_and_data
    counts = train.token_counts(dataset, 61)
    head = train.new_head(target.config, train.TrainConfig(method="eagle3", draft_vocab_size=40), counts)
    embedding = np.asarray(target.output_embedding(), np.float64)  # [61, D]
    assert embedding.shape[1] + 2 <= 40  # more trained columns than the fit has unknowns per column
    rng = np.random.default_rng(0)
    mapping = rng.standard_normal((embedding.shape[1] + 2, embedding.shape[1]))
    column = lambda ids: (np.concatenate([embedding[ids], np.log1p(counts[ids])[:, None],
                                          np.ones((len(ids), 1))], axis=1) @ mapping).T
    old_ids = np.asarray(head.to_target_ids(jnp.arange(40)))
    head.lm_head.kernel[...] = jnp.asarray(column(old_ids), jnp.float32)
    extended = train.extend_draft_vocabulary(head, counts, 50, embedding)
    new_ids = np.asarray(extended.to_target_ids(jnp.arange(50)))
    assert set(old_ids) < set(new_ids) and list(new_ids) == sorted(new_ids)
    added = sorted(set(new_ids) - set(old_ids))
    assert counts[added].min() >= np.sort(counts[~np.isin(np.arange(61), new_ids)]).max(initial=0)
    np.testing.assert_allclose(extended.lm_head.kernel[...], column(new_ids), rtol=1e-4, atol=1e-4)
    hidden = jax.random.normal(jax.random.key(0), (64, target.config.hidden_size))
    old_logits, new_logits = head.logits(hidden, target), extended.logits(hidden, target)
    # The trained columns unchanged (a matmul of another width may sum in another order: equal to rounding).
    np.testing.assert_allclose(new_logits[:, np.searchsorted(new_ids, old_ids)], old_logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="extends"):
        train.extend_draft_vocabulary(head, counts, 10, embedding)


def test_a_deepened_head_computes_what_it_did_and_exports_its_layers(target_and_data, tmp_path):
    """`--init-head` with more `--head-layers`: the added layer starts as the identity (the head's
    logits stay), exports as `layers.1.*` with num_hidden_layers 2, and loads back the same; widening
    a deep head widens every layer's MLP."""
    import json

    import jax

    from eagle_jax.io import hf_files

    target, dataset, _ = target_and_data
    cfg = train.TrainConfig(method="eagle3", draft_vocab_size=40)
    head = train.new_head(target.config, cfg, train.token_counts(dataset, 61))
    tokens = jnp.asarray(np.asarray(dataset["input_ids"][:2, :24]), jnp.int32)
    _, captured, _ = train_objective.target_outputs(target, tokens, head.config.feature_layers)
    logits = lambda h: np.stack([np.asarray(step[1]) for step in train_objective.unrolled_head(
        h, target, tokens, h.project(captured[:, :23]), 3)])
    before = logits(head)
    deep = train.add_layers(head, 2)
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
    wide = train.widen_mlp(loaded, 96)
    assert all(layer.mlp.down_proj.kernel.shape == (96, 32) for layer in (wide.midlayer, *wide.layers))
    np.testing.assert_allclose(logits(wide), trained, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="deepens"):
        train.add_layers(wide, 1)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_a_widened_head_computes_what_it_did(target_and_data, tmp_path, method):
    """`--init-head` with a larger `--head-intermediate-size`: added MLP units start silent, and the
    exported head keeps the new width."""
    import jax

    target, dataset, _ = target_and_data
    cfg = train.TrainConfig(method=method, draft_vocab_size=40)
    head = train.new_head(target.config, cfg, train.token_counts(dataset, 61))
    mlp = head.midlayer.mlp if method == "eagle3" else head.mlp
    x = jax.random.normal(jax.random.key(1), (5, target.config.hidden_size))
    before = mlp(x)
    wide = train.widen_mlp(head, 96)
    wide_mlp = wide.midlayer.mlp if method == "eagle3" else wide.mlp
    assert wide.config.layer.intermediate_size == 96 and wide_mlp.down_proj.kernel.shape == (96, 32)
    np.testing.assert_allclose(wide_mlp(x), before, rtol=1e-5, atol=1e-6)
    path = models.export_head(wide, target.config, tmp_path / "head", dtype="float32")
    assert models.load_head(path, target, "float32").config.layer.intermediate_size == 96
    with pytest.raises(ValueError, match="widens"):
        train.widen_mlp(wide, 64)


@pytest.mark.parametrize("learning_rate", [float("nan"), 1e30])
def test_a_diverging_run_stops_at_its_step_and_saves_nothing_after_it(target_and_data, tmp_path, learning_rate):
    """A NaN learning rate makes the first update NaN (its loss still finite); a huge one makes the
    loss overflow later. Either stops training at that step, with no checkpoint of it or after it."""
    target, dataset, _ = target_and_data
    cfg = train.TrainConfig(method="eagle", steps=10, batch_size=4, learning_rate=learning_rate, warmup_steps=1,
                            checkpoint_every=2)
    with pytest.raises(train.DivergedError, match=r"training diverged at step \d") as raised:
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
    with pytest.raises(train.DivergedError, match="non-finite parameters .*fc.*not exported"):
        trainer.checked_head()


def rewrite_checkpoint(trainer, directory, change):
    """Replaces the latest checkpoint in `directory` by `change(state)`, as damaged files would read."""
    import orbax.checkpoint as ocp

    manager = trainer.checkpoint_manager(directory)
    step = manager.latest_step()
    state = manager.restore(step, args=ocp.args.StandardRestore(
        jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": trainer.params, "opt_state": trainer.opt_state})))
    manager.delete(step)
    manager.save(step, args=ocp.args.StandardSave(change(state)))
    manager.wait_until_finished()
    manager.close()
    return step


def test_resuming_refuses_a_checkpoint_with_non_finite_values(target_and_data, tmp_path):
    target, dataset, _ = target_and_data
    cfg = train.TrainConfig(method="eagle", steps=4, batch_size=4, warmup_steps=1, checkpoint_every=2)
    first, _ = train.train(target, dataset, cfg, tmp_path, progress=False)

    def poison(state):
        kernel = state["params"]["fc"]["kernel"]
        state["params"]["fc"]["kernel"] = kernel.at[3, 1].set(jnp.nan)
        return state

    assert rewrite_checkpoint(first, tmp_path / "checkpoints", poison) == 4
    longer = train.TrainConfig(method="eagle", steps=6, batch_size=4, warmup_steps=1, checkpoint_every=2)
    with pytest.raises(hf_files.CheckpointError, match=r"step 4 .* non-finite values in 1 arrays "
                                                        r"\(\['params'\]\['fc'\]\['kernel'\]\).*resume from step 2"):
        train.train(target, dataset, longer, tmp_path, progress=False)


def test_resuming_refuses_a_checkpoint_of_another_head(target_and_data, tmp_path):
    """An output directory reused for a head of another width: named as such, not an orbax shape error."""
    target, dataset, _ = target_and_data
    cfg = train.TrainConfig(method="eagle", steps=2, batch_size=4, warmup_steps=1, checkpoint_every=2)
    train.train(target, dataset, cfg, tmp_path, progress=False)
    wider = dataclasses.replace(cfg, steps=4, head_intermediate_size=96)
    with pytest.raises(hf_files.CheckpointError, match=r"step 2 .*written for another head: .*\(64, 32\) "
                                                        r"there, \(96, 32\) here"):
        train.train(target, dataset, wider, tmp_path, progress=False)
    with pytest.raises(hf_files.CheckpointError, match="written for another head: it lacks"):
        train.train(target, dataset, dataclasses.replace(cfg, method="eagle3", draft_vocab_size=40, steps=4), tmp_path,
                    progress=False)


def test_training_refuses_ids_past_the_vocabulary(target_and_data, tmp_path):
    target, dataset, _ = target_and_data
    bad = dict(dataset, input_ids=dataset["input_ids"].copy())
    bad["input_ids"][5, 7] = 61  # the vocabulary has 61 ids
    cfg = train.TrainConfig(method="eagle", steps=2, batch_size=4, warmup_steps=1)
    with pytest.raises(ValueError, match="row 5 holds token id 61 at position 7, outside the target's vocabulary "
                                         "of 61"):
        train.train(target, bad, cfg, tmp_path, progress=False)
    assert not (tmp_path / "checkpoints").exists()
