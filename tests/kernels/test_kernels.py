"""Fused decode kernels (`kernels.fused_linear`): Pallas against the XLA reference, and in the model.

On CPU the Pallas kernels run in interpret mode (the same kernel code, evaluated by XLA:CPU);
lowering them for CUDA checks, without a GPU, that Triton accepts their shapes.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export

from eagle_jax.serve import config as config_lib
from eagle_jax.serve import engine as engine_lib
from eagle_jax.model import config as model_config
from eagle_jax.model import float32_logits
from eagle_jax.model import layers
from eagle_jax.decode import tree as tree_lib
from eagle_jax.kernels import decode_attention
from eagle_jax.kernels import fused_linear
from tests.benchmarks import script
from tests.kernels import kernel_calls

EPS = 1e-5
# SmolLM2-135M: hidden 576, qkv_proj 960 (9 + 2 x 3 heads of 64), intermediate 1536.
REAL = dict(hidden=576, qkv=960, intermediate=1536)
# Nothing divides the blocks: masked edges in K, N and (with 17 rows) a second block of rows.
RAGGED = dict(hidden=40, qkv=24, intermediate=20)


def operands(shape: dict, rows: int, dtype, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    hidden, qkv, intermediate = shape["hidden"], shape["qkv"], shape["intermediate"]
    normal = lambda *s, scale=1.0: jnp.asarray(scale * rng.standard_normal(s), dtype)
    return dict(x=normal(rows, hidden), norm=jnp.asarray(1 + 0.1 * rng.standard_normal(hidden), dtype),
                qkv=normal(hidden, qkv, scale=hidden ** -0.5),
                gate_up=normal(hidden, 2 * intermediate, scale=hidden ** -0.5),
                down=normal(intermediate, hidden, scale=intermediate ** -0.5), hidden=normal(rows, intermediate))


def within(actual, expected, tolerance: float) -> bool:
    """|actual - expected| <= tolerance x the largest |expected| (bf16: one rounding step of the
    largest output, 2^-8 relative, at most)."""
    actual, expected = np.asarray(actual, np.float32), np.asarray(expected, np.float32)
    return np.abs(actual - expected).max() <= tolerance * np.abs(expected).max()


def all_kernels(o: dict, implementation: str, interpret=None) -> list[jax.Array]:
    kw = dict(implementation=implementation, interpret=interpret)
    return [fused_linear.norm_linear(o["x"], o["norm"], EPS, o["qkv"], **kw),
            fused_linear.norm_gate_up(o["x"], o["norm"], EPS, o["gate_up"], **kw),
            fused_linear.linear_residual(o["hidden"], o["down"], o["x"], **kw)]


@pytest.mark.parametrize("shape,rows,dtype,tolerance", [
    (REAL, 1, jnp.float32, 1e-5), (REAL, 3, jnp.float32, 1e-5), (REAL, 8, jnp.float32, 1e-5),
    (REAL, 1, jnp.bfloat16, 2e-2), (REAL, 8, jnp.bfloat16, 2e-2),
    (RAGGED, 3, jnp.float32, 1e-5), (RAGGED, 17, jnp.float32, 1e-5), (RAGGED, 40, jnp.float32, 1e-5),
], ids=["real-1", "real-3", "real-8", "real-1-bf16", "real-8-bf16", "ragged-3", "ragged-17", "ragged-40"])
def test_pallas_matches_xla(shape, rows, dtype, tolerance):
    o = operands(shape, rows, dtype)
    for expected, actual in zip(all_kernels(o, "xla"), all_kernels(o, "pallas")):
        assert actual.shape == expected.shape and actual.dtype == dtype
        assert within(actual, expected, tolerance)


@pytest.mark.parametrize("shape,rows,dtype,tolerance", [
    (REAL, 1, jnp.float32, 1e-5), (REAL, 8, jnp.bfloat16, 2e-2), (RAGGED, 17, jnp.float32, 1e-5),
], ids=["real-1", "real-8-bf16", "ragged-17"])
def test_split_k_parts_are_summed_by_the_next_kernel(shape, rows, dtype, tolerance):
    """down_proj as partial sums, added to the residual by the next layer's first kernel."""
    o = operands(shape, rows, dtype)
    close = lambda actual, expected: within(actual, expected, tolerance)
    parts = fused_linear.linear_parts(o["hidden"], o["down"], implementation="pallas")
    assert parts.shape == (-(-shape["intermediate"] // fused_linear.Tiling.block_k), rows, shape["hidden"])
    assert parts.dtype == jnp.float32 and fused_linear.linear_parts(o["hidden"], o["down"]).shape[0] == 1
    residual = fused_linear.linear_residual(o["hidden"], o["down"], o["x"])
    assert close(fused_linear.add_parts(o["x"], parts), residual)
    for fused, weight in ((fused_linear.norm_linear, o["qkv"]), (fused_linear.norm_gate_up, o["gate_up"])):
        expected = fused(residual, o["norm"], EPS, weight)
        out, summed = fused(o["x"], o["norm"], EPS, weight, parts=parts, implementation="pallas")
        assert summed.shape == o["x"].shape and summed.dtype == dtype and out.dtype == dtype
        assert close(summed, residual) and close(out, expected)
        # The same parts give the reference's result: the kernel adds them as `add_parts` does.
        reference, reference_summed = fused(o["x"], o["norm"], EPS, weight, parts=parts)
        assert close(out, reference) and close(summed, reference_summed)
    with pytest.raises(ValueError, match="partial sums"):
        fused_linear.norm_linear(o["x"], o["norm"], EPS, o["qkv"], parts=parts.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="partial sums"):
        fused_linear.norm_gate_up(o["x"], o["norm"], EPS, o["gate_up"], parts=parts[:, :, :-1])


@pytest.mark.parametrize("widths,rows,dtype,tolerance", [
    ((576, 576), 1, jnp.bfloat16, 2e-2), ((576, 576), 3, jnp.float32, 1e-5), ((40, 24), 17, jnp.float32, 1e-5),
], ids=["eagle3-midlayer-1-bf16", "eagle3-midlayer-3", "ragged-17"])
def test_norm_pair_linear_norms_each_input_as_its_own_layer(widths, rows, dtype, tolerance):
    """EAGLE-3's midlayer q/k/v: [rmsnorm(a); rmsnorm(b)] @ W, a chunk of K holding the end of a and
    the start of b (576 is not a multiple of 256), against the layers' own norms and matmul."""
    rng = np.random.default_rng(7)
    (width_a, width_b), out = widths, 48
    a, b = (jnp.asarray(scale * rng.standard_normal((rows, w)), dtype) for w, scale in ((width_a, 1.0), (width_b, 4.0)))
    norms = [layers.RMSNorm(w, EPS, dtype=dtype, param_dtype=dtype) for w in widths]
    for norm in norms:
        norm.weight[...] = jnp.asarray(1 + 0.1 * rng.standard_normal(norm.weight.shape), dtype)
    weight = jnp.asarray(rng.standard_normal((width_a + width_b, out)) / np.sqrt(width_a + width_b), dtype)
    want = jnp.concatenate([norms[0](a), norms[1](b)], axis=-1) @ weight
    args = (a, norms[0].weight[...], b, norms[1].weight[...], EPS, weight)
    reference = fused_linear.norm_pair_linear(*args)
    np.testing.assert_array_equal(np.asarray(reference, np.float32), np.asarray(want, np.float32))
    got = fused_linear.norm_pair_linear(*args, implementation="pallas")
    assert got.shape == (rows, out) and got.dtype == dtype and within(got, reference, tolerance)
    with pytest.raises(ValueError, match="differ in their rows or dtype"):
        fused_linear.norm_pair_linear(a, args[1], b[:1] if rows > 1 else b.astype(jnp.float16), args[3], EPS, weight)
    with pytest.raises(ValueError, match="weight shape"):
        fused_linear.norm_pair_linear(*args[:5], weight[1:])


@pytest.mark.parametrize("shape,rows", [(REAL, 1), (RAGGED, 17)], ids=["real-1", "ragged-17"])
def test_norm_linear_keeps_float32_logits_unrounded(shape, rows):
    """out_dtype=float32 (a draft head's final norm and lm_head): bf16 inputs, the float32
    accumulation stored as it is, what `float32_logits` of the normed input gives."""
    o = operands(shape, rows, jnp.bfloat16)
    norm = layers.RMSNorm(shape["hidden"], EPS, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    norm.weight[...] = o["norm"]
    want = np.asarray(float32_logits.float32_logits(norm(o["x"]), o["qkv"]))
    for implementation in ("xla", "pallas"):
        got = fused_linear.norm_linear(o["x"], o["norm"], EPS, o["qkv"], implementation=implementation,
                                       out_dtype=jnp.float32)
        assert got.dtype == jnp.float32 and got.shape == want.shape
        # XLA's reference is the same computation; the kernel differs by summation order only.
        assert within(got, want, 0 if implementation == "xla" else 1e-5)
    bf16 = fused_linear.norm_linear(o["x"], o["norm"], EPS, o["qkv"], implementation="pallas")
    assert bf16.dtype == jnp.bfloat16 and not np.array_equal(np.asarray(bf16, np.float32), want)


@pytest.mark.parametrize("shape,rows", [(REAL, 1), (RAGGED, 17)], ids=["real-1", "ragged-17"])
def test_norm_linear_reads_an_int8_weight_with_column_scales(shape, rows):
    """An output layer stored as int8 with one float32 scale a column (as `int8_weights` stores an
    lm_head): the kernel gives the float32 logits of the normed input times the widened weight,
    which the XLA reference computes, within float32 summation order."""
    o = operands(shape, rows, jnp.bfloat16)
    rng = np.random.default_rng(1)
    weight = jnp.asarray(rng.integers(-127, 128, (shape["hidden"], shape["qkv"])), jnp.int8)
    scale = jnp.asarray(rng.uniform(1e-3, 1e-2, shape["qkv"]), jnp.float32)
    normed = fused_linear.rms_norm(o["x"], o["norm"], EPS).astype(jnp.float32)
    want = np.asarray(normed @ (weight.astype(jnp.float32) * scale[None, :]))
    for implementation in ("xla", "pallas"):
        got = fused_linear.norm_linear(o["x"], o["norm"], EPS, weight, weight_scale=scale,
                                       implementation=implementation, out_dtype=jnp.float32)
        assert got.dtype == jnp.float32 and got.shape == want.shape
        assert within(got, want, 1e-5)
    bf16 = fused_linear.norm_linear(o["x"], o["norm"], EPS, weight, weight_scale=scale, implementation="pallas")
    assert bf16.dtype == jnp.bfloat16 and within(bf16, want, 2 ** -8)


def test_int8_weights_come_with_their_scales():
    x, norm = jnp.ones((1, 4), jnp.bfloat16), jnp.ones(4, jnp.bfloat16)
    int8, scale = jnp.ones((4, 2), jnp.int8), jnp.ones(2, jnp.float32)
    with pytest.raises(ValueError, match="needs its weight_scale"):
        fused_linear.norm_linear(x, norm, EPS, int8)
    with pytest.raises(ValueError, match="only an int8 weight takes one"):
        fused_linear.norm_linear(x, norm, EPS, int8.astype(jnp.bfloat16), weight_scale=scale)
    with pytest.raises(ValueError, match="one scale an output column"):
        fused_linear.norm_linear(x, norm, EPS, int8, weight_scale=jnp.ones(3, jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_xla_reference_is_what_the_layers_compute(dtype):
    o = operands(RAGGED, 3, dtype)
    norm = layers.RMSNorm(RAGGED["hidden"], EPS, dtype=dtype, param_dtype=dtype)
    norm.weight[...] = o["norm"]
    linear = lambda weight: nnx.Linear(*weight.shape, use_bias=False, dtype=dtype, param_dtype=dtype,
                                       kernel_init=lambda *_: weight, rngs=nnx.Rngs(0))
    gate, up = jnp.split(linear(o["gate_up"])(norm(o["x"])), 2, axis=-1)
    expected = [linear(o["qkv"])(norm(o["x"])), jax.nn.silu(gate) * up, o["x"] + linear(o["down"])(o["hidden"])]
    split_k = fused_linear.add_parts(o["x"], fused_linear.linear_parts(o["hidden"], o["down"]))
    for want, got in zip([*expected, expected[-1]], [*all_kernels(o, "xla"), split_k]):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


@pytest.mark.parametrize("dtype,rows", [(jnp.float32, 1), (jnp.bfloat16, 1), (jnp.bfloat16, 17)])
def test_pallas_kernels_lower_for_cuda(dtype, rows):
    """Triton's rules (power-of-two tensors, dot operands >= 16) are checked while lowering: the
    target layers' kernels, the split-K pair, the draft head's two-input q/k/v and float32 logits."""
    o = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), operands(REAL, rows, dtype))
    o["int8"] = jax.ShapeDtypeStruct(o["gate_up"].shape, jnp.int8)  # an lm_head stored as int8
    o["scale"] = jax.ShapeDtypeStruct(o["gate_up"].shape[1:], jnp.float32)

    def split_k(o):  # down_proj's parts, summed by the next norm_linear and norm_gate_up
        kw = dict(implementation="pallas", interpret=False)
        parts = fused_linear.linear_parts(o["hidden"], o["down"], **kw)
        return [fused(o["x"], o["norm"], EPS, weight, parts=parts, **kw)
                for fused, weight in ((fused_linear.norm_linear, o["qkv"]), (fused_linear.norm_gate_up, o["gate_up"]))]

    def draft_head(o):  # EAGLE-3's midlayer q/k/v over two normed inputs, its float32 logits (bf16 and int8 weights)
        kw = dict(implementation="pallas", interpret=False)
        return [fused_linear.norm_pair_linear(o["x"], o["norm"], o["x"], o["norm"], EPS,
                                              jnp.concatenate([o["qkv"], o["qkv"]]), **kw),
                fused_linear.norm_linear(o["x"], o["norm"], EPS, o["gate_up"], out_dtype=jnp.float32, **kw),
                fused_linear.norm_linear(o["x"], o["norm"], EPS, o["int8"], weight_scale=o["scale"],
                                         out_dtype=jnp.float32, **kw)]

    lowered = export.export(jax.jit(lambda o: (all_kernels(o, "pallas", interpret=False), split_k(o), draft_head(o))),
                            platforms=["cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(o)
    assert lowered.mlir_module().count("__gpu$xla.gpu.triton") == 9


def test_tiling_needs_powers_of_two_of_at_least_16():
    with pytest.raises(ValueError, match="block_n"):
        fused_linear.Tiling(block_n=24)
    with pytest.raises(ValueError, match="block_m"):
        fused_linear.Tiling(block_m=8)
    with pytest.raises(ValueError, match="implementation"):
        fused_linear.norm_linear(jnp.ones((1, 4)), jnp.ones(4), EPS, jnp.ones((4, 2)), implementation="triton")


def test_rows_take_one_block_up_to_max_rows():
    assert [fused_linear.row_block(m) for m in (1, 16, 17, 32, 33, 100)] == [16, 16, 32, 32, 32, 32]


def test_only_small_bias_free_inputs_use_the_kernels(random_target):
    layer = random_target(num_layers=1).layers[0]
    linears = (layer.self_attn.qkv_proj, layer.mlp.down_proj)
    decode, prefill = jnp.ones((2, 16, 32)), jnp.ones((2, 17, 32))  # 32 and 34 rows
    assert layers.uses_decode_kernels("pallas", decode, *linears)
    assert layers.uses_decode_kernels("pallas_linear", decode, *linears)
    assert not layers.uses_decode_kernels("xla", decode, *linears)
    assert not layers.uses_decode_kernels("pallas", prefill, *linears)
    assert not layers.uses_decode_kernels("pallas", decode.astype(jnp.bfloat16), *linears)
    biased = random_target(num_layers=1, attention_bias=True).layers[0]
    assert not layers.uses_decode_kernels("pallas", decode, biased.self_attn.qkv_proj)


def test_kernel_settings_are_checked(random_target):
    target = random_target(num_layers=2)
    assert layers.Kernels() == layers.XLA and layers.XLA.decode_kernels == "xla"
    with pytest.raises(ValueError, match="decode_kernels"):
        layers.Kernels("triton")
    with pytest.raises(config_lib.InputError, match="decode_kernels"):
        engine_lib.Engine(target, config=config_lib.EngineConfig(decode_kernels="cuda"))


def test_auto_picks_pallas_only_where_it_measured_faster(random_target):
    choose = config_lib.choose_decode_kernels
    assert choose("gpu", 1) == "pallas"  # plain, chains and trees (batch 1), as measured
    assert choose("gpu", 2) == "xla"  # one device only
    assert choose("cpu", 1) == "xla"  # interpret mode is slow
    target = random_target(num_layers=1)
    assert engine_lib.Engine(target).kernels == layers.XLA  # this CPU
    pallas = engine_lib.Engine(target, config=config_lib.EngineConfig(decode_kernels="pallas"))
    assert pallas.kernels == layers.Kernels("pallas") and pallas.options().decode_kernels == "pallas"


def test_decode_step_runs_the_kernels(random_target):
    target = random_target(num_layers=1)
    fused, linear_only = layers.Kernels("pallas"), layers.Kernels("pallas_linear")

    def forward(kernels, batch, length, start=0):
        cache = target.init_cache(batch, 64)
        positions = jnp.broadcast_to(start + jnp.arange(length, dtype=jnp.int32), (batch, length))
        tokens = jnp.asarray(np.random.default_rng(batch).integers(0, 100, (batch, length)), jnp.int32)
        call = lambda: target(tokens, positions, cache, kernels=kernels)
        return lambda: call()[0], jax.make_jaxpr(call)()

    # norm + qkv, attention (up to 8 rows split over the cache: two calls), o_proj, norm + gate_up,
    # down_proj's parts (summed by the next layer's first kernel, in XLA after the last layer)
    assert kernel_calls.pallas_calls(forward(fused, 1, 4)[1]) == 6
    assert kernel_calls.pallas_calls(forward(fused, 8, 4)[1]) == 6
    assert kernel_calls.pallas_calls(forward(fused, 9, 1)[1]) == 5
    assert kernel_calls.pallas_calls(forward(fused, 1, 33)[1]) == 0
    # More rows than the linear kernels take (a batched decode step): the attention kernel alone,
    # between XLA's matmuls, computing what XLA's attention does.
    run, jaxpr = forward(fused, 40, 1, start=5)
    assert kernel_calls.pallas_calls(jaxpr) == 1
    np.testing.assert_allclose(run(), forward(layers.XLA, 40, 1, start=5)[0](), rtol=2e-5, atol=2e-5)
    # "pallas_linear": the four fused linears around XLA's attention, none in a batched step.
    run, jaxpr = forward(linear_only, 1, 4, start=3)
    assert kernel_calls.pallas_calls(jaxpr) == 4
    np.testing.assert_allclose(run(), forward(layers.XLA, 1, 4, start=3)[0](), rtol=2e-5, atol=2e-5)
    assert kernel_calls.pallas_calls(forward(linear_only, 40, 1, start=5)[1]) == 0


@pytest.fixture(scope="module")
def tokens_by_setting(aligned_target, agreeing_head, random_head, tmp_path_factory):
    """Greedy tokens and acceptance of plain and speculative decoding, per decode_kernels setting.

    The settings share one compile cache; the Pallas engines run after the "xla" ones and count
    their cache hits, which must be none: a setting never loads another's programs.
    """
    target = aligned_target(seed=14, num_layers=2)
    cfg = target.config
    heads = {"eagle": agreeing_head(cfg, 0.3, residual=1.0, seed=1),
             "eagle3": random_head(cfg, "eagle3", seed=4, draft_vocab_size=64, feature_layers=(0, 1, 1))}
    prompts = [np.random.default_rng(length).integers(0, 101, length).tolist() for length in (5, 9)]
    cache_dir = tmp_path_factory.mktemp("compile-cache")
    out = {}
    tree = tree_lib.TreeOptions(2, 3, 6)  # its verify: 7 nodes a row, 14 rows, the attention kernel under its mask
    # EAGLE-1's head runs in the tree (its chain adds nothing the tree and EAGLE-3's chain do not: CI time).
    runs = (("none", None, 0), ("eagle3", heads["eagle3"], 2), ("eagle-tree", heads["eagle"], 0))
    for setting in ("xla", "pallas", "pallas_linear"):
        # "pallas_linear" differs from "pallas" in the target's attention only (the heads' MLP kernels
        # are the same in both): plain and one head cover it.
        for method, head, k in runs if setting != "pallas_linear" else runs[:2]:
            engine = engine_lib.Engine(target, head, config=config_lib.EngineConfig(steps_per_call=4, num_speculative_tokens=k, max_length=64, batch_size=2,
                                       cache_dir=cache_dir, decode_kernels=setting,
                                       tree=tree if method.endswith("tree") else None))
            results = engine.generate(prompts, max_new_tokens=8, ignore_eos=True)
            out[setting, method] = ([r.token_ids for r in results], [r.stats["num_accepted_tokens"] for r in results],
                                    engine.compile_cache.hits)
    return out


@pytest.mark.parametrize("setting, method", [("pallas", "none"), ("pallas", "eagle3"), ("pallas", "eagle-tree"),
                                             ("pallas_linear", "none"), ("pallas_linear", "eagle3")])
def test_pallas_decode_gives_the_same_tokens(tokens_by_setting, method, setting):
    xla_tokens, xla_accepted, _ = tokens_by_setting["xla", method]
    pallas_tokens, pallas_accepted, pallas_hits = tokens_by_setting[setting, method]
    assert pallas_tokens == xla_tokens and pallas_accepted == xla_accepted
    assert pallas_hits == 0


def load_kernel_bench():
    return script("kernels_bench")


def test_kernel_bench_l2_evictor_is_one_named_triton_kernel():
    """--evict-mb's probe: one Triton kernel named evict_l2 (the traced figures leave it out by that
    name), reading the megabytes asked for; asked for on a CPU, a clear error."""
    bench = load_kernel_bench()
    assert bench.l2_evictor(0) is None
    read = bench.l2_evictor(1, interpret=True)
    assert read().shape == (32, bench.EVICT_WIDTH) and float(read().sum()) == 2**20 / 2  # ones: 1 MB of bf16
    buffer = jax.ShapeDtypeStruct((64, bench.EVICT_WIDTH), jnp.bfloat16)
    text = export.export(jax.jit(bench.evict_call(64)), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(buffer).mlir_module()
    assert text.count("__gpu$xla.gpu.triton") == 1 and "evict_l2" in text
    with pytest.raises(SystemExit):
        bench.parse_args(["--evict-mb", "64"])


def test_kernel_bench_runs_without_model_files(tmp_path, tiny_hf_config):
    """benchmarks/kernels_bench.py on CPU (interpret mode): rows for both implementations of each op."""
    bench = load_kernel_bench()
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config()))
    out = tmp_path / "rows.json"
    assert bench.main(["--config", str(tmp_path / "config.json"), "--dtype", "float32", "--ops",
                       "norm_gate_up,draft_lm_head,draft_lm_head_int8,decode_attention,decoder_layer", "--cache-length", "64",
                       "--draft-vocab", "100", "--iterations", "1", "--trace-calls", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["kind"], r["op"], r["implementation"], r.get("attend_length")) for r in rows] == [
        ("kernel_bench", "norm_gate_up", "xla", None), ("kernel_bench", "norm_gate_up", "pallas", None),
        ("kernel_bench", "draft_lm_head", "xla", None), ("kernel_bench", "draft_lm_head", "pallas", None),
        ("kernel_bench", "draft_lm_head_int8", "xla", None), ("kernel_bench", "draft_lm_head_int8", "pallas", None),
        ("kernel_bench", "decode_attention", "xla", None), ("kernel_bench", "decode_attention", "pallas", None),
        ("kernel_bench", "decode_attention", "xla", 32), ("kernel_bench", "decode_attention", "pallas", 32),
        ("kernel_bench", "decoder_layer", "xla", None), ("kernel_bench", "decoder_layer", "pallas", None),
        ("kernel_bench", "decoder_layer", "pallas_linear", None)]
    assert all(r["kernels"] > 0 and r["busy_us"] > 0 and r["wall_us"] > 0 for r in rows)
    # Each rival checked against the XLA row of its case, within float32 rounding.
    assert all((r["max_error"] is None) == (r["implementation"] == "xla") for r in rows)
    assert all(r["max_error"] <= 1e-5 for r in rows if r["max_error"] is not None)
    # No tiling asked for: the one `attend` runs at one row (`Tiling.for_rows`).
    attention = [r["tiling"] for r in rows if r["op"] == "decode_attention" and r["implementation"] == "pallas"]
    assert attention == [vars(decode_attention.Tiling.for_rows(1))] * 2


def test_kernel_bench_times_the_draft_heads_layer_kernels(tmp_path, tiny_hf_config):
    """The head's q/k/v over its two inputs, its wider MLP's first half and its one-row split-K
    down_proj: both implementations, the Pallas ones over the tilings asked, checked against XLA's."""
    bench = load_kernel_bench()
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config()))
    out = tmp_path / "rows.json"
    assert bench.main(["--config", str(tmp_path / "config.json"), "--dtype", "float32", "--ops",
                       "draft_qkv,draft_gate_up,draft_down_parts", "--draft-intermediate", "96", "--block-k", "16,32",
                       "--iterations", "1", "--trace-calls", "1", "--check", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["op"], r["implementation"], r["tiling"]["block_k"] if r["tiling"] else None) for r in rows] == [
        (op, implementation, block_k) for op in ("draft_qkv", "draft_gate_up", "draft_down_parts")
        for implementation, block_k in (("xla", None), ("pallas", 16), ("pallas", 32))]
    assert all(r["max_error"] <= 1e-5 for r in rows if r["max_error"] is not None)


def test_kernel_bench_check_fails_on_a_wrong_kernel(tmp_path, monkeypatch, capsys):
    """--check: exit 0 while every kernel agrees with XLA; a Pallas kernel off by 1 in one output
    value (of outputs of order 1-5) fails the run, naming the op, after the rows are written (the
    XLA rows unchanged: the reference is never what is checked)."""
    bench = load_kernel_bench()
    out = tmp_path / "rows.json"
    argv = ["--dtype", "bfloat16", "--ops", "o_proj_residual,down_proj_residual", "--rows", "1,7", "--check",
            "--iterations", "1", "--trace-calls", "1", "--out", str(out)]
    assert bench.main(argv) == 0
    linear_residual = fused_linear.linear_residual

    def wrong(x, weight, residual, *, implementation="xla", **kw):
        out = linear_residual(x, weight, residual, implementation=implementation, **kw)
        return out.at[..., 0, 0].add(1.0) if implementation == "pallas" else out

    monkeypatch.setattr(fused_linear, "linear_residual", wrong)
    assert bench.main(argv) == 1
    failed = [line for line in capsys.readouterr().err.splitlines() if "CHECK FAILED" in line]
    assert len(failed) == 4 and all(" pallas " in line for line in failed)
    assert {line.split()[3] for line in failed} == {"o_proj_residual", "down_proj_residual"}
    assert len(json.loads(out.read_text())) == 16  # both runs' rows written


def test_kernel_bench_times_the_tree_ops(tmp_path):
    """draft_top_k (one lax.top_k vs two stages) and compact_cache (XLA vs one kernel), on CPU."""
    out = tmp_path / "rows.json"
    assert load_kernel_bench().main(["--dtype", "float32", "--ops", "draft_top_k,compact_cache", "--rows", "4",
                                     "--draft-vocab", "4096", "--cache-length", "32", "--iterations", "1",
                                     "--trace-calls", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["op"], r["implementation"], r["rows"]) for r in rows] == [
        ("draft_top_k", "xla", 4), ("draft_top_k", "two_stage", 4), ("compact_cache", "xla", 4),
        ("compact_cache", "pallas", 4)]
    assert all(r["kernels"] > 0 and r["busy_us"] > 0 for r in rows)


def test_kernel_bench_sweeps_query_rows(tmp_path, tiny_hf_config):
    """--query-rows 16,none: a decode_attention row per bound (None: one program per kv head), on CPU;
    a bound below 1 is refused."""
    bench = load_kernel_bench()
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config()))
    out = tmp_path / "rows.json"
    assert bench.main(["--config", str(tmp_path / "config.json"), "--dtype", "float32", "--ops", "decode_attention",
                       "--tokens", "6", "--query-rows", "4,none", "--cache-length", "64", "--iterations", "1",
                       "--trace-calls", "1", "--out", str(out)]) == 0
    rows = [r for r in json.loads(out.read_text()) if r["implementation"] == "pallas"]
    assert [(r["tokens"], r["tiling"]["query_rows"], r["attend_length"]) for r in rows] == [
        (6, 4, None), (6, None, None), (6, 4, 32), (6, None, 32)]
    with pytest.raises(SystemExit):
        bench.parse_args(["--query-rows", "0"])
    # --tree: the same op over a tree verify's nodes (17: SGLang's 4/5/16), both implementations.
    assert bench.main(["--config", str(tmp_path / "config.json"), "--dtype", "float32", "--ops", "decode_attention",
                       "--tokens", "17", "--tree", "--cache-length", "64", "--iterations", "1", "--trace-calls", "1",
                       "--out", str(out)]) == 0
    trees = [r for r in json.loads(out.read_text()) if r.get("tree")]
    assert [(r["implementation"], r["tokens"]) for r in trees] == [("xla", 17), ("pallas", 17)] * 2
    depths, ancestors = bench.heap_tree(7)
    assert depths.tolist() == [0, 1, 1, 2, 2, 2, 2] and ancestors[6].tolist() == [True, False, True] + [False] * 3 + [True]
    # 64 rows: the attention kernel takes them; the fused linears do not.
    assert bench.parse_args(["--ops", "decode_attention", "--rows", "16,64"]).rows == [16, 64]
    with pytest.raises(SystemExit):
        bench.parse_args(["--ops", "decode_attention,norm_linear", "--rows", "64"])


