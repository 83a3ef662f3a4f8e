"""Fused decode kernels against the XLA code they replace, at the default target's shapes.

    python benchmarks/kernels_bench.py --out docs/results/kernels_h200.json
    python benchmarks/kernels_bench.py --rows 1,4 --block-n 16,32,64 --block-k 64,128 --num-warps 2,4
    python benchmarks/kernels_bench.py --ops decode_attention --block-s 32,64,128 --num-stages 2,3
    python benchmarks/kernels_bench.py --ops decode_attention --tokens 1,6 --splits 1,2,4,8
    python benchmarks/kernels_bench.py --ops decode_attention --rows 1,16,32 --tokens 5,6,7 --query-rows 16,none
    python benchmarks/kernels_bench.py --ops decode_attention,norm_gate_up --evict-mb 0,256
    python benchmarks/kernels_bench.py --ops decode_attention --tokens 7,17 --tree
    python benchmarks/kernels_bench.py --ops decode_attention --rows 1,4,16 --tokens 1,7 --evict-mb 256 \
        --block-s 128,256 --num-warps 4,8 --splits 1,4

Random bf16 weights, no model files. Ops (`kernels.fused_linear`, implementation "xla" vs "pallas"):
  * norm_linear: input_layernorm + qkv_proj (576 -> 960)
  * norm_gate_up: post_attention_layernorm + gate_up_proj + silu(gate) * up (576 -> 2 x 1536 -> 1536)
  * o_proj_residual, down_proj_residual: linear_residual (576 -> 576, 1536 -> 576)
  * o_proj_parts, down_proj_parts: the split-K pair the target's layers run instead: linear_parts,
    then the kernel that sums its parts into the residual (norm_gate_up, norm_linear)
  * draft_lm_head: an EAGLE-3 head's final norm + lm_head with float32 logits, norm_linear
    (576 -> --draft-vocab): what every draft forward ends in
  * draft_lm_head_int8: the same over the lm_head as the package stores it, int8 with a float32
    scale a row (`io.int8_weights`), read as int8 (`norm_linear(..., weight_scale=...)`)
  * draft_qkv, draft_gate_up, draft_down_parts: the rest of an EAGLE-3 head's layer: its two
    input norms + q/k/v (norm_pair_linear, 2 x 576 -> 960), its MLP's first half (576 -> 2 x
    --draft-intermediate) and one row's split-K down_proj, the parts added in XLA
  * decode_attention: `kernels.decode_attention.attend` of --tokens tokens (1: a plain decode
    step; 6: a k = 5 chain's verify) in each of `rows` rows, from qkv_proj's output: rotary, cache
    write and attention over a --cache-length cache whose first half is filled (the new tokens
    are the half's last), attend_length None (all the cache) and the half; its weight_bytes are
    the filled keys and values, which attention must read; with --tree the tokens are a tree
    verify's nodes, attending to their ancestors (`heap_tree`)
  * decoder_layer: one cached decode call of a whole `layers.DecoderLayer` (cache --cache-length),
    decode_kernels "xla" vs "pallas" vs "pallas_linear" (each kernel's own tiling)
  * draft_top_k: an EAGLE-2 tree's expansion of `rows` frontier nodes, the `rows` best of each
    node's --draft-vocab float32 log-probabilities: `lax.top_k` ("xla") vs `tree.top_k`
    ("two_stage": chunks of `tree.TOP_K_CHUNK`, then the best of those)
  * compact_cache: a tree verify's accepted path (`rows` entries) moved into place in every
    layer's keys and values (30 layers, --cache-length slots): `kernels.compact_cache`, a gather
    and a write per buffer ("xla") vs one kernel for all ("pallas")
Each is jitted alone. wall_us: median host time of one call ended by `block_until_ready` over
--iterations calls (mostly dispatch for kernels this small). kernels and busy_us per call: from a
`jax.profiler` trace of --trace-calls calls (benchmarks/step_trace.py: device time, overlaps merged):
the number that matters inside a compiled step. gb_per_s: weight bytes / busy time.
--evict-mb N (GPU): after each call a Pallas kernel named evict_l2 reads N MB, as the other layers'
weights pass through the L2 cache between two calls of a layer's kernel in a real step; the
traced figures leave it out (by name), wall_us includes it. 0 (default) calls nothing between.
Pallas rows run
once per tiling in the product of --block-n, --block-k, --num-warps and --num-stages (decode_attention:
--block-s, --splits, --query-rows, --num-warps and --num-stages, the Tiling defaults for those not
given; with none of them, the tiling `attend` runs at that many rows, `Tiling.for_rows`). Every row
is appended to --out (kind "kernel_bench") and a table is printed.
Every row also checks its op's output against the XLA row's of the same case, on the same inputs:
max_error is the largest absolute difference over the largest absolute XLA value (the first call's
outputs, all of them). --check makes a row past `CHECK_TOLERANCE` for its dtype fail the run (exit
1, after the rows are written): a benchmark queue can open with a short --check run, so that a kernel
new to the GPU that does not compile, or computes the wrong thing, stops the queue in seconds:

    python benchmarks/kernels_bench.py --check --rows 1,7,32 --tokens 1,7,32 --iterations 1 --trace-calls 1
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))  # step_trace, results_file
try:
    import eagle_jax  # noqa: F401
except ModuleNotFoundError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(BENCHMARKS.parent))

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from eagle_jax.model import config as config_lib
from eagle_jax.model import layers
from eagle_jax.model import rotary
from eagle_jax.io import int8_weights
from eagle_jax.io import models
from eagle_jax.decode import tree
from eagle_jax.kernels import compact_cache
from eagle_jax.kernels import decode_attention
from eagle_jax.kernels import fused_linear
from eagle_jax.cli import errors as script_errors
import step_trace
import results_file
from results_file import append_rows

# SmolLM2-135M's decoder layer.
DEFAULT_CONFIG = config_lib.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=1,
                                        num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0)
SMOLLM2_LAYERS = 30  # compact_cache moves a path in every layer's keys and values
LINEAR_OPS = ("norm_linear", "norm_gate_up", "o_proj_residual", "down_proj_residual", "o_proj_parts",
              "down_proj_parts", "draft_lm_head", "draft_lm_head_int8", "draft_qkv", "draft_gate_up",
              "draft_down_parts")  # <= MAX_ROWS rows
OPS = LINEAR_OPS + ("decode_attention", "decoder_layer", "draft_top_k", "compact_cache")


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def optional_int_list(text: str) -> list[int | None]:
    return [None if part.strip().lower() == "none" else int(part) for part in text.split(",") if part.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--config", help="HF config.json whose layer shapes to use (default: SmolLM2-135M's)")
    parser.add_argument("--dtype", choices=sorted(models.DTYPES), default="bfloat16")
    parser.add_argument("--rows", type=int_list, default=[1], help=f"M = batch x tokens, or a comma list (<= {fused_linear.MAX_ROWS} for the fused linears)")
    parser.add_argument("--ops", default=",".join(OPS), help=f"comma list of {OPS}")
    parser.add_argument("--block-n", type=int_list, default=[fused_linear.Tiling.block_n])
    parser.add_argument("--block-k", type=int_list, default=[fused_linear.Tiling.block_k])
    parser.add_argument("--block-s", type=int_list,
                        help="cache slots per chunk of decode_attention (with none of --block-s, --splits, "
                             "--query-rows, --num-warps and --num-stages: the kernel's own choice for the rows, "
                             "decode_attention.Tiling.for_rows; else the Tiling defaults for those not given)")
    parser.add_argument("--splits", type=int_list,
                        help="programs sharing a row's cache in decode_attention (1: the single kernel)")
    parser.add_argument("--query-rows", type=optional_int_list,
                        help="most query rows a decode_attention program holds, or a comma list; none: one "
                             "program holds a (row, kv head)'s tokens x heads, however many")
    parser.add_argument("--tokens", type=int_list, default=[1],
                        help=f"decode_attention's tokens per row, or a comma list (<= {decode_attention.MAX_TOKENS})")
    parser.add_argument("--tree", action="store_true",
                        help="decode_attention's tokens are a tree verify's nodes (node i's parent (i - 1) // 2, "
                             "positions by depth), each attending to its ancestors (`new_visible`)")
    parser.add_argument("--num-warps", type=int_list, help="default: each kernel's Tiling default")
    parser.add_argument("--num-stages", type=int_list, help="default: each kernel's Tiling default")
    parser.add_argument("--iterations", type=int, default=200, help="timed calls for the wall-time median")
    parser.add_argument("--trace-calls", type=int, default=100, help="calls traced for kernels and busy time")
    parser.add_argument("--cache-length", type=int, default=1024,
                        help="KV cache slots of decode_attention and decoder_layer")
    parser.add_argument("--draft-vocab", type=int, default=32768,
                        help="the draft vocabulary (default: the shipped EAGLE-3 head's): draft_top_k's row length, "
                             "draft_lm_head's output width")
    parser.add_argument("--draft-intermediate", type=int, default=3072,
                        help="the draft head's MLP width (default: the shipped EAGLE-3 head's): draft_gate_up, "
                             "draft_down_parts")
    parser.add_argument("--evict-mb", type=int_list, default=[0],
                        help="MB read by a kernel after each call (the L2 cache evicted), or a comma list; GPU only")
    parser.add_argument("--label", default="", help="free text saved in every row")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when an op's output is off the XLA row's by more than CHECK_TOLERANCE")
    parser.add_argument("--out", default="docs/results/kernels_h200.json", help="JSON list the rows are appended to")
    args = parser.parse_args(argv)
    args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    if bad := [op for op in args.ops if op not in OPS]:
        parser.error(f"unknown --ops {bad}; choose from {OPS}")
    if not args.rows or min(args.rows) < 1:
        parser.error("--rows must be >= 1")
    if max(args.rows) > fused_linear.MAX_ROWS and (fused := [op for op in args.ops if op in LINEAR_OPS]):
        parser.error(f"--rows must be <= {fused_linear.MAX_ROWS} for the fused linears {fused} (the other ops take more)")
    if not args.tokens or min(args.tokens) < 1 or max(args.tokens) > decode_attention.MAX_TOKENS:
        parser.error(f"--tokens must be in 1..{decode_attention.MAX_TOKENS}")
    if args.splits and min(args.splits) < 1:
        parser.error("--splits must be >= 1")
    if args.query_rows and any(rows is not None and rows < 1 for rows in args.query_rows):
        parser.error("--query-rows must be >= 1 or none")
    if min(args.iterations, args.trace_calls) < 1:
        parser.error("--iterations and --trace-calls must be >= 1")
    if not args.evict_mb or min(args.evict_mb) < 0:
        parser.error("--evict-mb must be >= 0")
    if max(args.evict_mb) > 0 and jax.default_backend() != "gpu":
        parser.error("--evict-mb needs a GPU: the traced figures tell its kernel apart by name, which "
                     "interpret mode on other backends does not keep")
    return args


# --check's bound on max_error: a wrong kernel is off by the values' own size; a right one by
# roundings (a decoder layer's bf16 compounds a few).
CHECK_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2}

EVICT_WIDTH, EVICT_ROWS = 512, 32  # the evictor's block: 32 x 512 bf16 values (32 KB) a program


def _evict_kernel(x_ref, out_ref):
    out_ref[...] = jnp.sum(x_ref[...].astype(jnp.float32), axis=0, keepdims=True)


def l2_evictor(megabytes: int, interpret: bool = False):
    """A call that reads `megabytes` MB of bf16 in one Pallas kernel named evict_l2 (column sums of
    32-row blocks): between two calls of a kernel it evicts the L2 cache, as a real step's other
    layers do. None for 0 MB."""
    if megabytes <= 0:
        return None
    rows = max(1, megabytes * 2**20 // (2 * EVICT_WIDTH * EVICT_ROWS)) * EVICT_ROWS
    buffer = jnp.ones((rows, EVICT_WIDTH), jnp.bfloat16)
    read = jax.jit(evict_call(rows, interpret))
    return lambda: read(buffer)


def evict_call(rows: int, interpret: bool = False):
    """The evictor's kernel over a [rows, EVICT_WIDTH] bf16 buffer: [rows / EVICT_ROWS, EVICT_WIDTH] sums."""
    return pl.pallas_call(
        _evict_kernel, out_shape=jax.ShapeDtypeStruct((rows // EVICT_ROWS, EVICT_WIDTH), jnp.float32),
        grid=(rows // EVICT_ROWS,), in_specs=[pl.BlockSpec((EVICT_ROWS, EVICT_WIDTH), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((1, EVICT_WIDTH), lambda i: (i, 0)), compiler_params=plgpu.CompilerParams(),
        interpret=interpret, name="evict_l2")


def measure(function, inputs: tuple, args, evict=None) -> dict:
    """Wall median and traced kernels / busy time per call of `function(*inputs)`, and the first
    call's output (its leaves as float32 arrays, under "output": `add_errors` reads and drops it).

    `function` returns (output, inputs for the next call): a call that donates its cache
    passes on the updated one. `evict` (`l2_evictor`) runs after each call; the traced figures
    leave its kernel out.
    """
    holder = {"inputs": inputs}

    def call():
        out, holder["inputs"] = function(*holder["inputs"])
        if evict is not None:
            evict()
        return out

    output = [np.asarray(leaf, np.float32) for leaf in jax.tree.leaves(call())]
    for _ in range(4):
        jax.block_until_ready(call())
    times = []
    for _ in range(args.iterations):
        began = time.perf_counter()
        jax.block_until_ready(call())
        times.append(time.perf_counter() - began)
    with tempfile.TemporaryDirectory(prefix="eagle-jax-kernels-") as log_dir:
        with jax.profiler.trace(log_dir):
            for _ in range(args.trace_calls):
                out = call()
            jax.block_until_ready(out)
        summary = step_trace.summarize(step_trace.load_trace(step_trace.find_trace_file(log_dir)), args.trace_calls,
                                       exclude="evict_l2" if evict is not None else None)
    return dict(wall_us=round(1e6 * float(np.median(times)), 2), kernels=summary["kernels_per_step"],
                busy_us=summary["busy_us_per_step"], kernel_us=summary["kernel_us_per_step"],
                top_kernels=summary["top_kernels"][:4], output=output)


def case_of(row: dict) -> tuple:
    """The rows that run one op on the same inputs: the XLA row and its rivals."""
    return row["op"], row["rows"], row.get("tokens"), row.get("attend_length"), row.get("evict_mb")


def relative_error(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    """The largest |got - want| over the largest |want|, over all output leaves."""
    scale = max(float(np.abs(leaf).max()) for leaf in want) or 1.0
    return max(float(np.abs(g - w).max()) for g, w in zip(got, want, strict=True)) / scale


def add_errors(rows: list[dict]) -> None:
    """Each row's max_error against the XLA row of its case (None for that row); drops the outputs."""
    reference = {case_of(r): r["output"] for r in rows if r["implementation"] == "xla"}
    for row in rows:
        output = row.pop("output")
        row["max_error"] = None if row["implementation"] == "xla" else relative_error(output, reference[case_of(row)])


def failed_checks(rows: list[dict], dtype: str) -> list[dict]:
    """The rows whose max_error is past `CHECK_TOLERANCE[dtype]`."""
    return [r for r in rows if r["max_error"] is not None and not r["max_error"] <= CHECK_TOLERANCE[dtype]]


def linear_cases(cfg: config_lib.LlamaConfig, rows: int, dtype, seed: int = 0, draft_vocab: int = 32768,
                 draft_intermediate: int = 3072) -> dict:
    """op -> (function of (inputs, implementation, tiling), inputs, weight bytes)."""
    rng = np.random.default_rng(seed)
    activations = lambda width: jnp.asarray(rng.standard_normal((rows, width)), dtype)
    weight = lambda fan_in, fan_out: jnp.asarray(rng.standard_normal((fan_in, fan_out)) / np.sqrt(fan_in), dtype)
    hidden, intermediate, attended = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim
    x, norm, eps = activations(hidden), jnp.ones((hidden,), dtype), cfg.rms_norm_eps
    qkv, gate_up = weight(hidden, sum(layers.qkv_sizes(cfg))), weight(hidden, 2 * intermediate)
    o_proj, down_proj = weight(attended, hidden), weight(intermediate, hidden)
    size = lambda w: w.size * w.dtype.itemsize
    norm_linear = lambda i, **kw: fused_linear.norm_linear(i[0], i[1], eps, i[2], **kw)
    lm_head = lambda i, **kw: fused_linear.norm_linear(i[0], i[1], eps, i[2], out_dtype=jnp.float32, **kw)
    lm_head_weight = weight(hidden, draft_vocab)
    stored = int8_weights.quantize({"lm_head": np.asarray(lm_head_weight, np.float32).T}, ["lm_head"])
    lm_head_int8, lm_head_scale = jnp.asarray(stored["lm_head"].T), jnp.asarray(stored["lm_head_scale"][:, 0])
    lm_head_scaled = lambda i, **kw: fused_linear.norm_linear(i[0], i[1], eps, i[2], weight_scale=i[3],
                                                              out_dtype=jnp.float32, **kw)
    norm_gate_up = lambda i, **kw: fused_linear.norm_gate_up(i[0], i[1], eps, i[2], **kw)
    linear_residual = lambda i, **kw: fused_linear.linear_residual(*i, **kw)

    def split_k(fused):  # (x, its parts' inputs and weight, the summing kernel's norm and weight)
        return lambda i, **kw: fused(i[0], i[3], eps, i[4], parts=fused_linear.linear_parts(i[1], i[2], **kw), **kw)

    # The EAGLE-3 head's layer: q/k/v read the normed token embedding beside the normed feature
    # (`norm_pair_linear`); its MLP is wider, and one row's down_proj runs split-K, the parts
    # added in XLA (`layers.residual_mlp`).
    draft_qkv = weight(2 * hidden, sum(layers.qkv_sizes(cfg)))
    draft_gate_up, draft_down = weight(hidden, 2 * draft_intermediate), weight(draft_intermediate, hidden)
    pair_linear = lambda i, **kw: fused_linear.norm_pair_linear(i[0], i[1], i[2], i[3], eps, i[4], **kw)
    parts_added = lambda i, **kw: fused_linear.add_parts(i[0], fused_linear.linear_parts(i[1], i[2], **kw))

    return {"norm_linear": (norm_linear, (x, norm, qkv), size(qkv)),
            "norm_gate_up": (norm_gate_up, (x, norm, gate_up), size(gate_up)),
            "o_proj_residual": (linear_residual, (activations(attended), o_proj, x), size(o_proj)),
            "down_proj_residual": (linear_residual, (activations(intermediate), down_proj, x), size(down_proj)),
            "o_proj_parts": (split_k(fused_linear.norm_gate_up), (x, activations(attended), o_proj, norm, gate_up),
                             size(o_proj) + size(gate_up)),
            "down_proj_parts": (split_k(fused_linear.norm_linear), (x, activations(intermediate), down_proj, norm, qkv),
                                size(down_proj) + size(qkv)),
            "draft_lm_head": (lm_head, (x, norm, lm_head_weight), size(lm_head_weight)),
            "draft_lm_head_int8": (lm_head_scaled, (x, norm, lm_head_int8, lm_head_scale),
                                   size(lm_head_int8) + size(lm_head_scale)),
            "draft_qkv": (pair_linear, (x, norm, activations(hidden), norm, draft_qkv), size(draft_qkv)),
            "draft_gate_up": (norm_gate_up, (x, norm, draft_gate_up), size(draft_gate_up)),
            "draft_down_parts": (parts_added, (x, activations(draft_intermediate), draft_down), size(draft_down))}


def layer_case(cfg: config_lib.LlamaConfig, rows: int, dtype, setting: str, cache_length: int):
    """(jitted decode call of one DecoderLayer over `rows` rows of one token, its inputs, weight bytes)."""
    layer = layers.DecoderLayer(cfg, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    graphdef, params = nnx.split(layer)

    def step(params, x, keys, values):
        positions = jnp.full((rows, 1), cache_length // 2, jnp.int32)
        return nnx.merge(graphdef, params)(x, positions, keys, values, kernels=layers.Kernels(setting))

    step = jax.jit(step, donate_argnums=(2, 3))  # the cache updated in place, as in the engine's step

    def call(params, x, keys, values):
        out, keys, values = step(params, x, keys, values)
        return out, (params, x, keys, values)

    cache = lambda: jnp.zeros((rows, cache_length, cfg.num_kv_heads, cfg.head_dim), dtype)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((rows, 1, cfg.hidden_size)), dtype)
    weight_bytes = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params))
    return call, (params, x, cache(), cache()), weight_bytes


def heap_tree(tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(depths [T], ancestors [T, T] bool, itself included) of the tree whose node i > 0 hangs
    under node (i - 1) // 2: a fixed tree shape for timing (the mask's values cost nothing)."""
    parents = np.maximum(np.arange(tokens) - 1, 0) // 2  # the root its own parent
    ancestors = np.asarray(tree.ancestor_matrix(jnp.asarray(parents)[None], tokens))[0]
    return ancestors.sum(axis=1).astype(np.int32) - 1, ancestors


def attention_case(cfg: config_lib.LlamaConfig, rows: int, tokens: int, dtype, cache_length: int,
                   attend_length: int | None, implementation: str, tiling: decode_attention.Tiling | None,
                   tree: bool = False):
    """(decode_attention call of `tokens` tokens a row, updating a donated cache, its inputs, filled
    cache bytes); with `tree`, the tokens are `heap_tree`'s nodes."""
    rng = np.random.default_rng(0)
    width = sum(layers.qkv_sizes(cfg))
    qkv = jnp.asarray(rng.standard_normal((rows, tokens, width)), dtype)
    cache_shape = (rows, cache_length, cfg.num_kv_heads, cfg.head_dim)
    cache = lambda: jnp.asarray(rng.standard_normal(cache_shape), dtype)
    # Slots below cache_length // 2 are filled, the new tokens the last of them.
    positions = jnp.broadcast_to(jnp.arange(cache_length // 2 - tokens, cache_length // 2, dtype=jnp.int32),
                                 (rows, tokens))
    new_visible = None
    if tree:  # the same slots, the nodes at their depths' positions
        depths, ancestors = heap_tree(tokens)
        positions = positions[:, :1] + jnp.asarray(depths)[None, :]
        new_visible = jnp.broadcast_to(jnp.asarray(ancestors), (rows, tokens, tokens))
    kw = dict(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
              attend_length=attend_length,
              inv_freq=rotary.rope_inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
              implementation=implementation, new_visible=new_visible) | (dict(tiling=tiling) if tiling else {})
    step = jax.jit(lambda qkv, keys, values: decode_attention.attend(qkv, positions, keys, values, **kw),
                   donate_argnums=(1, 2))

    def call(qkv, keys, values):
        out, keys, values = step(qkv, keys, values)
        return out, (qkv, keys, values)

    filled_bytes = 2 * rows * (cache_length // 2) * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize
    return call, (qkv, cache(), cache()), filled_bytes


def tilings(args, tiling_class, **blocks: list[int] | None) -> list:
    """Every combination of the block sizes and launch settings asked for (`tiling_class`'s defaults if not)."""
    options = blocks | {name: getattr(args, name) for name in ("num_warps", "num_stages")}
    options = {name: values or [getattr(tiling_class, name)] for name, values in options.items()}
    return [tiling_class(**dict(zip(options, values))) for values in itertools.product(*options.values())]


def attention_tilings(args, rows: int) -> list[decode_attention.Tiling]:
    """The tilings asked for, or with none asked for the one `attend` runs at this many rows."""
    asked = dict(block_s=args.block_s, splits=args.splits, query_rows=args.query_rows)
    if not any(asked.values()) and not args.num_warps and not args.num_stages:
        return [decode_attention.Tiling.for_rows(rows)]
    return tilings(args, decode_attention.Tiling, **asked)


def run(args) -> list[dict]:
    cfg = config_lib.LlamaConfig.from_file(args.config) if args.config else DEFAULT_CONFIG
    dtype = models.DTYPES[args.dtype]
    device = jax.devices()[0]
    common = dict(kind="kernel_bench", label=args.label, dtype=args.dtype, hidden_size=cfg.hidden_size,
                  intermediate_size=cfg.intermediate_size, device=device.device_kind, platform=device.platform,
                  jax_version=jax.__version__, iterations=args.iterations, trace_calls=args.trace_calls,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  command="python benchmarks/kernels_bench.py " + shlex.join(sys.argv[1:]))
    rows = []
    for megabytes in args.evict_mb:
        rows += run_cases(args, cfg, dtype, dict(common, evict_mb=megabytes), l2_evictor(megabytes))
    add_errors(rows)
    for row in rows:
        row["gb_per_s"] = round(row["weight_bytes"] / row["busy_us"] / 1e3, 1)
    return rows


def run_cases(args, cfg: config_lib.LlamaConfig, dtype, common: dict, evict) -> list[dict]:
    """The rows of every op and setting asked for, with `evict` (or nothing) after each call."""
    rows = []
    for count in args.rows:
        cases = linear_cases(cfg, count, dtype, draft_vocab=args.draft_vocab, draft_intermediate=args.draft_intermediate)
        for op in args.ops:
            if op == "decoder_layer":
                for setting in layers.DECODE_KERNELS:
                    call, inputs, weight_bytes = layer_case(cfg, count, dtype, setting, args.cache_length)
                    rows.append(dict(op=op, implementation=setting, rows=count, weight_bytes=weight_bytes,
                                     cache_length=args.cache_length, **measure(call, inputs, args, evict), **common))
                continue
            if op == "decode_attention":
                settings = [("xla", None)] + [("pallas", tiling) for tiling in attention_tilings(args, count)]
                for tokens, attend_length, (implementation, tiling) in itertools.product(
                        args.tokens, (None, args.cache_length // 2), settings):
                    call, inputs, weight_bytes = attention_case(cfg, count, tokens, dtype, args.cache_length,
                                                                attend_length, implementation, tiling, args.tree)
                    rows.append(dict(op=op, implementation=implementation, rows=count, tokens=tokens, tree=args.tree,
                                     weight_bytes=weight_bytes, cache_length=args.cache_length,
                                     attend_length=attend_length,
                                     tiling=tiling and vars(tiling), **measure(call, inputs, args, evict), **common))
                continue
            if op == "compact_cache":
                shape = (1, args.cache_length, cfg.num_kv_heads, cfg.head_dim)
                start, sources = jnp.asarray([args.cache_length // 2], jnp.int32), 2 * jnp.arange(count)[None]
                moved_bytes = 4 * SMOLLM2_LAYERS * count * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize
                for implementation in compact_cache.IMPLEMENTATIONS:
                    # random, so that a wrong move shows in max_error; donated below
                    buffers = tuple(jax.random.normal(jax.random.key(i), shape, dtype) for i in range(2 * SMOLLM2_LAYERS))
                    jitted = jax.jit(lambda b, implementation=implementation: compact_cache.compact(
                        b, start, sources, implementation=implementation), donate_argnums=0)
                    measured = measure(lambda b, jitted=jitted: (lambda out: (out, (out,)))(jitted(b)), (buffers,),
                                       args, evict)
                    rows.append(dict(op=op, implementation=implementation, rows=count, cache_length=args.cache_length,
                                     weight_bytes=moved_bytes, **measured, **common))
                continue
            if op == "draft_top_k":
                values = jax.random.normal(jax.random.key(0), (1, count, args.draft_vocab), jnp.float32)
                for implementation, top_k in (("xla", jax.lax.top_k), ("two_stage", tree.top_k)):
                    jitted = jax.jit(lambda v, top_k=top_k, k=count: top_k(v, k))
                    rows.append(dict(op=op, implementation=implementation, rows=count, draft_vocab=args.draft_vocab,
                                     weight_bytes=values.size * 4,
                                     **measure(lambda v, jitted=jitted: (jitted(v), (v,)), (values,), args, evict),
                                     **common))
                continue
            function, inputs, weight_bytes = cases[op]
            pallas = tilings(args, fused_linear.Tiling, block_n=args.block_n, block_k=args.block_k)
            settings = [("xla", None)] + [("pallas", tiling) for tiling in pallas]
            for implementation, tiling in settings:
                kw = dict(implementation=implementation) | (dict(tiling=tiling) if tiling else {})
                jitted = jax.jit(lambda *i, kw=kw, function=function: function(i, **kw))
                try:
                    measured = measure(lambda *i, jitted=jitted: (jitted(*i), i), inputs, args, evict)
                except jax.errors.JaxRuntimeError as error:  # a tiling past the GPU's shared memory: the sweep goes on
                    print(f"{op} {implementation} {tiling}: {results_file.error_field(error)}", file=sys.stderr)
                    continue
                rows.append(dict(op=op, implementation=implementation, rows=count, weight_bytes=weight_bytes,
                                 tiling=tiling and vars(tiling), **measured, **common))
    return rows


def print_table(rows: list[dict]) -> None:
    header = (f"{'op':<20}{'evict':>6}{'impl':>8}{'rows':>6}{'tokens':>7}{'attend':>7}{'tiling m/n/k|s/warps/stages[/splits]':>34}"
              f"{'kernels':>9}{'busy us':>9}{'vs xla':>8}{'wall us':>9}{'GB/s':>8}{'error':>10}")
    print("\n" + header + "\n" + "-" * len(header))
    xla = {case_of(r): r["busy_us"] for r in rows if r["implementation"] == "xla"}
    for r in rows:
        tiling = "/".join(map(str, r["tiling"].values())) if r.get("tiling") else "-"
        attend, tokens = r.get("attend_length") or "-", r.get("tokens") or "-"
        error = "-" if r["max_error"] is None else f"{r['max_error']:.1e}"
        print(f"{r['op']:<20}{r.get('evict_mb') or '-':>6}{r['implementation']:>8}{r['rows']:>6}{tokens:>7}{attend:>7}{tiling:>34}{r['kernels']:>9}"
              f"{r['busy_us']:>9.2f}{xla[case_of(r)] / r['busy_us']:>7.2f}x{r['wall_us']:>9.1f}{r['gb_per_s']:>8.0f}{error:>10}")


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = run(args)
    append_rows(args.out, rows)
    print_table(rows)
    print(f"[kernels_bench.py] {len(rows)} rows -> {args.out}", file=sys.stderr)
    if args.check and (failed := failed_checks(rows, args.dtype)):
        for r in failed:
            print(f"[kernels_bench.py] CHECK FAILED: {r['op']} {r['implementation']} rows {r['rows']} tokens "
                  f"{r.get('tokens')} tiling {r.get('tiling')}: max_error {r['max_error']:.2e} > "
                  f"{CHECK_TOLERANCE[args.dtype]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(script_errors.run(main))
