"""Tensor parallelism: a target split over 2 or 4 CPU devices (conftest forces four) computes what
one device computes, through the same programs, with Megatron's collectives only; bad meshes are
refused by name; and two processes joined by `jax.distributed` generate what one does."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from eagle_jax.model import eagle
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib
from eagle_jax.cli import generate
from eagle_jax.model import layers
from eagle_jax.io import models
from eagle_jax.serve import sharding
from eagle_jax.decode import tree as tree_lib
from tests.cli.test_generate_cli import save_tokenizer
from tests.model import test_int8_linear

REPO = Path(__file__).resolve().parents[2]
# Heads and kv heads divide 2 and 4 (attention split), with biases on the fused projections.
SPLIT = dict(vocab_size=128, num_heads=8, num_kv_heads=4, head_dim=8, intermediate_size=64, attention_bias=True,
             mlp_bias=True)
# SmolLM2's shape in small: 3 kv heads divide neither (attention replicated), tied embeddings.
REPLICATED = dict(vocab_size=128, hidden_size=48, num_heads=6, num_kv_heads=3, head_dim=8, intermediate_size=64,
                  tied=True)
MAX_NEW = 32

pytestmark = pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (conftest forces 4 on a CPU)")


def forward(model, tokens):
    """Logits of a prefill of `tokens` [B, T] then of one decode step, and the cache after both."""
    graphdef, state = nnx.split(model)
    batch, length = tokens.shape

    @jax.jit
    def run(state, tokens):
        model = nnx.merge(graphdef, state)
        cache = model.init_cache(batch, 16)
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        hidden, cache, _ = model(tokens, positions, cache)
        prefill = model.logits(hidden)
        next_token = jnp.argmax(prefill[:, -1:], axis=-1).astype(jnp.int32)
        hidden, cache, _ = model(next_token, positions[:, -1:] + 1, cache)
        return prefill, model.logits(hidden), cache

    return run(state, tokens)


@pytest.mark.parametrize("shape", ["split", "replicated"])
@pytest.mark.parametrize("size", [2, 4])
def test_logits_and_cache_match_one_device(random_target, shape, size):
    target = random_target(seed=3, **(SPLIT if shape == "split" else REPLICATED))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 128, (2, 6)), jnp.int32)
    expected = forward(target, tokens)
    mesh = sharding.make_mesh(size)
    sharded = sharding.shard_target(target, mesh)
    got = forward(sharded, tokens)
    for want, have in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        np.testing.assert_allclose(np.asarray(have), np.asarray(want), rtol=1e-5, atol=1e-5)
    layer = sharded.layers[0]
    qkv = layer.self_attn.qkv_proj.kernel[...].sharding
    assert qkv.spec == PartitionSpec(None, "tensor") if shape == "split" else qkv.is_fully_replicated
    assert layer.mlp.down_proj.kernel[...].sharding.spec == PartitionSpec("tensor", None)
    assert sharded.embed_tokens.embedding[...].sharding.spec == PartitionSpec("tensor", None)
    kv_heads = PartitionSpec(None, None, "tensor", None) if shape == "split" else PartitionSpec(None, None, None, None)
    assert sharding.cache_shardings(target.init_cache(1, 4), target.config, mesh).keys[0].spec == kv_heads
    # The caller's model keeps its own layout.
    assert target.layers[0].self_attn.num_shards == 1 and target.layers[0].mlp.num_shards == 1


def test_block_order_gives_each_device_its_own_parts():
    # q of width 4 and k, v of width 2, over 2 devices: device 0 gets q[0:2] k[0] v[0], device 1 the rest.
    assert sharding.block_order((4, 2, 2), 2).tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    assert sharding.block_order((3, 3), 1).tolist() == list(range(6))


def table_gathers(hlo_text: str, cfg) -> list[str]:
    """The all-gathers in a compiled program (`sharding.collectives`) whose result is the whole
    embedding table [V, D]."""
    table = f"[{cfg.vocab_size},{cfg.hidden_size}]"
    return [name for name in sharding.collectives(hlo_text) if name.startswith("all-gather ") and name.endswith(table)]


def test_decode_step_uses_megatron_collectives_only(random_target, random_head):
    """All-reduces (after o_proj, down_proj, the embedding lookup) and a small gather for the argmax:
    a fused projection split without the block order would move q, k and v between devices. The
    embedding lookup (of the decode step and of an EAGLE-3 draft step) is the explicit
    vocabulary-parallel one, its all-reduce in the program before XLA partitions it, and no
    program all-gathers the table (XLA did so on GPUs, though not on CPUs, before the lookup)."""
    mesh = sharding.make_mesh(2)
    base = random_target(seed=3, **SPLIT)
    target = sharding.shard_target(base, mesh)
    graphdef, state = nnx.split(target)
    cache = target.init_cache(1, 16)

    def decode(state, token, cache):
        model = nnx.merge(graphdef, state)
        hidden, cache, _ = model(token, cache.lengths[:, None], cache)
        return jnp.argmax(model.logits(hidden), axis=-1), cache

    lowered = jax.jit(decode).lower(state, jnp.ones((1, 1), jnp.int32), cache)
    assert "stablehlo.all_reduce" in lowered.as_text()  # the lookup's psum (SPMD's collectives come later)
    text = lowered.compile().as_text()
    assert " all-reduce(" in text
    for moving in (" collective-permute(", " all-to-all(", " reduce-scatter("):
        assert moving not in text
    assert table_gathers(text, base.config) == []

    head = sharding.replicate(random_head(base.config, "eagle3", draft_vocab_size=64), mesh)
    assert table_gathers(draft_step_text(target, head), base.config) == []


def draft_step_text(target, head) -> str:
    """The compiled text of one cached draft step of `head` over `target` (both placed on a mesh)."""
    graphdef, state = nnx.split(target)
    head_def, head_params = nnx.split(head)

    def draft_step(state, head_params, token, feature, cache):
        model, head = nnx.merge(graphdef, state), nnx.merge(head_def, head_params)
        out, logits, cache = head(token[:, None], feature[:, None], cache.lengths[:, None], cache, model)
        return jnp.argmax(logits[:, 0], axis=-1), out, cache

    args = (state, head_params, jnp.ones((1,), jnp.int32), jnp.ones((1, target.config.hidden_size)),
            eagle.init_cache(head.config, 1, 16, jnp.float32))
    return jax.jit(draft_step).lower(*args).compile().as_text()


@pytest.fixture(scope="module")
def split_target(aligned_target):
    return aligned_target(seed=14, num_layers=3, **SPLIT)


@pytest.fixture(scope="module")
def prompts():
    return [np.random.default_rng(length).integers(0, 128, length).tolist() for length in (4, 9, 14)]


def generate_tokens(target, head, prompts, tensor_parallel_size, **settings):
    config = config_lib.EngineConfig(steps_per_call=8, max_length=64, tensor_parallel_size=tensor_parallel_size,
                                     **settings)
    engine = engine_lib.Engine(target, head, config=config)
    results = engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
    return [r.token_ids for r in results], [r.stats for r in results]


@pytest.mark.parametrize("case, size", [("plain", 2), ("plain-continuous", 4), ("plain-replicated", 2),
                                        ("eagle3", 2), ("eagle", 4), ("eagle-tree", 2), ("eagle3-split-head", 2),
                                        ("eagle-split-head", 4)])
def test_greedy_outputs_match_one_device(split_target, random_target, agreeing_head, biased_eagle3_head, prompts,
                                         case, size):
    """float32 greedy decoding, plain and speculative (chains and a tree, the head whole or split
    too), static batches (with an idle row) and decode slots: the same tokens and acceptance."""
    split_head = {"draft_tensor_parallel_size": size} if case.endswith("-split-head") else {}
    case = case.removesuffix("-split-head")
    target = random_target(seed=5, **REPLICATED) if case == "plain-replicated" else split_target
    settings = dict(scheduler="continuous" if case == "plain-continuous" else "static", batch_size=2)
    head = None
    if case == "eagle3":  # an EAGLE-3 head that drafts two frequent tokens, so some drafts are accepted
        reference, _ = generate_tokens(target, None, prompts, 1)
        frequent = np.argsort(-np.bincount(np.concatenate(reference), minlength=128))[:2]
        head = biased_eagle3_head(target.config, frequent, 64, seed=3)
    elif case.startswith("eagle"):  # drafts through the target's vocabulary-split lm_head
        head = agreeing_head(target.config, 0.3, residual=1.0, seed=1)
    if case == "eagle-tree":
        settings["tree"] = tree_lib.TreeOptions(2, 3, 6)
    elif head is not None:
        settings["num_speculative_tokens"] = 3
    expected, expected_stats = generate_tokens(target, head, prompts, 1, **settings)
    got, stats = generate_tokens(target, head, prompts, size, **settings, **split_head)
    assert got == expected
    assert stats == expected_stats
    if head is not None:
        assert max(s["acceptance_length"] for s in stats) > 1.2


def test_a_split_head_splits_its_mlp_and_draft_vocabulary_only(random_target, random_head):
    """shard_head: gate_up (in [gate_p | up_p] blocks) and the draft lm_head split by columns,
    down_proj by rows; attention, fc and norms whole on every device (its cache needs no layout);
    the draft step then all-reduces the MLP's output; sizes that do not divide are refused."""
    mesh = sharding.make_mesh(2)
    target = random_target(seed=3, **SPLIT)
    head = random_head(target.config, "eagle3", draft_vocab_size=64)
    split = sharding.shard_head(head, mesh)
    spec = lambda array: array.sharding.spec
    mlp = split.midlayer.mlp
    assert mlp.num_shards == 2 and split.midlayer.self_attn.num_shards == 1
    assert spec(mlp.gate_up_proj.kernel[...]) == PartitionSpec(None, "tensor")
    assert spec(mlp.down_proj.kernel[...]) == PartitionSpec("tensor", None)
    assert spec(split.lm_head.kernel[...]) == PartitionSpec(None, "tensor")
    for whole in (split.fc.kernel, split.midlayer.self_attn.qkv_proj.kernel, split.norm.weight):
        assert set(spec(whole[...])) <= {None}  # P() or P(None, None): whole on every device
    order = sharding.block_order(layers.gate_up_sizes(head.config.layer), 2)
    np.testing.assert_array_equal(np.asarray(mlp.gate_up_proj.kernel[...]),
                                  np.asarray(head.midlayer.mlp.gate_up_proj.kernel[...])[:, order])

    sharded_target = sharding.shard_target(target, mesh)
    all_reduces = lambda text: sum(n for name, n in sharding.collectives(text).items() if name.startswith("all-reduce"))
    split_text = draft_step_text(sharded_target, split)
    whole_text = draft_step_text(sharded_target, sharding.replicate(head, mesh))
    assert all_reduces(split_text) > all_reduces(whole_text)  # + the MLP's
    assert table_gathers(split_text, target.config) == []

    # An lm_head run as int8 splits its column scales with its columns.
    head.lm_head = test_int8_linear.int8_lm_head(head)
    split = sharding.shard_head(head, mesh)
    assert spec(split.lm_head.kernel[...]) == PartitionSpec(None, "tensor")
    assert spec(split.lm_head.scale[...]) == PartitionSpec("tensor")
    out = jax.random.normal(jax.random.key(0), (1, 2, head.config.hidden_size))
    np.testing.assert_allclose(np.asarray(split.logits(out, target)), np.asarray(head.logits(out, target)),
                               rtol=1e-5, atol=1e-5)

    with pytest.raises(sharding.ShardingError, match=r"does not divide the head's draft_vocab_size=65"):
        sharding.shard_head(random_head(target.config, "eagle3", draft_vocab_size=65), mesh)
    with pytest.raises(config_lib.InputError, match=r"draft_tensor_parallel_size must be 1 .* or the tensor parallel "
                                                    r"size 2"):
        config_lib.EngineConfig(num_speculative_tokens=2, tensor_parallel_size=2, draft_tensor_parallel_size=4)