@pytest.mark.parametrize("tokens", [1, 7, 9])
def test_a_heads_mlp_splits_down_proj_in_short_calls_only(tokens, monkeypatch):
    """`residual_mlp` (a draft head's MLP) runs down_proj split-K in calls of up to
    `HEAD_SPLIT_K_MAX_ROWS` rows (a chain's first draft forward over k + 1 = 7 pairs too), whole
    columns past them, and computes what the unfused MLP does either way."""
    cfg = model_config.LlamaConfig(vocab_size=8, hidden_size=64, intermediate_size=768, num_layers=1, num_heads=4,
                                 num_kv_heads=2, head_dim=16)
    norm, mlp = layers.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), layers.MLP(cfg, rngs=nnx.Rngs(5))
    x = jax.random.normal(jax.random.key(2), (1, tokens, cfg.hidden_size))
    calls = []
    for name in ("linear_parts", "linear_residual"):
        kernel = getattr(fused_linear, name)
        monkeypatch.setattr(fused_linear, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw))
    fused = layers.residual_mlp(x, norm, mlp, "pallas_linear")
    assert calls == (["linear_parts"] if tokens <= layers.HEAD_SPLIT_K_MAX_ROWS else ["linear_residual"])
    assert within(fused, layers.residual_mlp(x, norm, mlp, "xla"), 1e-5)


