"""`EngineConfig`: every bad setting is refused once, by name, before anything compiles."""

import pytest

from eagle_jax.decode import tree as tree_lib
from eagle_jax.kernels import decode_attention
from eagle_jax.model import layers
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib

TILING = decode_attention.Tiling(block_s=16, num_warps=2, splits=3)


@pytest.mark.parametrize("settings, message", [
    (dict(batch_size=-1), "batch_size must be an integer >= 1, got -1"),
    (dict(batch_size=0), "batch_size must be an integer >= 1, got 0"),
    (dict(steps_per_call=0), "steps_per_call must be an integer >= 1, got 0"),
    (dict(steps_per_call=-3), "steps_per_call must be an integer >= 1, got -3"),
    (dict(steps_per_check=0), "steps_per_check must be an integer >= 1, got 0"),
    (dict(max_length=0), "max_length must be an integer >= 1, got 0"),
    (dict(max_length=2.5), "max_length must be an integer >= 1, got 2.5"),
    (dict(num_speculative_tokens=-1), "num_speculative_tokens must be an integer >= 0, got -1"),
    (dict(refill_at=0), "refill_at must be an integer >= 1, got 0"),
    (dict(speculative_disable_by_batch_size=0), "speculative_disable_by_batch_size must be an integer >= 1, got 0"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1, got 0"),
    (dict(num_speculative_tokens=2, tree=tree_lib.TreeOptions(2, 2, 3)), "exclude each other"),
    (dict(scheduler="dynamic"), "scheduler must be one of ('static', 'continuous'), got 'dynamic'"),
    (dict(decode_kernels="cuda"), "decode_kernels must be one of"),
    (dict(decode_kernels="pallas", tensor_parallel_size=2), "runs on one device"),
    (dict(decode_kernels="xla", attention_tiling=TILING), "attention_tiling sets the Pallas attention kernel"),
    (dict(decode_kernels="pallas_linear", attention_tiling=TILING), "attention_tiling"),
    (dict(tensor_parallel_size=2, draft_tensor_parallel_size=4), "draft_tensor_parallel_size must be 1"),
    (dict(num_speculative_tokens=4, scheduler="continuous", speculative_tokens_by_rows=((1, 6),)),
     "asks k = 6 at 1 rows, more than num_speculative_tokens = 4"),
    (dict(num_speculative_tokens=4, scheduler="continuous", speculative_tokens_by_rows=((0, 2),)),
     "speculative_tokens_by_rows' rows must be an integer >= 1, got 0"),
    (dict(num_speculative_tokens=4, scheduler="continuous", speculative_tokens_by_rows=(4, 2)),
     "holds (rows, k) pairs, got 4"),
    (dict(num_speculative_tokens=4, speculative_tokens_by_rows=((1, 2),)), "scheduler='static' runs every row"),
])
def test_bad_settings_are_refused_by_name(settings, message):
    with pytest.raises(config_lib.InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config_lib.EngineConfig(**settings)


def test_derived_values():
    assert config_lib.EngineConfig().k == 0 and config_lib.EngineConfig().cache_headroom == 1
    chain = config_lib.EngineConfig(num_speculative_tokens=3, batch_size=16)
    assert (chain.k, chain.cache_headroom, chain.resolved_refill_at, chain.speculative) == (3, 4, 4, True)
    tree = tree_lib.TreeOptions(2, 3, 5)
    assert config_lib.EngineConfig(tree=tree).k == 3
    assert config_lib.EngineConfig(tree=tree).cache_headroom == tree.cache_headroom
    assert config_lib.EngineConfig(batch_size=2, refill_at=5).resolved_refill_at == 2
    # A run call's drafts by its rows: the largest listed rows not above them (the smallest's below all).
    by_rows = config_lib.EngineConfig(num_speculative_tokens=6, scheduler="continuous",
                                      speculative_tokens_by_rows=((2, 6), (4, 3), (5, 4)))
    assert [by_rows.k_for_rows(rows) for rows in (1, 2, 3, 4, 16)] == [6, 6, 6, 3, 4]
    assert chain.k_for_rows(16) == 3  # none listed: num_speculative_tokens


def test_auto_kernels_resolve_per_backend():
    assert config_lib.EngineConfig().kernels("cpu") == layers.XLA
    assert config_lib.EngineConfig().kernels("gpu") == layers.Kernels("pallas")
    assert config_lib.EngineConfig(tensor_parallel_size=2).kernels("gpu") == layers.XLA
    assert config_lib.EngineConfig(attention_tiling=TILING).kernels("gpu") == layers.Kernels("pallas", TILING)
    with pytest.raises(config_lib.InputError, match="attention_tiling"):
        config_lib.EngineConfig(attention_tiling=TILING).kernels("cpu")


def test_the_engine_asks_for_a_head_when_it_drafts(random_target):
    with pytest.raises(config_lib.InputError, match="needs a draft head"):
        engine_lib.Engine(random_target(), config=config_lib.EngineConfig(tree=tree_lib.TreeOptions(2, 2, 3)))
