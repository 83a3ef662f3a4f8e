"""Training resumes (`train.resume`): from its latest checkpoint, identically, and only once that
checkpoint is verified (finite values, the sha256 written with it, this head's tree and shapes)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.io import hf_files
from eagle_jax.train import objective as train_objective
from eagle_jax.train import resume
from eagle_jax.train import trainer as train


def test_checkpoint_resume_round_trip(target_and_data, tmp_path, jax_leaves):
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
def test_resumed_training_continues_identically(target_and_data, tmp_path, method, unroll, jax_leaves):
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


def rewrite_checkpoint(trainer, directory, change):
    """Replaces the latest checkpoint in `directory` by `change(state)`, as damaged files would read:
    the arrays change, the digest written with them stays."""
    import orbax.checkpoint as ocp

    manager = trainer.checkpoint_manager(directory)
    step = manager.latest_step()
    state = manager.restore(step, args=ocp.args.StandardRestore(
        jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": trainer.params, "opt_state": trainer.opt_state})))
    digest = resume.digest_path(manager, step).read_text()
    manager.delete(step)
    manager.save(step, args=ocp.args.StandardSave(change(state)))
    manager.wait_until_finished()
    resume.digest_path(manager, step).write_text(digest)
    manager.close()
    return step


def flip_a_bit(state):
    """One bit of one float32 weight flipped: the value stays finite, so only the digest can tell."""
    kernel = np.array(state["params"]["fc"]["kernel"])
    bits = kernel.view(np.uint32)
    bits[3, 1] ^= 1 << 12
    assert np.all(np.isfinite(kernel))
    state["params"]["fc"]["kernel"] = jnp.asarray(kernel)
    return state


def test_resuming_refuses_a_checkpoint_whose_bytes_changed(target_and_data, tmp_path):
    target, dataset, _ = target_and_data
    cfg = train.TrainConfig(method="eagle", steps=4, batch_size=4, warmup_steps=1, checkpoint_every=2)
    first, _ = train.train(target, dataset, cfg, tmp_path, progress=False)
    assert rewrite_checkpoint(first, tmp_path / "checkpoints", flip_a_bit) == 4
    longer = train.TrainConfig(method="eagle", steps=6, batch_size=4, warmup_steps=1, checkpoint_every=2)
    with pytest.raises(hf_files.CheckpointError, match=r"step 4 .* does not match the sha256 written with it.*"
                                                        r"resume from step 2"):
        train.train(target, dataset, longer, tmp_path, progress=False)


def test_a_checkpoint_without_a_digest_resumes_with_a_warning(target_and_data, tmp_path, capsys):
    target, dataset, _ = target_and_data
    cfg = train.TrainConfig(method="eagle", steps=2, batch_size=4, warmup_steps=1, checkpoint_every=2)
    first, _ = train.train(target, dataset, cfg, tmp_path, progress=False)
    manager = first.checkpoint_manager(tmp_path / "checkpoints")
    resume.digest_path(manager, 2).unlink()
    longer = train.TrainConfig(method="eagle", steps=3, batch_size=4, warmup_steps=1, checkpoint_every=2)
    resumed, _ = train.train(target, dataset, longer, tmp_path, progress=False)
    assert resumed.step == 3
    assert "has no eagle_jax_digest.json" in capsys.readouterr().err


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
