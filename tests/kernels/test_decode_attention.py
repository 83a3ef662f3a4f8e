"""Decode attention (`kernels.decode_attention`, its kernels `kernels.decode_attention_pallas`): Pallas
against the XLA reference, and in the model.

On CPU the kernel runs in Pallas interpret mode; lowering it for CUDA checks, without a GPU, that
the decoder layer's program holds five Triton calls (six with the cache split over programs) and
that the attention call updates the caches in place.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export

from eagle_jax.model import attention_ops
from eagle_jax.model import config as config_lib
from eagle_jax.model import eagle
from eagle_jax.serve import config as engine_config
from eagle_jax.serve import engine as engine_lib
from eagle_jax.model import layers
from eagle_jax.model import rotary
from eagle_jax.serve import device_calls
from eagle_jax.decode import tree as tree_lib
from eagle_jax.kernels import decode_attention
from eagle_jax.kernels import decode_attention_pallas
from tests.kernels import kernel_calls

# SmolLM2-135M's attention: 9 query heads, 3 kv heads (groups of 3), head dim 64.
REAL = dict(num_heads=9, num_kv_heads=3, head_dim=64)
# One kv head for 4 query heads, and a head dim below Triton's 16 (padded and masked).
NARROW = dict(num_heads=4, num_kv_heads=1, head_dim=8)
INV_FREQ = {h: rotary.rope_inverse_frequencies(h, 10000.0, None) for h in (8, 64)}


def operands(heads: dict, batch: int, length: int, cache_length: int, starts, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    width = (heads["num_heads"] + 2 * heads["num_kv_heads"]) * heads["head_dim"]
    cache_shape = (batch, cache_length, heads["num_kv_heads"], heads["head_dim"])
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dtype)
    positions = jnp.asarray(np.asarray(starts)[:, None] + np.arange(length), jnp.int32)
    return normal(batch, length, width), positions, normal(*cache_shape), normal(*cache_shape)


def random_trees(batch: int, length: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(depths [B, T], ancestors [B, T, T] bool, itself included) of random trees of T nodes whose
    node 0 is the root and whose parents precede their children, as `tree.Tree` lays them out."""
    rng = np.random.default_rng(seed)
    parents = [[0] + [rng.integers(0, node) for node in range(1, length)] for _ in range(batch)]
    ancestors = np.asarray(tree_lib.ancestor_matrix(jnp.asarray(parents, jnp.int32), length))
    return ancestors.sum(axis=2).astype(np.int32) - 1, ancestors


def run(implementation: str, heads: dict, inputs, attend_length=None, tiling=decode_attention.Tiling(),
        new_visible=None):
    kw = dict(heads, inv_freq=INV_FREQ[heads["head_dim"]], attend_length=attend_length, implementation=implementation,
              tiling=tiling)
    return jax.jit(lambda *i: decode_attention.attend(*i[:4], **kw, new_visible=i[4]))(*inputs, new_visible)


def assert_pallas_matches_xla(heads, length, cache_length, starts, attend_length, dtype, tiling, tree_seed=None):
    """Pallas against XLA; with tree_seed, the T new tokens are a random tree's nodes (`new_visible`)."""
    inputs = operands(heads, len(starts), length, cache_length, starts, dtype)
    new_visible = None
    if tree_seed is not None:
        depths, new_visible = random_trees(len(starts), length, tree_seed)
        inputs = (inputs[0], jnp.asarray(np.asarray(starts)[:, None] + depths), *inputs[2:])
        new_visible = jnp.asarray(new_visible)
    want, want_keys, want_values = run("xla", heads, inputs, attend_length, new_visible=new_visible)
    got, keys, values = run("pallas", heads, inputs, attend_length, tiling, new_visible)
    assert got.shape == want.shape == (len(starts), length, heads["num_heads"], heads["head_dim"])
    assert got.dtype == dtype
    want, got = np.asarray(want, np.float32), np.asarray(got, np.float32)
    # float32: summation order only; bf16: the probabilities are rounded before or after normalising
    assert np.abs(got - want).max() <= (1e-5 if dtype == jnp.float32 else 2e-2) * np.abs(want).max()
    np.testing.assert_array_equal(np.asarray(values, np.float32), np.asarray(want_values, np.float32))
    # Keys are rotated in float32 by another program than XLA's fusion, which may contract
    # x cos + y sin into a fused multiply-add: the new rows agree to a rounding, the rest exactly.
    keys, want_keys = np.asarray(keys, np.float32), np.asarray(want_keys, np.float32)
    new = np.zeros(keys.shape[:2], bool)
    for row, start in enumerate(starts):
        new[row, start:start + length] = True
    np.testing.assert_array_equal(keys[~new], want_keys[~new])
    np.testing.assert_allclose(keys[new], want_keys[new], rtol=1e-6 if dtype == jnp.float32 else 2 ** -7, atol=1e-6)


