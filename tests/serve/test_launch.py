"""What `python -m eagle_jax.serve` builds from its flags (`launch.build`): how many tokens it drafts."""

import json

import pytest

pytest.importorskip("fastapi")

from eagle_jax import heads  # noqa: E402
from eagle_jax.serve import __main__ as serve_cli  # noqa: E402
from eagle_jax.serve import launch  # noqa: E402
from tests.cli.test_generate_cli import aligned_model_dir, head_dir, model_dir  # noqa: F401,E402 (fixtures)


@pytest.fixture
def measured_per_batch_size(tmp_path, monkeypatch):
    """A defaults.json whose EAGLE-1 k on this platform was measured per batch size."""
    table = tmp_path / "defaults.json"
    table.write_text(json.dumps({"eagle": {"num_speculative_tokens": {"gpu": {"1": 3, "4": 1, "16": 2},
                                                                      "cpu": {"1": 3, "4": 1, "16": 2}}}}))
    monkeypatch.setattr(heads, "DEFAULTS_FILE", table)


def built_config(model, draft, *flags):
    backend, _ = launch.build(serve_cli.parse_args(["--model", str(model), "--draft", str(draft), "--dtype", "float32",
                                                    "--max-length", "128", *flags]))
    return backend.engine.config


def test_with_no_k_each_row_bucket_drafts_the_measured_best_k(measured_per_batch_size, aligned_model_dir,  # noqa: F811
                                                              head_dir, capsys):  # noqa: F811
    """8 slots: buckets of 1, 4 and 8 rows draft 3, 1 and 1 on a state sized for 3 (16's k is past the slots)."""
    config = built_config(aligned_model_dir, head_dir, "--max-num-seqs", "8")
    assert (config.num_speculative_tokens, config.speculative_tokens_by_rows) == (3, ((1, 3), (4, 1)))
    assert [config.k_for_rows(rows) for rows in (1, 4, 8)] == [3, 1, 1]
    assert "drafts a step by running requests: 1: 3, 2-4: 1, 5-8: 1" in capsys.readouterr().err


def test_a_given_k_drafts_in_every_call(measured_per_batch_size, aligned_model_dir, head_dir):  # noqa: F811
    config = built_config(aligned_model_dir, head_dir, "--max-num-seqs", "8", "--num-speculative-tokens", "2")
    assert (config.num_speculative_tokens, config.speculative_tokens_by_rows) == (2, ())
