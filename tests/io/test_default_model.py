"""The model cache (`<cache>/models`): one conversion per GGUF content, private directories,
conversions that appear whole or not at all, and what interrupted ones left removed."""

import errno
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from eagle_jax.io import cache_dirs
from eagle_jax.io import default_model
from eagle_jax.io import gguf_file
from eagle_jax.io import hf_files
from eagle_jax.io import models
from eagle_jax.io import staging

# The GGUF writer of the gguf_file tests (tests/ is on sys.path under pytest's default import mode).
from tests.io.test_gguf_file import hf_reference, write_gguf


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_JAX_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def gguf_path(tmp_path):
    return write_gguf(tmp_path / "tiny.gguf", hf_reference(), tokenizer=True)


def entries(directory):
    return sorted(path.name for path in directory.iterdir())


def age(path, seconds=3600):
    """Backdates `path` as if a writer had made it long ago (stale temporaries are older than a minute)."""
    then = time.time() - seconds
    os.utime(path, (then, then), follow_symlinks=False)


def test_a_gguf_converts_once_by_content_whatever_its_path(cache, gguf_path, tmp_path):
    first = models.resolve_target_dir(gguf_path)
    assert first == cache / "models" / f"gguf-{default_model.file_sha256(gguf_path)}"
    copy = tmp_path / "elsewhere" / "renamed.gguf"
    copy.parent.mkdir()
    shutil.copy2(gguf_path, copy)
    written = {name: (first / name).stat().st_mtime_ns for name in entries(first)}
    assert models.resolve_target_dir(copy) == first  # the same content from another path: no second copy
    assert models.resolve_target_dir(gguf_path) == first
    assert entries(cache / "models") == [first.name]
    assert {name: (first / name).stat().st_mtime_ns for name in entries(first)} == written
    assert stat.S_IMODE((cache / "models").stat().st_mode) == 0o700


def test_a_gguf_edited_in_place_with_size_and_mtime_kept_converts_anew(cache, gguf_path):
    before = models.resolve_target_dir(gguf_path)
    old = gguf_file.read_gguf(gguf_path, progress=False)[1]["model.norm.weight"]
    info = gguf_path.stat()
    reference = hf_reference()
    name, weight = reference["model.norm.weight"]
    reference["model.norm.weight"] = (name, weight + 1.0)
    write_gguf(gguf_path, reference, tokenizer=True)
    os.utime(gguf_path, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert gguf_path.stat().st_size == info.st_size and gguf_path.stat().st_mtime_ns == info.st_mtime_ns
    after = models.resolve_target_dir(gguf_path)
    assert after != before
    np.testing.assert_allclose(hf_files.load_tensors(after)["model.norm.weight"], old + 1.0, rtol=1e-6)


def test_the_older_path_keyed_layout_is_removed_at_the_next_conversion(cache, gguf_path):
    models_dir = default_model.models_dir()
    for legacy in ("SmolLM2-135M-Instruct-hf", "tiny-0123456789ab-hf"):
        (models_dir / legacy).mkdir()
        (models_dir / legacy / "config.json").write_text("{}")
    (models_dir / "notes-hf").mkdir()  # not a name eagle_jax gave: kept
    kept_gguf = models_dir / default_model.GGUF_NAME
    kept_gguf.write_bytes(b"the default model's GGUF is kept")
    converted = models.resolve_target_dir(gguf_path)
    assert entries(models_dir) == sorted([converted.name, "notes-hf", default_model.GGUF_NAME])


@pytest.mark.parametrize("where", ["root", "models"])
def test_a_cache_others_can_write_is_refused(cache, gguf_path, where):
    converted = models.resolve_target_dir(gguf_path)
    (cache if where == "root" else cache / "models").chmod(0o777)
    with pytest.raises(cache_dirs.CacheDirectoryError, match="writable by other users"):
        models.resolve_target_dir(gguf_path)
    (cache if where == "root" else cache / "models").chmod(0o700)
    assert models.resolve_target_dir(gguf_path) == converted  # nothing was lost


def test_a_conversion_planted_by_another_user_is_refused(cache, gguf_path, monkeypatch):
    converted = models.resolve_target_dir(gguf_path)
    real_stat = os.stat

    def planted(path, *args, **kwargs):  # the converted directory appears owned by someone else
        info = real_stat(path, *args, **kwargs)
        if os.fspath(path) == os.fspath(converted):
            return os.stat_result((info.st_mode, info.st_ino, info.st_dev, info.st_nlink, info.st_uid + 1,
                                   *tuple(info)[5:]))
        return info

    monkeypatch.setattr(os, "stat", planted)
    with pytest.raises(cache_dirs.CacheDirectoryError, match=r"gguf-[0-9a-f]{64} is owned by uid \d+, not by this user"):
        models.resolve_target_dir(gguf_path)


def test_a_cache_of_another_user_is_refused(cache, gguf_path, monkeypatch):
    models.resolve_target_dir(gguf_path)
    monkeypatch.setattr(os, "getuid", lambda: cache.stat().st_uid + 1)
    with pytest.raises(cache_dirs.CacheDirectoryError, match="model cache: .* is owned by uid"):
        models.resolve_target_dir(gguf_path)


def test_a_cache_dir_that_is_a_file_is_a_clear_error(tmp_path, gguf_path, monkeypatch):
    (tmp_path / "cache").write_text("not a directory")
    monkeypatch.setenv("EAGLE_JAX_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(cache_dirs.CacheDirectoryError, match="exists and is not a directory; set "
                                                             "EAGLE_JAX_CACHE_DIR to a directory"):
        models.resolve_target_dir(gguf_path)


def test_a_read_only_cache_serves_its_conversions_and_names_the_problem_otherwise(cache, gguf_path, tmp_path):
    converted = models.resolve_target_dir(gguf_path)
    other = write_gguf(tmp_path / "other.gguf", hf_reference(), tokenizer=False)

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    # (Running as root, a chmod would not stop writes: the filesystem's refusal is simulated.)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(staging.tempfile, "mkdtemp", read_only)
        assert models.resolve_target_dir(gguf_path) == converted  # reading needs no write
        with pytest.raises(hf_files.CheckpointError, match=r"cannot write .*gguf-[0-9a-f]{64} \(Read-only file system\)"):
            models.resolve_target_dir(other)
    assert entries(cache / "models") == [converted.name]


def test_an_interrupted_conversion_leaves_nothing_and_the_next_one_converts(cache, gguf_path):
    def interrupt(*args):
        raise KeyboardInterrupt

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_file, "_save_tokenizer", interrupt)
        with pytest.raises(KeyboardInterrupt):
            models.resolve_target_dir(gguf_path)
    assert entries(cache / "models") == []  # nothing that looks converted, no staging left
    converted = models.resolve_target_dir(gguf_path)
    assert (converted / "tokenizer.json").is_file() and models.load_target(gguf_path)[1] == converted