@pytest.mark.parametrize("tokens", [1, 7], ids=["decode", "verify"])
def test_down_proj_splits_in_one_row_calls_only(tokens):
    """A one-row call hands down_proj's partial sums on (`layers.PendingResidual`); a k = 6 verify's
    7 rows take whole columns (`layers.SPLIT_K_MAX_ROWS`). Either way the layer computes what the
    unfused layer does."""
    cfg = model_config.LlamaConfig(vocab_size=8, hidden_size=64, intermediate_size=320, num_layers=1, num_heads=4,
                                 num_kv_heads=2, head_dim=16)
    layer = layers.DecoderLayer(cfg, rngs=nnx.Rngs(3))
    x = jax.random.normal(jax.random.key(0), (1, tokens, cfg.hidden_size))
    cache = jax.random.normal(jax.random.key(1), (1, 32, cfg.num_kv_heads, cfg.head_dim))
    positions = 20 + jnp.arange(tokens)[None]
    run = lambda kernels, pending: layer(x, positions, cache, cache, kernels=layers.Kernels(kernels), pending=pending)
    fused, _, _ = run("pallas_linear", True)
    assert isinstance(fused, layers.PendingResidual) == (tokens <= layers.SPLIT_K_MAX_ROWS)
    expected, keys, values = run("xla", False)
    assert within(layers.summed(fused), expected, 1e-5)
    unpended, fused_keys, fused_values = run("pallas_linear", False)
    assert not isinstance(unpended, layers.PendingResidual) and within(unpended, expected, 1e-5)
    assert within(fused_keys, keys, 1e-5) and within(fused_values, values, 1e-5)
