"""The persistent per-module compilation cache: reuse across engines and processes, damage, concurrency."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

from eagle_jax import engine as engine_lib

REPO = pathlib.Path(__file__).resolve().parent.parent
MAX_NEW = 6
PROMPTS = [[5, 6, 7, 8, 9], [10, 20, 30]]


@pytest.fixture(scope="module")
def target(random_target):
    return random_target(seed=3)


def generate(target, cache_dir):
    engine = engine_lib.Engine(target, max_length=64, cache_dir=cache_dir)
    results = engine.generate(PROMPTS, max_new_tokens=MAX_NEW, ignore_eos=True)
    return engine, [r.token_ids for r in results]


@pytest.fixture(scope="module")
def filled(target, tmp_path_factory):
    """A cache filled by a first engine; tests work on copies of it."""
    cache_dir = tmp_path_factory.mktemp("xla")
    engine, tokens = generate(target, cache_dir)
    return cache_dir, engine, tokens


@pytest.fixture
def cache_copy(filled, tmp_path):
    shutil.copytree(filled[0], tmp_path / "xla")
    return tmp_path / "xla"


def entries(cache_dir):
    return sorted(cache_dir.glob("*/*.xla"))


def test_first_engine_compiles_and_saves_one_entry_per_module(filled):
    cache_dir, engine, _ = filled
    assert engine.compile_cache.misses == 2 and engine.compile_cache.hits == 0  # prefill and decode
    assert engine.num_compilations == 2
    modules = sorted(path.name.rsplit("-", 1)[0] for path in cache_dir.iterdir())
    assert modules == ["decode", "prefill-plain"]
    assert len(entries(cache_dir)) == 2
    assert not list(cache_dir.glob("*/.tmp-*"))


def test_second_engine_loads_everything(target, filled, cache_copy):
    engine, tokens = generate(target, cache_copy)
    assert engine.compile_cache.misses == 0 and engine.compile_cache.hits == 2
    assert tokens == filled[2]


def test_removing_one_module_recompiles_only_it(target, filled, cache_copy):
    [decode_dir] = cache_copy.glob("decode-*")
    shutil.rmtree(decode_dir)
    engine, tokens = generate(target, cache_copy)
    assert engine.compile_cache.misses == 1 and engine.compile_cache.hits == 1
    assert decode_dir.is_dir() and tokens == filled[2]


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupt_entry_warns_and_is_rebuilt(target, filled, cache_copy, damage):
    entry = entries(cache_copy)[0]
    blob = bytearray(entry.read_bytes())
    if damage == "flip":
        blob[len(blob) // 2] ^= 0xFF
    else:
        del blob[len(blob) // 3:]
    entry.write_bytes(bytes(blob))
    with pytest.warns(UserWarning, match="discarding unreadable entry"):
        engine, tokens = generate(target, cache_copy)
    assert engine.compile_cache.misses == 1 and engine.compile_cache.hits == 1
    assert tokens == filled[2]
    engine, _ = generate(target, cache_copy)  # the rebuilt entry is valid
    assert engine.compile_cache.misses == 0


SCRIPT = textwrap.dedent("""
    import json, sys
    import jax

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **kw: compiles.append(kw.get("fun_name")) if "backend_compile" in event else None)

    import numpy as np
    from flax import nnx
    from eagle_jax import checkpoint, config, engine, llama

    cfg = config.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=8, max_position_embeddings=512)
    factory = lambda: llama.Llama(cfg, rngs=nnx.Rngs(0))
    # numpy weights: jax's random initialisers would compile op by op (seconds per process).
    rng = np.random.default_rng(0)
    abstract = checkpoint.abstract_model(factory)
    shapes = checkpoint.param_shapes(abstract)
    target = checkpoint.build_model(abstract, {path: 0.3 * rng.standard_normal(leaf.shape) for path, leaf in shapes.items()},
                                    np.float32)
    eng = engine.Engine(target, max_length=64, cache_dir=sys.argv[1])
    [result] = eng.generate([[5, 6, 7, 8]], max_new_tokens=6, ignore_eos=True)
    # The engine's programs are jax.jit(Engine._start) and jax.jit(Engine._run); other names are
    # small eager ops (PRNG seeding, array staging) that jax compiles in every process.
    ours = [name for name in compiles if name in ("jit(_start)", "jit(_run)")]
    print(json.dumps(dict(misses=eng.compile_cache.misses, hits=eng.compile_cache.hits,
                          engine_compiles=len(ours), tokens=result.token_ids)))
""")


def test_fresh_processes_share_the_cache_even_when_filling_it_concurrently(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    cache_dir = tmp_path / "xla"
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")

    def start():
        return subprocess.Popen([sys.executable, str(script), str(cache_dir)], env=env, cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def finish(process):
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-3000:]
        return json.loads(stdout.strip().splitlines()[-1])

    # Two processes fill the same empty cache at once. Which of them compiles a program depends on
    # timing (one may find the other's finished entry), so each must account for both programs,
    # compile exactly those it missed, and the atomic renames must leave complete entries only.
    first, second = start(), start()
    first, second = finish(first), finish(second)
    for run in (first, second):
        assert run["misses"] + run["hits"] == 2 and run["engine_compiles"] == run["misses"]
    assert first["misses"] + second["misses"] >= 2  # every program was compiled by someone
    assert len(entries(cache_dir)) == 2 and not list(cache_dir.glob("*/.tmp-*"))
    # A third, fresh process compiles none of the engine's programs.
    third = finish(start())
    assert third["misses"] == 0 and third["hits"] == 2 and third["engine_compiles"] == 0
    assert first["tokens"] == second["tokens"] == third["tokens"] and len(third["tokens"]) == 6