@pytest.mark.parametrize("heads,length,cache_length,starts,attend_length,dtype", [
    (REAL, 1, 128, [5], None, jnp.float32),  # near the cache start: a part of one chunk
    (REAL, 3, 256, [200, 131], None, jnp.float32),  # deep: several chunks, rows of other lengths
    (REAL, 6, 256, [90, 0], 128, jnp.float32),  # attend_length < S; a row with no older slots
    (REAL, 1, 256, [190, 67], None, jnp.bfloat16),
    (REAL, 6, 128, [100], 112, jnp.bfloat16),
    (NARROW, 16, 128, [37], None, jnp.float32),  # 16 tokens x 4 heads: 64 query rows
], ids=["real-1", "real-3-deep", "real-6-attend", "real-1-bf16", "real-6-bf16", "narrow-16"])
def test_pallas_matches_xla(heads, length, cache_length, starts, attend_length, dtype):
    assert_pallas_matches_xla(heads, length, cache_length, starts, attend_length, dtype, decode_attention.Tiling())


# The split kernel with chunks of 16 slots, so that a part holds several or none.
@pytest.mark.parametrize("heads,length,cache_length,starts,attend_length,dtype,splits", [
    (REAL, 1, 256, [190, 67], None, jnp.bfloat16, 2),  # deep: 12 and 5 chunks
    (REAL, 1, 128, [5], None, jnp.float32, 4),  # near the start: one part of one chunk, three empty
    (REAL, 6, 256, [90, 0], 128, jnp.float32, 4),  # attend_length < S; a row with no older slots
    (REAL, 6, 128, [100], 112, jnp.bfloat16, 2),
], ids=["real-1-bf16-p2", "real-1-near-p4", "real-6-attend-p4", "real-6-bf16-p2"])
def test_split_matches_xla(heads, length, cache_length, starts, attend_length, dtype, splits):
    tiling = decode_attention.Tiling(block_s=16, splits=splits)
    assert_pallas_matches_xla(heads, length, cache_length, starts, attend_length, dtype, tiling)


