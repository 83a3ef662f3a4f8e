"""A split attention's partials (`kernels.partials`): the combine kernel, and o_proj merging them as
it reads them (`fused_linear.merged_linear_residual`), against the plain-jnp merge.

On CPU the kernels run in Pallas interpret mode; lowering for CUDA checks Triton's shape rules.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from eagle_jax import attention_ops
from eagle_jax import layers
from eagle_jax.kernels import decode_attention
from eagle_jax.kernels import fused_linear
from eagle_jax.kernels import partials

# SmolLM2-135M: 9 query heads of 64 over 3 kv heads, hidden 576.
HEADS, HEAD_DIM, KV_HEADS, HIDDEN = 9, 64, 3, 576


def random_partials(parts: int, batch: int, length: int, heads: int = HEADS, head_dim: int = HEAD_DIM,
                    seed: int = 0) -> partials.Partials:
    """Random states, part 1 neutral (no slot folded) where it exists, as a short cache leaves it."""
    rng = np.random.default_rng(seed)
    outputs = rng.standard_normal((parts, batch, length, heads, head_dim)).astype(np.float32)
    maxima = rng.standard_normal((parts, batch, length, heads)).astype(np.float32)
    sums = rng.uniform(0.5, 3.0, (parts, batch, length, heads)).astype(np.float32)
    if parts > 1:
        outputs[1], maxima[1], sums[1] = 0.0, attention_ops.MASK_VALUE, 0.0
    return partials.Partials(*(jnp.asarray(a) for a in (outputs, maxima, sums)))


def split_attention(batch: int, length: int, dtype, splits: int = 4, seed: int = 0):
    """(partials, attended) of the Pallas attention kernel split over a 256-slot cache in chunks
    of 16, at SmolLM2's heads: the real partials o_proj reads in a decode step."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    starts = rng.integers(0, 200, batch)
    positions = jnp.asarray(starts[:, None] + np.arange(length), jnp.int32)
    cache = (batch, 256, KV_HEADS, HEAD_DIM)
    inputs = (normal(batch, length, (HEADS + 2 * KV_HEADS) * HEAD_DIM), positions, normal(*cache), normal(*cache))
    kw = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
              inv_freq=layers.rope_inverse_frequencies(HEAD_DIM, 10000.0, None), implementation="pallas",
              tiling=decode_attention.Tiling(block_s=16, splits=splits))
    parts, _, _ = jax.jit(lambda *i: decode_attention.attend(*i, **kw, merge=False))(*inputs)
    attended, _, _ = jax.jit(lambda *i: decode_attention.attend(*i, **kw))(*inputs)
    return parts, attended


@pytest.mark.parametrize("parts,batch,length,dtype", [(4, 1, 7, jnp.bfloat16), (2, 3, 5, jnp.float32),
                                                      (3, 2, 17, jnp.bfloat16)])
def test_the_combine_kernel_is_the_reference_merge(parts, batch, length, dtype):
    """Merged in the kernel's tiles (rows and features past the arrays masked) or in plain jnp:
    the same values (float32: to a rounding, as XLA may contract a multiply-add in one program and
    not the other), a neutral part changing nothing."""
    state = random_partials(parts, batch, length)
    got = jax.jit(lambda p: partials.combine(p, dtype))(state)
    want = partials.merge_reference(state, dtype)
    assert got.shape == (batch, length, HEADS, HEAD_DIM) and got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=1e-6 if dtype == jnp.float32 else 2 ** -8)
    assert np.isfinite(np.asarray(got, np.float32)).all()


def test_the_reference_merge_is_a_softmax_over_all_parts():
    """Two parts of one query's scores, merged: the softmax-weighted values of all of them."""
    rng = np.random.default_rng(3)
    scores, values = rng.standard_normal(10), rng.standard_normal((10, 4))
    state = []
    for part in (slice(0, 6), slice(6, 10)):
        top = scores[part].max()
        weights = np.exp(scores[part] - top)
        state.append((top, weights.sum(), weights @ values[part]))
    outputs, maxima, sums = (np.asarray([s[i] for s in state], np.float32) for i in (2, 0, 1))
    merged = partials.merge_reference(partials.Partials(jnp.asarray(outputs)[:, None, None, None],
                                                        jnp.asarray(maxima)[:, None, None, None],
                                                        jnp.asarray(sums)[:, None, None, None]), jnp.float32)
    weights = np.exp(scores - scores.max())
    np.testing.assert_allclose(np.asarray(merged)[0, 0, 0], weights @ values / weights.sum(), rtol=1e-5)


