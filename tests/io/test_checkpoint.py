"""Garbage weights and lying configs: NaN/Inf, integer tensors where floats belong, a config that
claims more layers than its checkpoint holds, sizes that are zero, negative or missing."""

import json

import numpy as np
import pytest

from eagle_jax.io import checkpoint
from eagle_jax.io import hf_files
from eagle_jax.io import int8_weights
from eagle_jax.io import models


def hf_tensors(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 tensors under the HF Llama names and shapes a config.json describes."""
    rng = np.random.default_rng(seed)
    hidden, heads, kv_heads = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, ffn, vocab = config["head_dim"], config["intermediate_size"], config["vocab_size"]
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        shapes.update({
            f"{prefix}.input_layernorm.weight": (hidden,), f"{prefix}.post_attention_layernorm.weight": (hidden,),
            f"{prefix}.self_attn.q_proj.weight": (heads * head_dim, hidden),
            f"{prefix}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            f"{prefix}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            f"{prefix}.self_attn.o_proj.weight": (hidden, heads * head_dim),
            f"{prefix}.mlp.gate_proj.weight": (ffn, hidden), f"{prefix}.mlp.up_proj.weight": (ffn, hidden),
            f"{prefix}.mlp.down_proj.weight": (hidden, ffn)})
    return {name: (0.2 * rng.standard_normal(shape)).astype(np.float32) for name, shape in shapes.items()}


@pytest.fixture
def hf_dir(tiny_hf_config, tmp_path):
    """Factory: `hf_dir(edit=None, **config overrides)` -> an HF Llama directory, its tensors edited."""

    def make(edit=None, config_edit=None, **overrides):
        directory = tmp_path / f"model{len(list(tmp_path.iterdir()))}"
        directory.mkdir()
        config = tiny_hf_config(**overrides)
        tensors = hf_tensors(config)
        if edit:
            edit(tensors)
        if config_edit:
            config_edit(config)
        hf_files.save_tensors(tensors, directory / "model.safetensors")
        (directory / "config.json").write_text(json.dumps(config))
        return directory

    return make


def test_the_fixture_loads(hf_dir):
    model, _ = models.load_target(hf_dir())
    assert model.config.num_layers == 2


def test_benchmarks_take_the_checkpoint_or_random_weights_of_its_config(hf_dir):
    directory = hf_dir()
    loaded, tokenizer_dir = models.target_or_random(directory, None)
    random, no_tokenizer = models.target_or_random(directory, directory / "config.json")
    assert tokenizer_dir == directory and no_tokenizer is None
    assert random.config == loaded.config
    assert not np.allclose(random.embed_tokens.embedding[...], loaded.embed_tokens.embedding[...])


def _set(name, value, dtype=None):
    def edit(tensors):
        array = tensors[name].astype(dtype) if dtype else tensors[name].copy()
        array.reshape(-1)[5] = value
        tensors[name] = array
    return edit


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_one_nan_or_inf_weight_is_refused_by_name(hf_dir, value):
    directory = hf_dir(_set("model.layers.1.mlp.up_proj.weight", value))
    with pytest.raises(hf_files.CheckpointError, match=rf"{directory}: tensor 'model.layers.1.mlp.up_proj.weight' "
                                                       r"holds (nan|inf|-inf) at index \[0, 5\]"):
        models.load_target(directory)


def test_a_nan_in_bfloat16_is_refused_too(hf_dir):
    import ml_dtypes

    directory = hf_dir(_set("model.norm.weight", np.nan, ml_dtypes.bfloat16))
    with pytest.raises(hf_files.CheckpointError, match="'model.norm.weight' holds nan"):
        models.load_target(directory)


def test_a_nan_in_the_converted_format_is_refused_by_its_path(hf_dir, tmp_path):
    from convert import __main__ as convert_cli

    assert convert_cli.main([str(hf_dir()), str(tmp_path / "converted")]) == 0
    params_file = tmp_path / "converted" / models.PARAMS_FILE
    tensors = {name: np.array(array) for name, array in hf_files.load_tensors(params_file).items()}
    tensors["layers/0/mlp/gate_up_proj/kernel"][3, 4] = np.inf
    hf_files.save_tensors(tensors, params_file)
    with pytest.raises(hf_files.CheckpointError, match=r"'layers/0/mlp/gate_up_proj/kernel' holds inf at index \[3, 4\]"):
        models.load_target(tmp_path / "converted")


@pytest.mark.parametrize("dtype", [np.int8, np.bool_, np.int32])
def test_integer_or_bool_tensors_where_floats_belong_are_refused(hf_dir, dtype):
    def edit(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = np.ones_like(tensors["model.layers.0.self_attn.k_proj.weight"],
                                                                          dtype=dtype)

    with pytest.raises(hf_files.CheckpointError, match=rf"tensor 'model.layers.0.self_attn.k_proj.weight' has dtype "
                                                       rf"{np.dtype(dtype).name}, where the model expects floating"):
        models.load_target(hf_dir(edit))


def test_int8_head_storage_still_loads_but_int8_without_its_scale_is_refused(random_target, random_head, save_head,
                                                                             tmp_path):
    target = random_target(seed=2)
    directory = save_head(random_head(target.config, "eagle3", draft_vocab_size=40), tmp_path / "head")
    tensors = hf_files.load_tensors(directory)
    stored = int8_weights.quantize(tensors, ["lm_head.weight"])
    hf_files.save_tensors(stored, directory / "model.safetensors")
    assert models.load_head(directory, target).config.draft_vocab_size == 40  # the project's own int8 layout
    del stored["lm_head.weight" + int8_weights.SCALE_SUFFIX]
    hf_files.save_tensors(stored, directory / "model.safetensors")
    with pytest.raises(hf_files.CheckpointError, match=r"'lm_head.weight' has dtype int8, where the model expects "
                                                       r"floating weights \(an int8 weight needs its '_scale' companion\)"):
        models.load_head(directory, target)


def test_floating_values_for_an_integer_table_are_refused():
    with pytest.raises(hf_files.CheckpointError, match="'d2t' has dtype float32, where the model expects integers"):
        checkpoint.check_values("d2t", np.zeros(3, np.float32), np.int32)


def test_a_config_claiming_200000_layers_fails_at_once(hf_dir):
    # Building 200,000 layers would take hours: the header's layer names refuse it first.
    directory = hf_dir(config_edit=lambda config: config.update(num_hidden_layers=200_000))
    with pytest.raises(hf_files.CheckpointError, match=r"config.json says num_hidden_layers=200000, but the checkpoint "
                                                       r"holds layers 0..1"):
        models.load_target(directory)


def test_a_config_claiming_fewer_layers_or_another_vocabulary_is_refused(hf_dir):
    with pytest.raises(hf_files.CheckpointError, match="num_hidden_layers=1, but the checkpoint holds layers 0..1"):
        models.load_target(hf_dir(config_edit=lambda config: config.update(num_hidden_layers=1)))
    with pytest.raises(hf_files.CheckpointError, match=r"vocab_size=500, .* 'model.embed_tokens.weight' has shape \(101, 32\)"):
        models.load_target(hf_dir(config_edit=lambda config: config.update(vocab_size=500)))


def test_an_eagle3_head_claiming_200000_layers_fails_at_once(random_target, random_head, save_head, tmp_path):
    target = random_target(seed=2)
    directory = save_head(random_head(target.config, "eagle3", draft_vocab_size=40), tmp_path / "head")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=200_000)))
    with pytest.raises(hf_files.CheckpointError, match="num_hidden_layers=200000, but the checkpoint holds 1 layers"):
        models.load_head(directory, target)


@pytest.mark.parametrize("field, value, message", [
    ("num_hidden_layers", 0, "num_hidden_layers is 0, expected a positive integer"),
    ("hidden_size", -32, "hidden_size is -32, expected a positive integer"),
    ("num_key_value_heads", 0, "num_key_value_heads is 0, expected a positive integer"),
    ("num_attention_heads", "4", "num_attention_heads is '4', expected a positive integer"),
    ("intermediate_size", True, "intermediate_size is True, expected a positive integer"),
    ("rms_norm_eps", -1.0, "rms_norm_eps is -1.0, expected a positive number"),
    ("vocab_size", None, "lacks vocab_size"),
    ("num_attention_heads", "missing", "lacks num_attention_heads"),
])
def test_zero_negative_or_missing_sizes_are_clear_errors(hf_dir, field, value, message):
    def edit(config):
        if value == "missing":
            del config[field]
        else:
            config[field] = value

    directory = hf_dir(config_edit=edit)
    with pytest.raises(hf_files.CheckpointError, match=rf"{directory}: config.json: {message}"):
        models.load_target(directory)


def test_the_convert_cli_reports_a_config_without_a_field(hf_dir, tmp_path, capsys):
    from convert import __main__ as convert_cli

    directory = hf_dir(config_edit=lambda config: config.pop("hidden_size"))
    assert convert_cli.main([str(directory), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "config.json: lacks hidden_size" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
