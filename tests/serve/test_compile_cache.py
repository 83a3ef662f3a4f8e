"""The persistent per-module compilation cache: reuse across engines and processes, damage, concurrency,
and entries or directories written by someone else."""

import hashlib
import json
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import pytest

from eagle_jax.serve import compile_cache
from eagle_jax.serve import compiler as compiler_lib
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib

REPO = pathlib.Path(__file__).resolve().parents[2]
MAX_NEW = 6
PROMPTS = [[5, 6, 7, 8, 9], [10, 20, 30]]


@pytest.fixture(scope="module")
def target(random_target):
    return random_target(seed=3)


def generate(target, cache_dir):
    engine = engine_lib.Engine(target, config=config_lib.EngineConfig(max_length=64, cache_dir=cache_dir))
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
    modules = sorted(path.name.rsplit("-", 1)[0] for path in cache_dir.iterdir() if path.is_dir())
    assert modules == ["decode", "prefill-plain"]
    assert len(entries(cache_dir)) == 2
    assert not list(cache_dir.glob("*/.tmp-*")) and not list(cache_dir.glob(".tmp-*"))
    assert (cache_dir / compile_cache.KEY_NAME).stat().st_mode & 0o777 == 0o600
    assert all(path.stat().st_mode & 0o777 == 0o700 for path in [cache_dir, *cache_dir.iterdir()] if path.is_dir())


def test_second_engine_loads_everything_without_tracing(target, filled, cache_copy, monkeypatch):
    traced = []
    real_lower = compiler_lib.Compiler._lower
    monkeypatch.setattr(compiler_lib.Compiler, "_lower", lambda self, *args: traced.append(args) or real_lower(self, *args))
    engine, tokens = generate(target, cache_copy)
    assert engine.compile_cache.misses == 0 and engine.compile_cache.hits == 2
    assert traced == [] and engine.compiler.lowering_seconds == 0
    assert tokens == filled[2]


def test_slot_programs_of_other_settings_are_never_loaded(target, random_head, tmp_path):
    """Engines that differ in slots and drafts share one cache: each gets the tokens it gets alone
    (the empty state's shape is bound into its function, not passed: the key must still see it),
    and a second engine of each setting loads every program the first compiled."""
    head = random_head(target.config, "eagle", seed=4)
    settings = [dict(batch_size=2, num_speculative_tokens=2), dict(batch_size=3, num_speculative_tokens=2),
                dict(batch_size=3, num_speculative_tokens=3)]
    prompts = [[5, 6, 7, 8, 9], [10, 20, 30], [7, 7], [3, 1, 4, 1, 5]]
    for setting in settings:
        config = lambda cache_dir: config_lib.EngineConfig(max_length=64, scheduler="continuous", cache_dir=cache_dir,
                                                           **setting)
        alone = engine_lib.Engine(target, head, config(None)).generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
        for warm in (False, True):
            shared = engine_lib.Engine(target, head, config(str(tmp_path / "xla")))
            results = shared.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
            assert [r.token_ids for r in results] == [r.token_ids for r in alone], setting
            if warm:
                assert shared.compile_cache.misses == 0 and shared.compile_cache.hits > 0, setting


def test_a_program_function_must_be_the_compilers_own(target):
    engine = engine_lib.Engine(target, config=config_lib.EngineConfig(max_length=64))
    with pytest.raises(TypeError, match="method of its Compiler"):
        engine.compiler._program("closure", lambda x: x + 1, (jnp.zeros(3),), {}, 0)


