"""`eagle-jax-convert`: HF directories, GGUF files and EAGLE heads, and its error reporting."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from convert import __main__ as convert_cli
from eagle_jax.io import hf_files
from eagle_jax.io import models

# The GGUF writer of the gguf_file tests (tests/ is on sys.path under pytest's default import mode).
from tests.io.test_gguf_file import hf_reference, write_gguf


def logits(model) -> np.ndarray:
    graphdef, params = nnx.split(model)

    @jax.jit
    def forward(params, tokens):
        module = nnx.merge(graphdef, params)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        hidden, _, _ = module(tokens, positions, module.init_cache(*tokens.shape))
        return module.logits(hidden)

    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, 12))
    return np.asarray(forward(params, jnp.asarray(tokens, jnp.int32)))


def run(capsys, *argv) -> tuple[int, str]:
    code = convert_cli.main([str(arg) for arg in argv])
    return code, capsys.readouterr().err


def test_hf_directory(hf_llama, tmp_path, capsys):
    _, source, direct = hf_llama(seed=11, tied=True)
    code, err = run(capsys, source, tmp_path / "out")
    assert code == 0, err
    out = tmp_path / "out"
    assert (out / "config.json").is_file() and (out / "generation_config.json").is_file()
    names = set(hf_files.load_tensors(out / models.PARAMS_FILE, progress=False))
    assert "layers/1/self_attn/qkv_proj/kernel" in names and "lm_head/kernel" not in names  # Flax paths, tied
    converted, _ = models.load_target(out)
    np.testing.assert_array_equal(logits(converted), logits(direct))


def test_a_conversion_with_the_old_unfused_layout_asks_to_convert_again(hf_llama, tmp_path, capsys):
    _, source, _ = hf_llama(seed=13)
    assert run(capsys, source, tmp_path / "out")[0] == 0
    params_file = tmp_path / "out" / models.PARAMS_FILE
    tensors = hf_files.load_tensors(params_file, progress=False)
    fused = tensors.pop("layers/0/self_attn/qkv_proj/kernel")
    tensors["layers/0/self_attn/q_proj/kernel"] = fused[:, :32]
    hf_files.save_tensors(tensors, params_file)
    with pytest.raises(hf_files.CheckpointError, match="older eagle_jax .* convert its source again"):
        models.load_target(tmp_path / "out")


def test_bfloat16(hf_llama, tmp_path, capsys):
    _, source, direct = hf_llama(seed=12)
    code, err = run(capsys, source, tmp_path / "out", "--dtype", "bfloat16")
    assert code == 0, err
    tensors = hf_files.load_tensors(tmp_path / "out" / models.PARAMS_FILE, progress=False)
    assert {array.dtype.name for array in tensors.values()} == {"bfloat16"}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    converted, _ = models.load_target(tmp_path / "out", "bfloat16")
    np.testing.assert_allclose(logits(converted), logits(direct), atol=0.1 * np.abs(logits(direct)).max())


def test_gguf_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("EAGLE_JAX_CACHE_DIR", str(tmp_path / "cache"))  # where load_target(.gguf) converts
    path = write_gguf(tmp_path / "tiny.gguf", hf_reference(), tokenizer=True)
    code, err = run(capsys, path, tmp_path / "out")
    assert code == 0, err
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    converted, _ = models.load_target(tmp_path / "out")
    direct, _ = models.load_target(path)
    np.testing.assert_array_equal(logits(converted), logits(direct))


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_head_is_checked_and_normalised_to_safetensors(hf_llama, random_head, save_head, tmp_path, capsys, method):
    _, target_dir, target = hf_llama(seed=13)
    head = random_head(target.config, method, seed=4, draft_vocab_size=40 if method == "eagle3" else 0)
    source = save_head(head, tmp_path / "head", torch_bin=True)
    code, err = run(capsys, source, tmp_path / "out", "--target", target_dir)
    assert code == 0, err
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text()) == json.loads((source / "config.json").read_text())
    original, written = hf_files.load_tensors(source), hf_files.load_tensors(out)
    assert set(written) == set(original)  # HF key names, including t2d for EAGLE-3
    for name, array in original.items():
        assert written[name].dtype == array.dtype
        np.testing.assert_array_equal(written[name], array)
    assert models.load_head(out, target).config == head.config


def test_head_dtype_casts_floating_tensors_only(hf_llama, random_head, save_head, tmp_path, capsys):
    _, target_dir, target = hf_llama(seed=13)
    source = save_head(random_head(target.config, "eagle3", draft_vocab_size=40), tmp_path / "head")
    code, err = run(capsys, source, tmp_path / "out", "--target", target_dir, "--dtype", "bfloat16")
    assert code == 0, err
    written = hf_files.load_tensors(tmp_path / "out")
    assert written["fc.weight"].dtype.name == "bfloat16" and written["midlayer.hidden_norm.weight"].dtype.name == "bfloat16"
    assert written["d2t"].dtype == np.int64 and written["t2d"].dtype == np.bool_
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    models.load_head(tmp_path / "out", target)


def test_head_needs_a_fitting_target(hf_llama, random_head, save_head, tmp_path, capsys):
    _, target_dir, target = hf_llama(seed=14)
    source = save_head(random_head(target.config, "eagle"), tmp_path / "head")
    code, err = run(capsys, source, tmp_path / "out")
    assert code == 2 and "error:" in err and "--target" in err
    _, other_dir, _ = hf_llama(seed=14, hidden_size=48, head_dim=12)
    code, err = run(capsys, source, tmp_path / "out", "--target", other_dir)
    assert code == 2 and "head hidden_size=32, target hidden_size=48" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_errors_exit_2_without_traceback(tmp_path, capsys, hf_llama):
    code, err = run(capsys, tmp_path / "missing", tmp_path / "out")
    assert code == 2 and err.startswith("error:") and "does not exist" in err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("not a model")
    code, err = run(capsys, tmp_path / "empty", tmp_path / "out")
    assert code == 2 and err.startswith("error:") and "config.json" in err
    (tmp_path / "weightless").mkdir()
    (tmp_path / "weightless" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    code, err = run(capsys, tmp_path / "weightless", tmp_path / "out")
    assert code == 2 and err.startswith("error:")
    _, source, _ = hf_llama(seed=15)
    code, err = run(capsys, source, tmp_path / "empty")  # a non-empty destination is not overwritten
    assert code == 2 and "already exists" in err
    assert "Traceback" not in capsys.readouterr().err


# ---- outputs appear whole or not at all ----

def beside(path):
    """What lies in the directory of `path` (its temporaries included)."""
    return sorted(entry.name for entry in path.parent.iterdir())


@pytest.mark.parametrize("source", ["hf", "gguf", "head"])
def test_a_full_disk_is_a_clear_error_and_leaves_no_output(hf_llama, random_head, save_head, tmp_path, capsys,
                                                          monkeypatch, source):
    import errno

    _, target_dir, target = hf_llama(seed=16)
    if source == "hf":
        src, extra = target_dir, []
    elif source == "gguf":
        src, extra = write_gguf(tmp_path / "tiny.gguf", hf_reference(), tokenizer=True), []
    else:
        src, extra = save_head(random_head(target.config, "eagle"), tmp_path / "head"), ["--target", target_dir]
    real_save = hf_files.save_tensors

    def disk_full(tensors, path, metadata=None):
        if path.name in (models.PARAMS_FILE, "model.safetensors") and "hf" not in path.parent.name:
            real_save(tensors, path, metadata)  # half of it written, then the disk fills
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_save(tensors, path, metadata)

    monkeypatch.setattr(hf_files, "save_tensors", disk_full)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "earlier").mkdir()  # an earlier output beside it stays untouched
    code, err = run(capsys, src, tmp_path / "out" / "new", *extra)
    assert code == 2 and "no space left on the device" in err and "nothing was written" in err, err
    assert "Traceback" not in err
    assert beside(tmp_path / "out" / "new") == ["earlier"]  # no output, no temporaries
    monkeypatch.undo()
    code, err = run(capsys, src, tmp_path / "out" / "new", *extra)  # with space again, it converts
    assert code == 0, err


def test_an_interrupted_conversion_leaves_no_output_and_nothing_in_tmp(hf_llama, tmp_path, capsys, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    path = write_gguf(tmp_path / "tiny.gguf", hf_reference(), tokenizer=True)

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "save_converted", interrupt)
    with pytest.raises(KeyboardInterrupt):
        convert_cli.main([str(path), str(tmp_path / "out")])
    assert beside(tmp_path / "out") == ["tiny.gguf", "tmp"] and os.listdir(tmp_path / "tmp") == []
    monkeypatch.undo()
    code, err = run(capsys, path, tmp_path / "out")
    assert code == 0, err
    models.load_target(tmp_path / "out")


def test_what_a_killed_conversion_left_beside_the_output_is_removed(hf_llama, tmp_path, capsys):
    import time

    _, source, _ = hf_llama(seed=17)
    for name in (".out.tmp-killed", ".out.gguf-source.tmp-killed"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"half")
        then = time.time() - 3600
        os.utime(tmp_path / name, (then, then))
    code, err = run(capsys, source, tmp_path / "out")
    assert code == 0, err
    assert not [name for name in beside(tmp_path / "out") if name.startswith(".out.")]
    models.load_target(tmp_path / "out")