@pytest.mark.parametrize("batch,length,dtype", [(1, 7, jnp.bfloat16), (1, 1, jnp.float32), (4, 5, jnp.bfloat16)])
def test_o_proj_over_the_partials_is_o_proj_after_the_combine(batch, length, dtype):
    """merged_linear_residual (one kernel) equals linear_residual after the combine kernel, bit for
    bit, on the attention kernel's own partials (both merge through `merged_tile`; the linear
    summing K in the fused kernel's head-sized chunks), and stays within a rounding of its XLA
    reference."""
    parts, attended = split_attention(batch, length, dtype)
    rng = np.random.default_rng(1)
    weight = jnp.asarray(rng.standard_normal((HEADS * HEAD_DIM, HIDDEN)) / 24, dtype)
    residual = jnp.asarray(rng.standard_normal((batch, length, HIDDEN)), dtype)
    flat = attended.reshape(batch, length, -1)
    fused = jax.jit(lambda p, w, r: fused_linear.merged_linear_residual(p, w, r, implementation="pallas"))
    # the same chunks of K (one head each) as the fused kernel's loop, so the same float32 sums
    two_kernels = jax.jit(lambda a, w, r: fused_linear.linear_residual(
        a, w, r, implementation="pallas", tiling=fused_linear.Tiling(block_k=HEAD_DIM)))
    got = np.asarray(fused(parts, weight, residual), np.float32)
    np.testing.assert_array_equal(got, np.asarray(two_kernels(flat, weight, residual), np.float32))
    reference = fused_linear.merged_linear_residual(parts, weight, residual, implementation="xla")
    # float32: summation order; bf16: a rounding of the largest output (2^-8 relative)
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2
    assert np.abs(got - np.asarray(reference, np.float32)).max() <= tolerance * np.abs(got).max()


def test_bad_operands_say_what_is_wrong():
    with pytest.raises(ValueError, match="head_dim must be a power of two >= 16"):
        fused_linear.merged_linear_residual(random_partials(2, 1, 3, head_dim=8), jnp.zeros((HEADS * 8, HIDDEN)),
                                            jnp.zeros((1, 3, HIDDEN)), implementation="pallas")
    parts = random_partials(2, 1, 3)
    weight, residual = jnp.zeros((HEADS * HEAD_DIM, HIDDEN)), jnp.zeros((1, 3, HIDDEN))
    with pytest.raises(ValueError, match="does not take 9 heads of 64"):
        fused_linear.merged_linear_residual(parts, weight[1:], residual)
    with pytest.raises(ValueError, match="residual shape"):
        fused_linear.merged_linear_residual(parts, weight, residual[:, :2])
    with pytest.raises(ValueError, match="unknown implementation"):
        fused_linear.merged_linear_residual(parts, weight, residual, implementation="cuda")


@pytest.mark.parametrize("rows", [1, 7, 20])
def test_o_proj_over_the_partials_lowers_for_cuda(rows):
    """Triton's rules (power-of-two tensors, dot operands >= 16), checked while lowering: one kernel."""
    shape = lambda *dims, dtype=jnp.float32: jax.ShapeDtypeStruct(dims, dtype)
    parts = partials.Partials(shape(4, 1, rows, HEADS, HEAD_DIM), shape(4, 1, rows, HEADS), shape(4, 1, rows, HEADS))
    call = lambda p, w, r: fused_linear.merged_linear_residual(p, w, r, implementation="pallas", interpret=False)
    lowered = export.export(jax.jit(call), platforms=["cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(
        parts, shape(HEADS * HEAD_DIM, HIDDEN, dtype=jnp.bfloat16), shape(1, rows, HIDDEN, dtype=jnp.bfloat16))
    assert lowered.mlir_module().count("__gpu$xla.gpu.triton") == 1
