"""`eagle-jax-train` (`eagle_jax.cli.train`): an --init-head keeps its draft vocabulary; a problem the
user can fix (too little data, a diverged run, ids past the vocabulary) is one `error:` line, status
2, and leaves no head behind; `python -m eagle_jax.train` is the same command."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from eagle_jax.cli import train as train_cli
from eagle_jax.io import models
from eagle_jax.train import data
from tests.cli.test_generate_cli import model_dir  # noqa: F401 (a fixture: a tiny converted model with a chat template)


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    """Six rows of 24 random ids of the tiny model's 101, every one trained on."""
    tokens = np.random.default_rng(0).integers(0, 101, (6, 24))
    return data.save_dataset(dict(input_ids=tokens, loss_mask=np.ones_like(tokens, bool), lengths=np.full(6, 24)),
                             tmp_path_factory.mktemp("train-cli") / "data.npz")


def arguments(model_dir, data_path, output, *extra):  # noqa: F811
    return ["--method", "eagle", "--model", str(model_dir), "--data", str(data_path), "--output", str(output),
            "--batch-size", "4", "--eval-prompts", "0", "--dtype", "float32", *extra]


def last_error(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_an_init_heads_draft_vocabulary_is_kept_or_extended(model_dir, data_path, random_head, save_head,  # noqa: F811
                                                            tmp_path):
    """`--init-head` without `--draft-vocab-size` trains the head at its own vocabulary (a fixed
    default of 8,192 would refuse a larger head); a larger size extends it, a smaller one is refused."""
    target, _ = models.load_target(model_dir, "float32")
    head = random_head(target.config, "eagle3", seed=3, draft_vocab_size=40, feature_layers=(0, 1, 1))
    init = save_head(head, tmp_path / "init")
    argv = ["--method", "eagle3", "--model", str(model_dir), "--init-head", str(init), "--data", str(data_path),
            "--steps", "0", "--batch-size", "4", "--eval-prompts", "0", "--dtype", "float32"]
    assert train_cli.main([*argv, "--output", str(tmp_path / "kept")]) == 0
    assert models.load_head(tmp_path / "kept" / "head", target).config.draft_vocab_size == 40
    assert train_cli.main([*argv, "--output", str(tmp_path / "extended"), "--draft-vocab-size", "50"]) == 0
    assert models.load_head(tmp_path / "extended" / "head", target).config.draft_vocab_size == 50
    with pytest.raises(SystemExit) as refused:  # a vocabulary extends, never shrinks
        train_cli.main([*argv, "--output", str(tmp_path / "smaller"), "--draft-vocab-size", "30"])
    assert refused.value.code == 2


def test_a_dataset_smaller_than_a_batch_is_an_error_line(model_dir, data_path, tmp_path, capsys):  # noqa: F811
    output = tmp_path / "big"
    assert train_cli.main(arguments(model_dir, data_path, output, "--batch-size", "8")) == 2  # it used to loop forever
    assert last_error(capsys).startswith("error: the dataset has 6 rows, fewer than one batch of 8")
    assert not (output / "head").exists()


def test_a_diverged_run_is_an_error_line_naming_its_step(model_dir, data_path, tmp_path, capsys):  # noqa: F811
    output = tmp_path / "diverged"
    argv = arguments(model_dir, data_path, output, "--steps", "6", "--warmup-steps", "1", "--learning-rate", "1e30")
    assert train_cli.main(argv) == 2
    assert last_error(capsys).startswith("error: training diverged at step 3: the loss is nan")
    assert not (output / "head").exists() and not (output / "metrics.json").exists()
    with pytest.raises(SystemExit) as refused:  # a rate that cannot train is refused before loading anything
        train_cli.main(arguments(model_dir, data_path, tmp_path / "nan", "--learning-rate", "nan"))
    assert refused.value.code == 2 and "--learning-rate nan: a learning rate is a positive finite number" in \
        capsys.readouterr().err


def test_ids_past_the_vocabulary_are_an_error_line_naming_the_row(model_dir, tmp_path, capsys):  # noqa: F811
    tokens = np.random.default_rng(1).integers(0, 101, (6, 24))
    tokens[4, 9] = 4000  # another tokenizer's id: the tiny model has 101
    path = data.save_dataset(dict(input_ids=tokens, loss_mask=np.ones_like(tokens, bool), lengths=np.full(6, 24)),
                             tmp_path / "parts" / "part0.npz")
    output = tmp_path / "out"
    assert train_cli.main(arguments(model_dir, path.parent, output)) == 2
    assert last_error(capsys) == (
        f"error: {path}: row 4 holds token id 4000 at position 9, outside the target's vocabulary of 101 ids "
        "(1 of 6 rows hold such ids): was it tokenized for another model?")
    assert not output.exists()


def test_the_module_and_the_console_script_are_the_same_command():
    result = subprocess.run([sys.executable, "-m", "eagle_jax.train", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("usage: eagle-jax-train")
    assert "--init-head" in result.stdout