def test_a_split_wider_than_the_chunks_leaves_neutral_partials():
    """6 parts (not a power of two) of 3 and 1 chunks of 16 slots, 64 padded query rows of head
    dim 8: the parts with no chunks (but part 0, which folds the new tokens) write max
    MASK_VALUE, sum 0 and output 0, and the combine still matches XLA."""
    tiling, starts, length, splits = decode_attention.Tiling(block_s=16, splits=6), [37, 2], 16, 6
    qkv, positions, keys, values = operands(NARROW, 2, length, 128, starts, jnp.float32)
    heads = qkv.reshape(2, length, -1, NARROW["head_dim"])

    @jax.jit
    def split(heads, positions, keys, values):
        partials = decode_attention_pallas.attention_call(heads, positions, keys, values, NARROW["num_heads"],
                                                          INV_FREQ[8], 128, tiling, True)
        outputs, _, _, maxima, sums = partials
        attended = decode_attention_pallas.combine_call(outputs, maxima, sums, (2, length), NARROW["num_heads"],
                                                        NARROW["num_kv_heads"], 8, jnp.float32, True, tiling)
        return attended, partials

    attended, (outputs, _, _, maxima, sums) = split(heads, positions, keys, values)
    want, _, _ = run("xla", NARROW, (qkv, positions, keys, values))
    np.testing.assert_allclose(np.asarray(attended), np.asarray(want), atol=1e-5 * np.abs(np.asarray(want)).max())
    for row, start in enumerate(starts):
        chunks = -(-start // tiling.block_s)
        empty = [p for p in range(1, splits) if p * chunks // splits == (p + 1) * chunks // splits]
        assert len(empty) == splits - 1 - chunks  # and part 0's range: fewer chunks than parts leave it none
        assert np.all(np.asarray(maxima)[row, :, empty] == attention_ops.MASK_VALUE)
        assert not np.any(np.asarray(sums)[row, :, empty]) and not np.any(np.asarray(outputs)[row, :, empty])
    assert np.isfinite(np.asarray(outputs)).all() and np.isfinite(np.asarray(sums)).all()


@pytest.mark.parametrize("length,group,query_rows,want", [
    (1, 3, 16, (1, 1)), (5, 3, 16, (5, 1)), (6, 3, 16, (3, 2)), (7, 3, 16, (4, 2)), (16, 3, 16, (4, 4)),
    (11, 3, 16, (4, 3)), (16, 4, 4, (1, 16)), (3, 32, 16, (1, 3)), (16, 3, None, (16, 1)),
])
def test_token_blocks_hold_at_most_query_rows_and_none_is_empty(length, group, query_rows, want):
    """k = 5's verify (6 tokens of G = 3 heads: 18 rows) takes two blocks of 9; a group wider
    than query_rows gets one token a block."""
    per_block, blocks = decode_attention.Tiling(query_rows=query_rows).token_blocks(length, group)
    assert (per_block, blocks) == want
    assert (blocks - 1) * per_block < length <= blocks * per_block


# Token blocks of the query rows: the default (16 rows) splits k = 5's 18 rows in two; None is the
# one-program kernel; 4 rows of NARROW's G = 4 give one token a program, with the cache split too.
@pytest.mark.parametrize("heads,length,starts,attend_length,tiling", [
    (REAL, 7, [90, 0], 128, decode_attention.Tiling(block_s=16)),
    (REAL, 6, [100, 37], None, decode_attention.Tiling(block_s=16, query_rows=None)),
    (NARROW, 5, [60, 3], 112, decode_attention.Tiling(block_s=16, query_rows=4, splits=3)),
    (REAL, 11, [45], None, decode_attention.Tiling(block_s=16, query_rows=7, splits=2)),
], ids=["real-7-default", "real-6-unsplit", "narrow-5-one-token-split-cache", "real-11-three-blocks-split-cache"])
def test_token_blocks_match_xla(heads, length, starts, attend_length, tiling):
    assert_pallas_matches_xla(heads, length, 128, starts, attend_length, jnp.float32, tiling)


# Tree verifies: k = 2's 2/3/6 tree and SGLang's 4/5/16 (17 nodes with the root: 32 padded new keys),
# with token blocks (the default), one block, and the cache split; positions are the nodes' depths.
@pytest.mark.parametrize("heads,length,cache_length,starts,attend_length,dtype,tiling", [
    (REAL, 7, 128, [40, 0], None, jnp.float32, decode_attention.Tiling(block_s=16)),
    (REAL, 17, 256, [150, 3], 192, jnp.float32, decode_attention.Tiling(block_s=16)),
    (REAL, 17, 256, [100], None, jnp.bfloat16, decode_attention.Tiling()),
    (REAL, 17, 128, [60, 9], None, jnp.float32, decode_attention.Tiling(block_s=16, query_rows=None, splits=3)),
    (NARROW, 32, 128, [50], None, jnp.float32, decode_attention.Tiling(block_s=16, query_rows=8)),
], ids=["real-7", "real-17-attend", "real-17-bf16", "real-17-one-block-split", "narrow-32-blocks"])
def test_a_tree_verify_matches_xla(heads, length, cache_length, starts, attend_length, dtype, tiling):
    assert_pallas_matches_xla(heads, length, cache_length, starts, attend_length, dtype, tiling, tree_seed=length)


def test_xla_reference_is_what_the_attention_layer_computes():
    cfg = config_lib.LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=8, num_layers=1, num_heads=4,
                                 num_kv_heads=2, head_dim=8, rope_theta=10000.0)
    attention = layers.Attention(cfg, rngs=nnx.Rngs(0))
    heads = dict(num_heads=4, num_kv_heads=2, head_dim=8)
    qkv, positions, keys, values = operands(heads, 2, 3, 32, [4, 20], jnp.float32)
    q, k, v = attention.split_heads(qkv, positions)
    for attend_length in (None, 24):
        want = attention.attend(q, k, v, positions, keys, values, attend_length=attend_length)
        got = decode_attention.attend(qkv, positions, keys, values, **heads, inv_freq=INV_FREQ[8],
                                      attend_length=attend_length)
        for w, g in zip(want, got):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    # A tree's verify: the layer under the SlotMask the speculative step builds.
    depths, ancestors = (jnp.asarray(a) for a in random_trees(2, 3, seed=3))
    start = jnp.asarray([4, 20], jnp.int32)
    positions = start[:, None] + depths
    q, k, v = attention.split_heads(qkv, positions)
    mask = layers.SlotMask(start, attention_ops.visible_slots(start, ancestors, 32), among_new=ancestors)
    want = attention.attend(q, k, v, positions, keys, values, mask=mask)
    got = decode_attention.attend(qkv, positions, keys, values, **heads, inv_freq=INV_FREQ[8], new_visible=ancestors)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_rejects_what_it_does_not_take():
    inputs = operands(NARROW, 1, 17, 32, [0], jnp.float32)
    kw = dict(NARROW, inv_freq=INV_FREQ[8])
    with pytest.raises(ValueError, match="at most 32 tokens"):
        decode_attention.attend(*operands(NARROW, 1, 33, 64, [0], jnp.float32), **kw, implementation="pallas")
    with pytest.raises(ValueError, match="new_visible"):
        decode_attention.attend(*inputs, **kw, new_visible=jnp.ones((1, 17, 16), bool))
    with pytest.raises(ValueError, match="attend_length"):
        decode_attention.attend(*inputs, **kw, attend_length=33)
    with pytest.raises(ValueError, match="implementation"):
        decode_attention.attend(*inputs, **kw, implementation="triton")
    with pytest.raises(ValueError, match="qkv width"):
        decode_attention.attend(*inputs, **dict(kw, num_kv_heads=2))
    with pytest.raises(ValueError, match="block_s"):
        decode_attention.Tiling(block_s=48)
    with pytest.raises(ValueError, match="splits"):
        decode_attention.Tiling(splits=0)
    with pytest.raises(ValueError, match="query_rows"):
        decode_attention.Tiling(query_rows=0)


@pytest.mark.parametrize("setting,tiling,triton_calls", [
    ("pallas", decode_attention.Tiling(splits=1), 5), ("pallas", decode_attention.Tiling(splits=4), 6),
    ("pallas", None, 6), ("pallas_linear", None, 4)], ids=["unsplit", "split", "own-choice", "linear"])
def test_decoder_layer_lowers_to_five_triton_calls_writing_the_cache_in_place(monkeypatch, setting, tiling,
                                                                              triton_calls):
    """A pallas decode call of one SmolLM2-shaped layer, lowered for CUDA: four fused linears and
    the attention kernel, whose keys and values outputs alias its cache operands, so that XLA
    need not copy a donated cache; split over the cache, the attention adds its combine kernel,
    as it does up to 8 rows without a tiling given (`Tiling.for_rows`). "pallas_linear" lowers the
    four linears alone (XLA attends between them)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # the kernels' interpret=None: compile them
    cfg = config_lib.LlamaConfig(vocab_size=8, hidden_size=576, intermediate_size=1536, num_layers=1, num_heads=9,
                                 num_kv_heads=3, head_dim=64, rope_theta=100000.0)
    layer = nnx.eval_shape(lambda: layers.DecoderLayer(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16,
                                                       param_dtype=jnp.bfloat16))
    graphdef, params = nnx.split(layer)
    cache = jax.ShapeDtypeStruct((1, 1024, 3, 64), jnp.bfloat16)

    def step(params, x, keys, values):
        positions = jnp.full((1, 1), 512, jnp.int32)
        return nnx.merge(graphdef, params)(x, positions, keys, values, attend_length=768,
                                           kernels=layers.Kernels(setting, tiling))

    x = jax.ShapeDtypeStruct((1, 1, 576), jnp.bfloat16)
    lowered = export.export(jax.jit(step, donate_argnums=(2, 3)), platforms=["cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])
    text = lowered(params, x, cache, cache).mlir_module()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @__gpu$xla.gpu.triton" in line]
    assert len(calls) == triton_calls
    if setting == "pallas_linear":
        assert not any("output_operand_aliases" in line for line in calls)
        return
    [attention] = [line for line in calls if "output_operand_aliases" in line]
    assert "output_tuple_indices = [1], operand_index = 3" in attention
    assert "output_tuple_indices = [2], operand_index = 4" in attention


@pytest.mark.parametrize("query_rows,programs", [(16, 6), (None, 3)])
def test_a_verify_of_six_tokens_lowers_to_a_program_per_token_block(monkeypatch, query_rows, programs):
    """Lowered for CUDA (Triton, not interpret mode), k = 5's verify at SmolLM2's 3 kv heads takes
    two token blocks a kv head by default: a grid of 16 rows x 6 programs, 3 without the bound."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    tiling = decode_attention.Tiling(query_rows=query_rows)
    attend = functools.partial(decode_attention.attend, **REAL, inv_freq=INV_FREQ[64], implementation="pallas",
                               tiling=tiling)
    shape = lambda *dims, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(dims, dtype)
    lowered = export.export(jax.jit(attend), platforms=["cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])
    text = lowered(shape(16, 6, 15 * 64), shape(16, 6, dtype=jnp.int32), shape(16, 256, 3, 64),
                   shape(16, 256, 3, 64)).mlir_module()
    [call] = [line for line in text.splitlines() if "stablehlo.custom_call @__gpu$xla.gpu.triton" in line]
    assert f"grid_x = 16 : i32, grid_y = {programs} : i32" in call


@pytest.mark.parametrize("batch,grids,warps", [(1, ["1/6/4", "1/6/1"], ["8", "4"]), (8, ["8/6/4", "8/6/1"], ["8", "4"]),
                                               (9, ["9/6/1"], ["4"])])
def test_without_a_tiling_few_rows_split_the_cache_over_eight_warps(monkeypatch, batch, grids, warps):
    """`Tiling.for_rows`, lowered for CUDA: a k = 6 verify (7 tokens, two token blocks a kv head)
    of up to 8 rows runs 4 parts of 8 warps and the combine kernel; of more, one kernel of 4 warps."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    attend = functools.partial(decode_attention.attend, **REAL, inv_freq=INV_FREQ[64], implementation="pallas")
    shape = lambda *dims, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(dims, dtype)
    lowered = export.export(jax.jit(attend), platforms=["cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])
    text = lowered(shape(batch, 7, 15 * 64), shape(batch, 7, dtype=jnp.int32), shape(batch, 512, 3, 64),
                   shape(batch, 512, 3, 64)).mlir_module()
    calls = [line for line in text.splitlines() if "stablehlo.custom_call @__gpu$xla.gpu.triton" in line]
    launch = lambda call, name: re.search(rf"{name} = (\d+)", call).group(1)
    assert ["/".join(launch(call, f"grid_{axis}") for axis in "xyz") for call in calls] == grids
    assert [launch(call, "num_warps") for call in calls] == warps


@pytest.mark.parametrize("text,tiling", [
    ("256/8/3/4", decode_attention.Tiling(block_s=256, num_warps=8, splits=4)),
    ("64/2/2/1/none", decode_attention.Tiling(block_s=64, num_warps=2, num_stages=2, query_rows=None)),
    ("128/4/3/2/8", decode_attention.Tiling(splits=2, query_rows=8)),
])
def test_a_tiling_reads_back_from_its_text(text, tiling):
    assert decode_attention.Tiling.parse(text) == tiling
    assert decode_attention.Tiling.parse(str(tiling)) == tiling


@pytest.mark.parametrize("text,message", [("128/4/3", "block_s/num_warps"), ("128/4/3/1/16/2", "block_s/num_warps"),
                                          ("128/4/none/1", "integers"), ("128/x/3/1", "integers"),
                                          ("128/3/3/1", "num_warps must be a power of two"),
                                          ("128/4/0/1", "num_stages")])
def test_a_bad_tiling_text_says_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        decode_attention.Tiling.parse(text)


def test_a_tree_verify_lowers_for_cuda_in_token_blocks(monkeypatch):
    """SGLang's 4/5/16 tree (17 nodes) at SmolLM2's heads, lowered for CUDA (Triton), the kernel
    unsplit: four token blocks of 5 nodes a kv head, the ancestor mask read as an int32 operand
    after the caches."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    attend = functools.partial(decode_attention.attend, **REAL, inv_freq=INV_FREQ[64], implementation="pallas",
                               tiling=decode_attention.Tiling())
    shape = lambda *dims, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(dims, dtype)
    lowered = export.export(jax.jit(attend), platforms=["cuda"],
                            disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])
    text = lowered(shape(2, 17, 15 * 64), shape(2, 17, dtype=jnp.int32), shape(2, 256, 3, 64), shape(2, 256, 3, 64),
                   new_visible=shape(2, 17, 17, dtype=jnp.bool_)).mlir_module()
    [call] = [line for line in text.splitlines() if "stablehlo.custom_call @__gpu$xla.gpu.triton" in line]
    assert "grid_x = 2 : i32, grid_y = 12 : i32" in call
    assert "output_tuple_indices = [1], operand_index = 3" in call


@pytest.mark.parametrize("nodes", [4, 17])
def test_a_tree_verify_takes_the_attention_kernel_given_its_ancestors(random_target, nodes):
    """A tree's SlotMask with `among_new` runs the attention kernel between the four linears (at
    one row, split over the cache: two calls), up to a tree of 16 drafted nodes and its root (17
    rows: one block of 32); a mask without it (any other layout of slots) keeps XLA's attention."""
    target = random_target(num_layers=1)
    cache = target.init_cache(1, 32)
    depths, ancestors = (jnp.asarray(a) for a in random_trees(1, nodes, seed=nodes))
    start = jnp.array([4], jnp.int32)
    visible = attention_ops.visible_slots(start, ancestors, 32)
    for mask, kernels in ((layers.SlotMask(start, visible, among_new=ancestors), 6),
                          (layers.SlotMask(start, visible), 4)):
        jaxpr = jax.make_jaxpr(lambda tokens: target(tokens, start[:, None] + depths, cache, mask=mask,
                                                        kernels=layers.Kernels("pallas")))(
            jnp.zeros((1, nodes), jnp.int32))
        assert kernel_calls.pallas_calls(jaxpr) == kernels


def test_a_draft_heads_cached_calls_attend_in_the_kernel(random_target, random_head):
    """Under "pallas" an EAGLE-3 head's cached calls attend in the kernel as the target's do (its
    midlayer, whose q/k/v read 2H inputs, and a plain layer after it), with the input norms in
    q/k/v's fused kernel, o_proj and the residual add in one, the final norm and lm_head in
    another, computing what XLA does (the logits in float32); under a tree-drafting mask (no
    `among_new`) they keep XLA's attention."""
    target = random_target(num_layers=1)
    head = random_head(target.config, "eagle3", draft_vocab_size=50, num_layers=2)
    cache = eagle.init_cache(head.config, 1, 32, jnp.float32)
    tokens = jnp.asarray([[3, 5, 7]], jnp.int32)
    features = jax.random.normal(jax.random.key(0), (1, 3, head.config.hidden_size))
    start = jnp.asarray([4], jnp.int32)
    positions = start[:, None] + jnp.arange(3, dtype=jnp.int32)
    chain_mask = layers.SlotMask(start, attention_ops.visible_slots(start, jnp.tril(jnp.ones((1, 3, 3), bool)), 32))
    # A layer: its input norms + q/k/v (the midlayer's two norms, the plain layer's one), the
    # attention split over the cache at one row and its combine, o_proj + residual, the MLP's two;
    # under the mask the MLP's two alone (XLA's norms, q/k/v, attention and o_proj). Then the final
    # norm and the lm_head, in one kernel.
    # Three rows: down_proj split-K (`layers.HEAD_SPLIT_K_MAX_ROWS`), its parts added in XLA.
    fused = ["decode_attention", "decode_attention_combine", "linear_residual", "norm_gate_up", "linear_parts"]
    mlp = ["norm_gate_up", "linear_parts"]
    for mask, kernels in ((None, ["norm_pair_linear", *fused, "norm_linear", *fused, "norm_linear"]),
                          (chain_mask, mlp * 2 + ["norm_linear"])):
        call = lambda setting: head(tokens, features, positions, cache, target, mask=mask,
                                    kernels=layers.Kernels(setting))
        assert kernel_calls.pallas_names(jax.make_jaxpr(lambda: call("pallas"))()) == kernels
        (out, logits, written), (want_out, want_logits, want_written) = call("pallas"), call("xla")
        np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits), rtol=2e-5, atol=2e-5)
        for got, want in zip(written.keys + written.values, want_written.keys + want_written.values):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)


