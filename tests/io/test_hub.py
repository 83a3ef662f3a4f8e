"""Hugging Face hub ids where a path is expected (`--model org/name`, `--draft org/name`): resolved
through huggingface_hub's snapshot_download, monkeypatched here (tests reach no network)."""

import os
import shutil
import subprocess
import sys

import pytest

from eagle_jax import heads
from eagle_jax.io import hf_files
from eagle_jax.io import hub
from eagle_jax.io import models


def as_snapshot(directory, cache):
    """`directory` laid out as huggingface_hub caches it: snapshots/<revision>/<file> -> ../../blobs/<file>."""
    repo = cache / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    for path in directory.iterdir():
        shutil.copy2(path, repo / "blobs" / path.name)
        (snapshot / path.name).symlink_to(f"../../blobs/{path.name}")
    return snapshot


@pytest.fixture
def fake_hub(monkeypatch):
    """Factory: `fake_hub({repo id: snapshot dir})` -> the calls snapshot_download received."""
    import huggingface_hub

    def install(repositories):
        calls = []

        def snapshot_download(repo_id, **kwargs):
            calls.append((repo_id, kwargs))
            if repo_id not in repositories:
                raise huggingface_hub.errors.RepositoryNotFoundError(f"404 Client Error for {repo_id}")
            return str(repositories[repo_id])

        monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
        return calls

    return install


@pytest.mark.parametrize("text, expected", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", True), ("org/name", True), ("yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", True),
    ("./org/name", False), ("/abs/path", False), ("org/name/extra", False), ("../x", False), ("org/model.gguf", False),
    ("name", False), ("org/..", False),
])
def test_what_reads_as_a_hub_id(text, expected):
    assert hub.looks_like_repo_id(text) is expected


def test_a_model_hub_id_resolves_to_its_snapshot_and_loads(hf_llama, fake_hub, tmp_path):
    _, source, direct = hf_llama(seed=31)
    snapshot = as_snapshot(source, tmp_path / "hub")
    calls = fake_hub({"org/name": snapshot})
    assert models.resolve_target_dir("org/name") == snapshot
    model, directory = models.load_target("org/name")
    assert directory == snapshot and model.config == direct.config
    patterns = calls[0][1]["allow_patterns"]
    assert "*.safetensors" in patterns and not any(pattern.endswith(".py") or pattern == "*" for pattern in patterns)


def test_a_head_hub_id_resolves_for_draft_and_load_head(random_target, random_head, save_head, fake_hub, tmp_path):
    target = random_target(seed=4)
    exported = save_head(random_head(target.config, "eagle3", draft_vocab_size=40), tmp_path / "head")
    fake_hub({"org/head": as_snapshot(exported, tmp_path / "hub")})
    path, method = heads.choose_draft(None, "org/head", None)
    assert method == "eagle3" and (path / "config.json").is_file()
    assert models.load_head("org/head", target).config.draft_vocab_size == 40


def test_an_unknown_hub_id_is_one_clear_line(fake_hub):
    fake_hub({})
    for load in (models.resolve_target_dir, models.resolve_head_dir):
        with pytest.raises(hf_files.CheckpointError) as error:
            load("org/missing")
        message = str(error.value)
        assert "'org/missing'" in message and "not found locally nor reachable" in message and "\n" not in message


def test_a_missing_path_that_is_no_hub_id_says_so(fake_hub, tmp_path):
    calls = fake_hub({})
    with pytest.raises(FileNotFoundError, match="model path .*nothing.gguf does not exist"):
        models.resolve_target_dir(tmp_path / "nothing.gguf")
    with pytest.raises(FileNotFoundError, match="draft path not/there does not exist"):
        heads.choose_draft(None, "./not/there", None)
    assert calls == []


def test_offline_without_a_cached_snapshot_is_one_clear_line(tmp_path):
    # The real client, offline (it reads HF_HUB_OFFLINE when imported: hence a fresh process).
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf-home"), JAX_PLATFORMS="cpu")
    code = ("from eagle_jax.io import hub\n"  # what resolve_target_dir calls, without importing jax
            "try:\n    hub.snapshot('org/name')\n"
            "except Exception as error:\n    print(type(error).__name__, error)\n")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    [line] = result.stdout.strip().splitlines()
    assert line.startswith("CheckpointError model 'org/name' is not a local path, and was not found locally nor "
                           "reachable on the Hugging Face Hub")
