"""An EAGLE-3 lm_head run as int8 (`model.int8_linear`), as `io.models.load_head` keeps a stored one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from eagle_jax.io import hf_files
from eagle_jax.io import int8_weights
from eagle_jax.io import models
from eagle_jax.model import float32_logits
from eagle_jax.model import int8_linear
from eagle_jax.serve import config as engine_config
from eagle_jax.serve import engine as engine_lib
from tests.kernels import kernel_calls


def test_the_layer_scales_the_sums_of_its_int8_columns():
    rng = np.random.default_rng(0)
    kernel = jnp.asarray(rng.integers(-127, 128, (8, 5)), jnp.int8)
    scale = jnp.asarray(rng.uniform(0.01, 0.1, 5), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 3, 8)), jnp.bfloat16)
    layer = int8_linear.Int8Linear(kernel, scale, jnp.bfloat16)
    got = layer(x)
    want = np.asarray(x, np.float32) @ (np.asarray(kernel, np.float32) * np.asarray(scale))
    assert got.dtype == jnp.float32 and got.shape == (2, 3, 5)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="int8 \\[in, out\\] kernel, got float32"):
        int8_linear.Int8Linear(kernel.astype(jnp.float32), scale, jnp.bfloat16)
    with pytest.raises(ValueError, match="one scale an output column"):
        int8_linear.Int8Linear(kernel, scale[:4], jnp.bfloat16)


def int8_lm_head(head) -> int8_linear.Int8Linear:
    """`head`'s lm_head stored as int8 (`int8_weights`) and run as stored, in the head's dtype."""
    weight = np.asarray(head.lm_head.kernel[...], np.float32).T  # [out, in], as a checkpoint stores it
    stored = int8_weights.quantize({"lm_head.weight": weight}, ["lm_head.weight"])
    return int8_linear.Int8Linear(jnp.asarray(stored["lm_head.weight"].T),
                                  jnp.asarray(stored["lm_head.weight_scale"][:, 0]), head.lm_head.dtype)


@pytest.fixture
def int8_head_dir(random_target, random_head, save_head, tmp_path):
    """(target, directory of an EAGLE-3 head whose lm_head is stored int8, the stored tensors)."""
    target = random_target(seed=2)
    directory = save_head(random_head(target.config, "eagle3", seed=3, draft_vocab_size=40), tmp_path / "head")
    stored = int8_weights.quantize(hf_files.load_tensors(directory), ["lm_head.weight"])
    hf_files.save_tensors(stored, directory / "model.safetensors")
    return target, directory, stored


def test_a_bfloat16_head_runs_its_stored_int8_lm_head_as_stored(int8_head_dir):
    target, directory, stored = int8_head_dir
    head = models.load_head(directory, target, "bfloat16")
    assert isinstance(head.lm_head, int8_linear.Int8Linear)
    np.testing.assert_array_equal(np.asarray(head.lm_head.kernel[...]), stored["lm_head.weight"].T)
    np.testing.assert_array_equal(np.asarray(head.lm_head.scale[...]), stored["lm_head.weight_scale"][:, 0])
    # Float32 heads (parity checks) and float32 parameters (training) keep the widened weight.
    for loaded in (models.load_head(directory, target), models.load_head(directory, target, "bfloat16", "float32")):
        assert isinstance(loaded.lm_head, nnx.Linear) and jnp.issubdtype(loaded.lm_head.kernel[...].dtype, jnp.floating)

    out = jax.random.normal(jax.random.key(1), (1, 3, head.config.hidden_size), jnp.bfloat16)
    logits = {setting: np.asarray(head.logits(out, target, setting)) for setting in ("xla", "pallas")}
    assert kernel_calls.pallas_names(jax.make_jaxpr(lambda: head.logits(out, target, "pallas"))()) == ["norm_linear_int8"]
    normed = np.asarray(head.norm(out), np.float32)
    widened = stored["lm_head.weight"].T.astype(np.float32) * stored["lm_head.weight_scale"][:, 0]
    want = normed @ widened
    np.testing.assert_allclose(logits["xla"], want, rtol=1e-5, atol=1e-5)  # the stored weight's own logits
    np.testing.assert_allclose(logits["pallas"], logits["xla"], rtol=1e-5, atol=1e-5)  # the kernel, interpreted
    # Against the weight widened and rounded to bfloat16 (the head before): that rounding only.
    rounded = float32_logits.float32_logits(head.norm(out), jnp.asarray(widened, jnp.bfloat16))
    np.testing.assert_allclose(np.asarray(rounded), want, rtol=0.02, atol=0.02)
    assert not np.array_equal(np.asarray(rounded), logits["xla"])


@pytest.mark.parametrize("setting", ["xla", "pallas"])
def test_speculative_decoding_with_an_int8_lm_head_keeps_greedy_tokens(random_target, random_head, setting):
    """An int8 lm_head changes only what the head proposes; the target still decides every token."""
    target = random_target(seed=5, num_layers=2)
    head = random_head(target.config, "eagle3", seed=6, draft_vocab_size=64, feature_layers=(0, 1, 1))
    head.lm_head = int8_lm_head(head)
    prompts = [[3, 5, 7, 9], [11, 2]]
    run = lambda draft, k: [r.token_ids for r in engine_lib.Engine(target, draft, config=engine_config.EngineConfig(
        num_speculative_tokens=k, max_length=48, batch_size=2, decode_kernels=setting)).generate(
        prompts, max_new_tokens=10, ignore_eos=True)]
    assert run(head, 3) == run(None, 0)