def test_mesh_is_part_of_the_key_and_split_programs_reload(random_target, filled, tmp_path):
    """A program partitioned over 2 devices gets its own directories, saves, and loads in a new engine."""
    from eagle_jax.serve import sharding

    root = tmp_path / "xla"
    key = lambda mesh: compile_cache.CompileCache(root, mesh, code=CODE).module_dir(MODULE, KEY)
    assert len({key(None), key(sharding.make_mesh(2)), key(sharding.make_mesh(4))}) == 3
    target = random_target(seed=3, vocab_size=128)  # the vocabulary must divide the mesh
    runs = []
    for _ in range(2):
        engine = engine_lib.Engine(target, config=config_lib.EngineConfig(max_length=64, cache_dir=str(root),
                                                                          tensor_parallel_size=2))
        runs.append((engine, [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=MAX_NEW, ignore_eos=True)]))
    (first, tokens), (second, again) = runs
    assert (first.compile_cache.misses, second.compile_cache.misses, second.compile_cache.hits) == (2, 0, 2)
    assert again == tokens == [r.token_ids for r in engine_lib.Engine(target, config=config_lib.EngineConfig(max_length=64)).generate(
        PROMPTS, max_new_tokens=MAX_NEW, ignore_eos=True)]


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
    from eagle_jax.io import checkpoint
    from eagle_jax.model import config
    from eagle_jax.serve import engine
    from eagle_jax.model import llama

    cfg = config.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                             num_kv_heads=2, head_dim=8, max_position_embeddings=512)
    factory = lambda: llama.Llama(cfg, rngs=nnx.Rngs(0))
    # numpy weights: jax's random initialisers would compile op by op (seconds per process).
    rng = np.random.default_rng(0)
    abstract = checkpoint.abstract_model(factory)
    shapes = checkpoint.param_shapes(abstract)
    target = checkpoint.build_model(abstract, {path: 0.3 * rng.standard_normal(leaf.shape) for path, leaf in shapes.items()},
                                    np.float32)
    eng = engine.Engine(target, config=engine.config_lib.EngineConfig(max_length=64, cache_dir=sys.argv[1]))
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
    assert len(entries(cache_dir)) == 2 and not list(cache_dir.glob("*/.tmp-*")) and not list(cache_dir.glob(".tmp-*"))
    # A third, fresh process compiles none of the engine's programs.
    third = finish(start())
    assert third["misses"] == 0 and third["hits"] == 2 and third["engine_compiles"] == 0
    assert first["tokens"] == second["tokens"] == third["tokens"] and len(third["tokens"]) == 6


# Entries and directories others could have written. These use one tiny program, not an engine.
MODULE, KEY, CODE = "tiny", "tiny program", "2 * x + 1"


def lowered_program():
    return jax.jit(lambda x: 2 * x + 1).lower(jnp.zeros((3,), jnp.float32))


def write_marker(path):
    """What a crafted entry runs when unpickled (pickle stores it by reference: tests.test_compile_cache)."""
    pathlib.Path(path).write_text("code from a cache entry ran")


class Exploit:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return write_marker, (self.marker,)


@pytest.mark.parametrize("signature", ["sha256", "other key"])
def test_crafted_entry_is_never_unpickled(tmp_path, signature):
    marker = tmp_path / "marker"
    payload = pickle.dumps(Exploit(marker))
    pickle.loads(payload)  # the payload does run code when unpickled ...
    assert marker.exists()
    marker.unlink()
    lowered = lowered_program()
    compile_cache.CompileCache(tmp_path / "xla", code=CODE).load_or_compile(MODULE, KEY, lambda: lowered)
    [entry] = entries(tmp_path / "xla")
    # ... and replaces a valid entry, with a check that is right as far as an attacker can make
    # it: sha256 (all the first format checked), or a MAC under a key other than the cache's.
    if signature == "sha256":
        check = hashlib.sha256(payload).hexdigest().encode()
    else:
        check = compile_cache._mac(b"k" * compile_cache.KEY_BYTES, compile_cache._entry_name(entry), payload)
    crafted = compile_cache.MAGIC + check + payload
    entry.write_bytes(crafted)
    cache = compile_cache.CompileCache(tmp_path / "xla", code=CODE)
    with pytest.warns(UserWarning, match="discarding unreadable entry"):
        compiled, _ = cache.load_or_compile(MODULE, KEY, lambda: lowered)
    assert not marker.exists()  # ... but is never unpickled
    assert cache.misses == 1 and cache.hits == 0
    assert compiled(jnp.ones(3)).tolist() == [3.0, 3.0, 3.0]
    assert entry.read_bytes() != crafted  # replaced by the recompiled program's own entry


def test_valid_entries_hit_across_instances(tmp_path):
    first = compile_cache.CompileCache(tmp_path / "xla", code=CODE)
    first.load_or_compile(MODULE, KEY, lowered_program)
    second = compile_cache.CompileCache(tmp_path / "xla", code=CODE)
    compiled, _ = second.load_or_compile(MODULE, KEY, lowered_program)
    assert (first.misses, first.hits, second.misses, second.hits) == (1, 0, 0, 1)
    assert first.secret_key() == second.secret_key()
    assert compiled(jnp.ones(3)).tolist() == [3.0, 3.0, 3.0]


def test_entry_moved_to_another_name_fails_its_mac(tmp_path):
    cache = compile_cache.CompileCache(tmp_path / "xla", code=CODE)
    lowered = lowered_program()
    cache.load_or_compile(MODULE, KEY, lambda: lowered)
    entry = cache.entry_path(MODULE, KEY)
    moved = cache.entry_path(MODULE, "other settings")
    moved.parent.mkdir(mode=0o700)
    shutil.copy(entry, moved)
    with pytest.warns(UserWarning, match="MAC mismatch"):
        cache.load_or_compile(MODULE, "other settings", lambda: lowered)
    assert cache.misses == 2