def test_bad_meshes_are_refused_by_name(random_target, capsys):
    with pytest.raises(sharding.ShardingError, match=r"tensor_parallel_size=8 needs that many devices; 4 "):
        sharding.make_mesh(8)
    with pytest.raises(sharding.ShardingError, match=r"does not divide the target's vocab_size=101"):
        engine_lib.Engine(random_target(), config=config_lib.EngineConfig(tensor_parallel_size=2))
    with pytest.raises(sharding.ShardingError, match=r"tensor_parallel_size=4 does not divide the target's "
                                                     r"intermediate_size=66"):
        engine_lib.Engine(random_target(vocab_size=128, intermediate_size=66),
                          config=config_lib.EngineConfig(tensor_parallel_size=4))
    code = generate.main(["--model", "/nonexistent", "--tensor-parallel-size", "0"])
    assert code == 2
    # Refused before anything loads: the head is whole (1) or split like the target (N).
    assert generate.main(["--model", "/nonexistent", "--tensor-parallel-size", "2", "--draft-tensor-parallel-size",
                          "4"]) == 2
    assert "draft_tensor_parallel_size must be 1 (the head whole on every device) or the tensor parallel size 2" \
        in capsys.readouterr().err


@pytest.fixture(scope="module")
def model_dir(random_target, tiny_hf_config, tmp_path_factory):
    """A converted model (vocabulary 128, attention split) with a word-level tokenizer."""
    source = tmp_path_factory.mktemp("source")
    (source / "config.json").write_text(json.dumps(tiny_hf_config(**SPLIT)))
    save_tokenizer(source, SPLIT["vocab_size"])
    return models.save_converted(random_target(seed=7, **SPLIT), source, tmp_path_factory.mktemp("tp") / "model")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def test_two_processes_generate_what_one_does(model_dir, capsys):
    """`python -m eagle_jax.generate --tensor-parallel-size 2` as two CPU processes of one device each,
    joined by `jax.distributed` through JAX_COORDINATOR_ADDRESS: process 0 prints the tokens of a
    one-device run, process 1 nothing at all."""
    argv = ["--model", str(model_dir), "--prompt", "write a short poem about the sea", "--max-new-tokens", "12",
            "--ignore-eos", "--json", "--draft", "none", "--no-compile-cache"]
    assert generate.main(argv) == 0
    [expected] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"localhost:{free_port()}",
               JAX_NUM_PROCESSES="2", PYTHONPATH=str(REPO),
               XLA_FLAGS=os.environ["XLA_FLAGS"].replace("device_count=4", "device_count=1"))
    command = [sys.executable, "-m", "eagle_jax.generate", *argv, "--tensor-parallel-size", "2"]
    processes = [subprocess.Popen(command, env=dict(env, JAX_PROCESS_ID=str(index)), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for index in range(2)]
    outputs = [process.communicate(timeout=240) for process in processes]
    for process, (_, err) in zip(processes, outputs):
        assert process.returncode == 0, err
    # On a CPU, Gloo (the collectives' transport) announces its connection on stdout.
    [record] = [json.loads(line) for line in outputs[0][0].splitlines() if line.startswith("{")]
    assert record["token_ids"] == expected["token_ids"] and record["tensor_parallel_size"] == 2
    assert outputs[1][0] == ""