def test_a_full_disk_during_conversion_is_a_clear_error_and_leaves_nothing(cache, gguf_path, monkeypatch):
    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(hf_files, "save_tensors", disk_full)
    with pytest.raises(hf_files.CheckpointError, match=r"no space left on the device holding .*models while writing "
                                                       r"gguf-[0-9a-f]{64}; nothing was written there"):
        models.resolve_target_dir(gguf_path)
    assert entries(cache / "models") == []


KILLED_CONVERSION = textwrap.dedent("""
    import sys
    from eagle_jax.io import gguf_file, models

    def stop(reader, out_dir, max_length):  # the weights are written; wait here to be killed
        print(out_dir, flush=True)
        sys.stdin.read()

    gguf_file._save_tokenizer = stop
    models.resolve_target_dir(sys.argv[1])
""")


def test_a_killed_conversion_leaves_only_staging_which_the_next_removes(cache, gguf_path, tmp_path):
    script = tmp_path / "convert.py"
    script.write_text(KILLED_CONVERSION)
    process = subprocess.Popen([sys.executable, str(script), str(gguf_path)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, EAGLE_JAX_CACHE_DIR=str(cache)))
    staged = process.stdout.readline().strip()
    assert staged, process.stderr.read()
    # A live writer's staging is locked: no cleaner touches it, however old it looks.
    [staging_dir] = (cache / "models").iterdir()
    age(staging_dir)
    assert staging.remove_stale(cache / "models") == []
    process.kill()
    process.wait()
    assert staging_dir.name.startswith(".gguf-") and ".tmp-" in staging_dir.name
    assert (staging_dir / "model.safetensors").is_file()  # what a kill leaves: staging, never a finished-looking dir
    converted = models.resolve_target_dir(gguf_path)
    assert entries(cache / "models") == [converted.name]  # the stale staging is gone
    models.load_target(gguf_path)


def test_a_recent_unlocked_temporary_is_left_alone(tmp_path):
    # A writer creates its temporary a moment before locking it: only old ones are stale.
    (tmp_path / ".x.tmp-new").mkdir()
    (tmp_path / ".x.tmp-old").mkdir()
    (tmp_path / "x").mkdir()
    age(tmp_path / ".x.tmp-old")
    age(tmp_path / "x")
    assert staging.remove_stale(tmp_path) == [tmp_path / ".x.tmp-old"]
    assert entries(tmp_path) == [".x.tmp-new", "x"]


def test_the_default_gguf_must_be_the_one_the_wheel_ships(cache, gguf_path, monkeypatch):
    monkeypatch.delenv("EAGLE_JAX_DEFAULT_GGUF")
    monkeypatch.setattr(default_model, "default_gguf_path", lambda: gguf_path)
    with pytest.raises(hf_files.CheckpointError, match=rf"sha256 {default_model.file_sha256(gguf_path)} is not the "
                                                       r"default model's .* delete it to download it again"):
        default_model.default_model_dir()
    assert not (cache / "models").exists() or entries(cache / "models") == []