@pytest.mark.parametrize("where", ["root", "module"])
@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_directory_others_can_write_is_refused(tmp_path, where, mode):
    cache = compile_cache.CompileCache(tmp_path / "xla", code=CODE)
    lowered = lowered_program()
    cache.load_or_compile(MODULE, KEY, lambda: lowered)
    directory = cache.root if where == "root" else cache.entry_path(MODULE, KEY).parent
    directory.chmod(mode)
    fresh = compile_cache.CompileCache(tmp_path / "xla", code=CODE)
    with pytest.raises(compile_cache.CompileCacheError, match="writable by other users"):
        fresh.load_or_compile(MODULE, KEY, lambda: lowered)
    assert fresh.hits == 0
    assert issubclass(compile_cache.CompileCacheError, ValueError)  # the CLI reports ValueErrors as `error: ...`


def test_sticky_directory_of_ours_is_accepted(tmp_path):
    root = tmp_path / "xla"
    root.mkdir()
    root.chmod(0o1777)  # as /tmp: others may add files but not replace ours
    cache = compile_cache.CompileCache(root, code=CODE)
    cache.load_or_compile(MODULE, KEY, lowered_program)
    assert cache.misses == 1


def test_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    cache = compile_cache.CompileCache(tmp_path / "xla", code=CODE)
    monkeypatch.setattr(compile_cache.os, "getuid", lambda: os.stat(tmp_path).st_uid + 1)
    with pytest.raises(compile_cache.CompileCacheError, match="owned by uid"):
        cache.load_or_compile(MODULE, KEY, lowered_program)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_key_file_others_can_access_is_refused(tmp_path, mode):
    cache = compile_cache.CompileCache(tmp_path / "xla", code=CODE)
    cache.load_or_compile(MODULE, KEY, lowered_program)
    (cache.root / compile_cache.KEY_NAME).chmod(mode)
    with pytest.raises(compile_cache.CompileCacheError, match="accessible to other users"):
        compile_cache.CompileCache(cache.root, code=CODE).load_or_compile(MODULE, KEY, lowered_program)