def test_a_tree_step_verifies_through_the_kernel(aligned_target, agreeing_head, monkeypatch):
    """Under "pallas" the tree step hands the kernel its nodes' ancestors (`SlotMask.among_new`):
    every target layer's verify attends in the kernel, as a chain's does (`test_kernels` compares
    the greedy tokens with XLA's)."""
    calls = []
    attend = decode_attention.attend
    monkeypatch.setattr(decode_attention, "attend", lambda *a, **kw: calls.append(kw) or attend(*a, **kw))
    target = aligned_target(seed=14, num_layers=2)
    engine = engine_lib.Engine(target, agreeing_head(target.config, 0.3, residual=1.0, seed=1), config=engine_config.EngineConfig(max_length=32,
                               tree=tree_lib.TreeOptions(2, 2, 3), decode_kernels="pallas"))
    engine.generate([[3, 5, 7]], max_new_tokens=4, ignore_eos=True)
    trees = [kw["new_visible"].shape for kw in calls if kw.get("new_visible") is not None]
    assert trees == [(1, 4, 4)] * 2  # traced once: two layers, the root and three nodes


def test_an_engine_runs_the_attention_tiling_it_is_given(aligned_target, agreeing_head, monkeypatch):
    """Engine(engine_config.EngineConfig(attention_tiling=...)) reaches every target layer's kernel call, and greedy tokens
    stay XLA's; a tiling without the Pallas attention kernel to set is refused."""
    tilings = []
    attend = decode_attention.attend
    monkeypatch.setattr(decode_attention, "attend", lambda *a, **kw: tilings.append(kw["tiling"]) or attend(*a, **kw))
    target = aligned_target(seed=14, num_layers=2)
    head = agreeing_head(target.config, 0.3, residual=1.0, seed=1)
    tiling = decode_attention.Tiling(block_s=16, num_warps=2, splits=3, query_rows=None)
    tokens = {}
    for setting, given in (("xla", None), ("pallas", tiling)):
        engine = engine_lib.Engine(target, head, config=engine_config.EngineConfig(num_speculative_tokens=3, max_length=48, decode_kernels=setting,
                                   attention_tiling=given))
        tokens[setting] = [r.token_ids for r in engine.generate([[3, 5, 7, 9]], max_new_tokens=10, ignore_eos=True)]
    assert engine.kernels.attention_tiling == tiling
    assert len(tilings) >= 2 and set(tilings) == {tiling}  # traced: the decode and verify calls of both layers
    assert tokens["pallas"] == tokens["xla"]
    for setting in ("xla", "pallas_linear"):
        with pytest.raises(engine_config.InputError, match="attention_tiling"):
            engine_lib.Engine(target, head, config=engine_config.EngineConfig(num_speculative_tokens=3, decode_kernels=setting, attention_tiling=tiling))
    with pytest.raises(ValueError, match="attention tiling"):
        layers.Kernels("pallas_linear", tiling)


def test_continuous_batching_gives_the_same_tokens(aligned_target, agreeing_head, monkeypatch):
    """Continuous batching's runs read half or all of the cache (attend_length): EAGLE greedy
    tokens with the attention kernel equal XLA's (`test_kernels` compares static batches)."""
    chosen = []
    choose = device_calls.attend_length
    monkeypatch.setattr(device_calls, "attend_length", lambda *a: chosen.append(choose(*a)) or chosen[-1])
    target = aligned_target(seed=14, num_layers=1)
    head = agreeing_head(target.config, 0.3, residual=1.0, seed=1)
    prompts = [np.random.default_rng(length).integers(0, 101, length).tolist() for length in (3, 4, 9)]
    tokens = {}
    for setting in ("xla", "pallas"):
        engine = engine_lib.Engine(target, head, config=engine_config.EngineConfig(steps_per_call=2, num_speculative_tokens=3, max_length=32, batch_size=2,
                                   scheduler="continuous", decode_kernels=setting))
        results = engine.generate(prompts, max_new_tokens=[8, 6, 12], ignore_eos=True)
        tokens[setting] = [r.token_ids for r in results]
    assert tokens["pallas"] == tokens["xla"]
    assert set(chosen) == {16, 32}