@pytest.mark.parametrize("damage", ["short", "symlink"])
def test_damaged_key_file_is_refused(tmp_path, damage):
    root = tmp_path / "xla"
    root.mkdir(mode=0o700)
    key = root / compile_cache.KEY_NAME
    if damage == "short":
        key.write_bytes(b"k" * (compile_cache.KEY_BYTES // 2))
        key.chmod(0o600)
    else:
        (tmp_path / "elsewhere").write_bytes(b"k" * compile_cache.KEY_BYTES)
        (tmp_path / "elsewhere").chmod(0o600)
        key.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(compile_cache.CompileCacheError, match="key file"):
        compile_cache.CompileCache(root, code=CODE).load_or_compile(MODULE, KEY, lowered_program)


def test_a_key_linked_first_by_another_process_is_used(tmp_path, monkeypatch):
    """Two processes creating the key at once: the one whose link fails reads the other's key."""
    root = tmp_path / "xla"
    root.mkdir(mode=0o700)
    winner = b"w" * compile_cache.KEY_BYTES
    real_link = os.link

    def link_after_another_process(source, target):
        handle = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(handle, winner)
        os.close(handle)
        real_link(source, target)  # now fails with FileExistsError, as it would in the race

    monkeypatch.setattr(compile_cache.os, "link", link_after_another_process)
    assert compile_cache.CompileCache(root, code=CODE).secret_key() == winner
    assert sorted(path.name for path in root.iterdir()) == [compile_cache.KEY_NAME]  # no temporary left


# ---- what killed writers left, and caches that cannot be used ----

def backdate(path, seconds=3600):
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_stale_temporaries_are_removed_and_live_ones_kept(tmp_path):
    from eagle_jax.io import staging

    cache = compile_cache.CompileCache(tmp_path / "xla", code=CODE)
    lowered = lowered_program()
    cache.load_or_compile(MODULE, KEY, lambda: lowered)
    module_dir = cache.entry_path(MODULE, KEY).parent
    stale, live, fresh, key_left = (module_dir / ".tmp-stale", module_dir / ".tmp-live", module_dir / ".tmp-fresh",
                                    cache.root / ".tmp-key-stale")
    for path in (stale, live, fresh, key_left):
        path.write_bytes(b"half an entry")
    for path in (stale, live, key_left):
        backdate(path)
    handle = staging.lock(live)  # a writer still working on it
    try:
        again = compile_cache.CompileCache(tmp_path / "xla", code=CODE)
        compiled, _ = again.load_or_compile(MODULE, KEY, lambda: lowered)
        assert again.hits == 1 and compiled(jnp.ones(3)).tolist() == [3.0, 3.0, 3.0]  # the entry is intact
        assert sorted(path.name for path in module_dir.iterdir()) == [".tmp-fresh", ".tmp-live", entries(tmp_path / "xla")[0].name]
        assert not key_left.exists()
    finally:
        os.close(handle)


def test_a_cache_root_that_is_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "xla").write_text("not a directory")
    with pytest.raises(compile_cache.CompileCacheError, match="exists and is not a directory"):
        compile_cache.CompileCache(tmp_path / "xla", code=CODE).load_or_compile(MODULE, KEY, lowered_program)


def test_a_read_only_cache_still_serves_its_entries_and_names_the_problem_otherwise(tmp_path, monkeypatch):
    import errno

    lowered = lowered_program()
    compile_cache.CompileCache(tmp_path / "filled", code=CODE).load_or_compile(MODULE, KEY, lambda: lowered)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    # (Running as root, a chmod would not stop writes: the filesystem's refusal is simulated.)
    monkeypatch.setattr(compile_cache.tempfile, "mkstemp", read_only)
    filled = compile_cache.CompileCache(tmp_path / "filled", code=CODE)
    assert filled.load_or_compile(MODULE, KEY, lambda: lowered)[0] is not None and filled.hits == 1
    (tmp_path / "empty").mkdir(mode=0o700)
    with pytest.raises(compile_cache.CompileCacheError, match=r"cannot create the key file in .*empty \(Read-only "
                                                               r"file system\).*--no-compile-cache"):
        compile_cache.CompileCache(tmp_path / "empty", code=CODE).load_or_compile(MODULE, KEY, lambda: lowered)
    with pytest.warns(UserWarning, match="could not save"):  # a new program compiles, unsaved
        compiled, _ = filled.load_or_compile(MODULE, "another key", lambda: lowered)
    assert compiled(jnp.ones(3)).tolist() == [3.0, 3.0, 3.0]


def test_every_part_of_the_cache_root_passes_the_same_check(tmp_path, monkeypatch):
    """The compiled code (xla/) and the converted models (models/) are refused alike."""
    from eagle_jax.io import cache_dirs
    from eagle_jax.io import default_model

    monkeypatch.setenv("EAGLE_JAX_CACHE_DIR", str(tmp_path / "cache"))
    compile_cache.CompileCache(compile_cache.default_root(), code=CODE).load_or_compile(MODULE, KEY, lowered_program)
    default_model.models_dir()
    for part in ("xla", "models"):
        (tmp_path / "cache" / part).chmod(0o770)
    with pytest.raises(cache_dirs.CacheDirectoryError, match="compilation cache: .*xla is writable by other users"):
        compile_cache.CompileCache(compile_cache.default_root(), code=CODE).load_or_compile(MODULE, KEY, lowered_program)
    with pytest.raises(cache_dirs.CacheDirectoryError, match="model cache: .*models is writable by other users"):
        default_model.models_dir()


def test_a_module_keeps_the_entries_of_its_latest_code_versions(tmp_path):
    """Each code version writes its own entry; a directory keeps the newest KEEP_ENTRIES written or loaded."""
    root = tmp_path / "xla"
    cache = lambda version: compile_cache.CompileCache(root, code=f"version {version}")
    began = time.time() - 3600
    for version in range(6):
        cache(version).load_or_compile(MODULE, KEY, lowered_program)
        entry = cache(version).entry_path(MODULE, KEY)
        os.utime(entry, (began + version, began + version))  # written in this order, a second apart
    kept = lambda: sorted(path.name for path in entries(root))
    names = {version: cache(version).entry_path(MODULE, KEY).name for version in range(7)}
    assert kept() == sorted(names[v] for v in (2, 3, 4, 5))
    reader = cache(2)
    compiled, _ = reader.load_or_compile(MODULE, KEY, lowered_program)  # loading version 2 refreshes it
    assert reader.hits == 1 and compiled(jnp.ones(3)).tolist() == [3.0, 3.0, 3.0]
    cache(6).load_or_compile(MODULE, KEY, lowered_program)
    assert kept() == sorted(names[v] for v in (2, 4, 5, 6))
