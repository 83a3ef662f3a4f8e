"""Fused linear layers for decode steps (a few rows): RMSNorm + matmul (+ SwiGLU), matmul + residual.

At batch 1 a decode step multiplies M = batch x tokens <= 32 rows by each weight matrix. XLA runs
each norm, matmul, activation and residual add as its own 1-7 us kernel (~19 per SmolLM2 layer),
so the step is bound by the kernel count, not by reading the weights. With these, a decoder
layer's projections take four kernels:

  norm_linear      rmsnorm(x) @ W                          input_layernorm + qkv_proj
  norm_gate_up     silu(n @ W_gate) * (n @ W_up), n = rmsnorm(x)   post_attention_layernorm + gate_up_proj
  linear_residual  residual + x @ W                        o_proj, down_proj (a head's)
  linear_parts     x @ W as float32 partial sums over K      down_proj (the target's layers)
  norm_pair_linear [rmsnorm(a); rmsnorm(b)] @ W            EAGLE-3's midlayer input norms + qkv_proj

and `norm_linear(..., out_dtype=float32)` is a draft head's final norm + lm_head; given
`weight_scale` it reads an int8 weight with one float32 scale an output column (the EAGLE-3 head's
lm_head as the package stores it: half the bytes of bfloat16, and the widest read of a draft).

A split-K `linear_parts` spreads a narrow output (576 columns: 18 programs of 32 columns would
leave most of the GPU idle, each streaming its whole K = 1536) over one program per block_k chunk
of K as well, and leaves the sum to the next kernel: `norm_linear` and `norm_gate_up` given
`parts` take residual + round(sum of parts) as their input, the residual add `linear_residual`
does, as they load it, and store that sum (the residual stream the layer goes on with), so the
split needs no reduction kernel of its own. On an H100 down_proj's parts took 3.4 us against 5.3
for `linear_residual`, and summing them cost `norm_linear` 1.1 us; o_proj (K = 576) gained 0.3
us and cost `norm_gate_up` as much, so it stays whole.

`implementation="xla"` is the reference: plain jnp computing what `layers.RMSNorm` and a bias-free
`nnx.Linear` compute. `"pallas"` is one Triton kernel per call (GPU); `interpret=None` runs it in
Pallas interpret mode unless the default backend is a GPU, so CPU tests run the kernel code.

Kernel layout: a grid of (row blocks, column blocks). A program streams a [K, block_n] column
strip of the weight in block_k chunks through `dot` with its rows of x. Norms are recomputed by
every program: a row has K = 576 values, cheaper than a second launch. Triton's dot needs every
dimension >= 16, so rows come in one block of 16 or 32 (`row_block`; absent rows load as zeros
and are never stored, and each weight strip is read once), and Triton tensors have power-of-two
sizes, so ragged edges (K = 576 in chunks of 256, N not a multiple of block_n) are masked.
Accumulation is float32; outputs take x's dtype and weights are cast to it, as `nnx.Linear`
casts to its computation dtype.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

IMPLEMENTATIONS = ("xla", "pallas")
# The most rows the model sends to these kernels, in one block of rows: a decode step of up to 32
# rows, a chain's verify, an EAGLE-2 tree's verify of up to 31 drafted nodes and its root.
MAX_ROWS = 32


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static block sizes and Triton launch settings of the Pallas kernels.

    Attributes:
        block_m: rows per program (Triton's dot needs >= 16); None: the power of two >= 16
            that holds all the rows (`row_block`).
        block_n: output columns per program (of gate and of up each, in `norm_gate_up`).
        block_k: input features per dot in a program's loop over K.
        num_warps: Triton warps per program.
        num_stages: Triton software-pipelining depth of that loop (weight loads in flight).
    """

    block_m: int | None = None
    block_n: int = 32
    block_k: int = 256  # the fastest in the H200 sweep (docs/benchmarks.md)
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            size = getattr(self, name)
            if size is None and name == "block_m":
                continue
            if size < 16 or size & (size - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (Triton's dot), got {size}")


def norm_linear(x: jax.Array, norm_weight: jax.Array, eps: float, weight: jax.Array, *,
                parts: jax.Array | None = None, weight_scale: jax.Array | None = None, implementation: str = "xla",
                interpret: bool | None = None, tiling: Tiling = Tiling(), out_dtype=None):
    """rmsnorm(x) @ weight: HF's RMSNorm (as `layers.RMSNorm`), then a bias-free linear layer.

    Args:
        x: [..., K] activations, in the computation's dtype.
        norm_weight: [K] RMSNorm scale.
        eps: RMSNorm epsilon.
        weight: [K, N], `nnx.Linear`'s kernel layout.
        parts: [S, ..., K] float32 partial sums of a linear layer closing a residual branch
            (`linear_parts`); the input is then `add_parts(x, parts)`.
        weight_scale: [N] float32 for an int8 weight: column n is weight[:, n] x weight_scale[n]. The
            int8 values widen exactly; the float32 sums are scaled before out_dtype's rounding.
        implementation: "xla" (reference) or "pallas".
        interpret: run the Pallas kernel in interpret mode; None: unless the backend is a GPU.
        tiling: the Pallas kernel's block sizes.
        out_dtype: the output's dtype (None: x's). float32 keeps the float32 accumulation
            unrounded, as `float32_logits` does for an output layer's logits.
    Returns:
        [..., N] in out_dtype; with parts, (that, the input `add_parts(x, parts)` [..., K]).
    """
    _check(implementation, x, weight, parts, weight_scale)
    if weight_scale is not None:
        if parts is not None:
            raise ValueError("an int8 weight takes no parts (it is an output layer's)")
        if implementation == "xla":
            sums = _linear(rms_norm(x, norm_weight, eps), weight, jnp.float32)
            return (sums * weight_scale).astype(out_dtype or x.dtype)
        return _call(_norm_linear_kernel, "norm_linear_int8", x, (norm_weight, weight, weight_scale),
                     weight.shape[1], interpret, tiling, out_dtype=out_dtype, eps=eps)
    if implementation == "xla":
        normed = x if parts is None else add_parts(x, parts)
        out = _linear(rms_norm(normed, norm_weight, eps), weight, out_dtype)
        return out if parts is None else (out, normed)
    return _call(_norm_linear_kernel, "norm_linear", x, (norm_weight, weight), weight.shape[1], interpret, tiling,
                 parts, out_dtype=out_dtype, eps=eps)


def norm_pair_linear(a: jax.Array, a_norm: jax.Array, b: jax.Array, b_norm: jax.Array, eps: float,
                     weight: jax.Array, *, implementation: str = "xla", interpret: bool | None = None,
                     tiling: Tiling = Tiling()) -> jax.Array:
    """[rmsnorm(a); rmsnorm(b)] @ weight, each input with its own RMSNorm scale: EAGLE-3's midlayer,
    whose q/k/v read the normed token embedding beside the normed feature, in one kernel instead
    of XLA's norms, concatenation and matmul.

    Args:
        a, b: [..., Ka] and [..., Kb] activations of one dtype and leading shape.
        a_norm, b_norm: [Ka] and [Kb] RMSNorm scales; eps: their epsilon.
        weight: [Ka + Kb, N].
        implementation, interpret, tiling: as `norm_linear`.
    Returns:
        [..., N] in a's dtype.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {implementation!r} ({', '.join(IMPLEMENTATIONS)})")
    if a.shape[:-1] != b.shape[:-1] or a.dtype != b.dtype:
        raise ValueError(f"inputs {a.shape} {a.dtype} and {b.shape} {b.dtype} differ in their rows or dtype")
    if weight.ndim != 2 or weight.shape[0] != a.shape[-1] + b.shape[-1]:
        raise ValueError(f"weight shape {weight.shape} does not take inputs of widths {a.shape[-1]} + {b.shape[-1]}")
    if implementation == "xla":
        return _linear(jnp.concatenate([rms_norm(a, a_norm, eps), rms_norm(b, b_norm, eps)], axis=-1), weight)
    return _call(_norm_pair_linear_kernel, "norm_pair_linear", a, (b.reshape(-1, b.shape[-1]), a_norm, b_norm, weight),
                 weight.shape[1], interpret, tiling, eps=eps)


def norm_gate_up(x: jax.Array, norm_weight: jax.Array, eps: float, weight_gate_up: jax.Array, *,
                 parts: jax.Array | None = None, implementation: str = "xla", interpret: bool | None = None,
                 tiling: Tiling = Tiling()):
    """silu(gate) * up of [gate | up] = rmsnorm(x) @ weight_gate_up: a SwiGLU MLP's first half.

    Args:
        x: [..., K] activations.
        norm_weight: [K] RMSNorm scale; eps: its epsilon.
        weight_gate_up: [K, 2F], gate's columns then up's (`layers.MLP.gate_up_proj`).
        parts, implementation, interpret, tiling: as `norm_linear`.
    Returns:
        [..., F] in x's dtype; with parts, (that, the input `add_parts(x, parts)`).
    """
    _check(implementation, x, weight_gate_up, parts)
    if weight_gate_up.shape[1] % 2:
        raise ValueError(f"gate_up weight needs an even number of columns, got {weight_gate_up.shape}")
    if implementation == "xla":
        normed = x if parts is None else add_parts(x, parts)
        gate, up = jnp.split(_linear(rms_norm(normed, norm_weight, eps), weight_gate_up), 2, axis=-1)
        out = jax.nn.silu(gate) * up
        return out if parts is None else (out, normed)
    return _call(_norm_gate_up_kernel, "norm_gate_up", x, (norm_weight, weight_gate_up), weight_gate_up.shape[1] // 2,
                 interpret, tiling, parts, eps=eps)


def linear_residual(x: jax.Array, weight: jax.Array, residual: jax.Array, *, implementation: str = "xla",
                    interpret: bool | None = None, tiling: Tiling = Tiling()) -> jax.Array:
    """residual + x @ weight: a bias-free linear layer closing a residual branch (o_proj, down_proj).

    Args:
        x: [..., K] activations.
        weight: [K, N].
        residual: [..., N] in x's dtype.
        implementation, interpret, tiling: as `norm_linear`.
    Returns:
        [..., N] in x's dtype.
    """
    _check(implementation, x, weight)
    if residual.shape != (*x.shape[:-1], weight.shape[1]):
        raise ValueError(f"residual shape {residual.shape} does not fit x {x.shape} @ weight {weight.shape}")
    if implementation == "xla":
        return residual + _linear(x, weight)
    rows = residual.reshape(-1, weight.shape[1])  # [M, N]
    return _call(_linear_residual_kernel, "linear_residual", x, (weight, rows), weight.shape[1], interpret, tiling)


def linear_parts(x: jax.Array, weight: jax.Array, *, implementation: str = "xla", interpret: bool | None = None,
                 tiling: Tiling = Tiling()) -> jax.Array:
    """x @ weight as float32 partial sums over K, for `norm_linear` or `norm_gate_up` to add.

    Args:
        x: [..., K] activations.
        weight: [K, N].
        implementation, interpret, tiling: as `norm_linear`.
    Returns:
        [S, ..., N] float32 whose sum over S is x @ weight: S = 1 for "xla"; for "pallas" one part
        per tiling.block_k chunk of K, each from its own programs.
    """
    _check(implementation, x, weight)
    if implementation == "xla":
        return _linear(x, weight, jnp.float32)[None]
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    if tiling.block_m is None:
        tiling = dataclasses.replace(tiling, block_m=row_block(rows.shape[0]))
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    parts = _split_k_call(rows, weight, interpret=interpret, tiling=tiling)
    return parts.reshape(parts.shape[0], *x.shape[:-1], weight.shape[1])


def add_parts(residual: jax.Array, parts: jax.Array) -> jax.Array:
    """residual + round(sum of parts) in residual's dtype: `linear_residual` from `linear_parts`'s
    output. The sum is rounded to the dtype before the add, as the unfused linear layer's output is."""
    dtype = residual.dtype
    total = jnp.sum(parts, axis=0).astype(dtype).astype(jnp.float32)
    return (residual.astype(jnp.float32) + total).astype(dtype)


# ---- the XLA reference ---------------------------------------------------------------------

def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """`layers.RMSNorm` computing in x's dtype: normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * x32.astype(x.dtype)


def _linear(x: jax.Array, weight: jax.Array, out_dtype=None) -> jax.Array:
    """A bias-free `nnx.Linear` computing in x's dtype (its output in out_dtype, default x's)."""
    return lax.dot_general(x, weight.astype(x.dtype), (((x.ndim - 1,), (0,)), ((), ())),
                           preferred_element_type=out_dtype)


def _check(implementation: str, x: jax.Array, weight: jax.Array, parts: jax.Array | None = None,
           weight_scale: jax.Array | None = None) -> None:
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"unknown implementation {implementation!r} ({', '.join(IMPLEMENTATIONS)})")
    if weight.ndim != 2 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight shape {weight.shape} does not take inputs of shape {x.shape}")
    if (weight.dtype == jnp.int8) != (weight_scale is not None):
        raise ValueError(f"an int8 weight needs its weight_scale, and only an int8 weight takes one "
                         f"(weight {weight.dtype}, weight_scale {None if weight_scale is None else weight_scale.shape})")
    if weight_scale is not None and (weight_scale.shape != (weight.shape[1],) or weight_scale.dtype != jnp.float32):
        raise ValueError(f"weight_scale {weight_scale.shape} {weight_scale.dtype} is not float32 [{weight.shape[1]}]: "
                         "one scale an output column")
    if parts is not None and (parts.shape[1:] != x.shape or parts.dtype != jnp.float32):
        raise ValueError(f"parts {parts.shape} {parts.dtype} are not float32 partial sums of x {x.shape}")


# ---- the Pallas kernels --------------------------------------------------------------------

def _call(kernel, name: str, x: jax.Array, operands: tuple, width: int, interpret: bool | None,
          tiling: Tiling, parts: jax.Array | None = None, out_dtype=None, **params):
    """Runs `kernel(x [M, K], *operands, out [M, width], tiling=..., **params)` over (row blocks,
    column blocks); `params` are the kernel's static settings (hashable); out in out_dtype (None:
    x's). With parts [S, ..., K], `kernel(x, parts [S, M, K], *operands, out, summed [M, K], ...)`,
    returning (out, summed)."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    if tiling.block_m is None:
        tiling = dataclasses.replace(tiling, block_m=row_block(rows.shape[0]))
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    if parts is not None:
        operands = (parts.reshape(parts.shape[0], *rows.shape), *operands)
    out = _pallas_call(rows, *operands, kernel=kernel, name=name, width=width, interpret=interpret, tiling=tiling,
                       summed=parts is not None, params=tuple(sorted(params.items())),
                       out_dtype=jnp.dtype(out_dtype or x.dtype))
    if parts is None:
        return out.reshape(*x.shape[:-1], width)
    out, summed, _ = out  # the third: the programs' own copies of their input
    return out.reshape(*x.shape[:-1], width), summed.reshape(x.shape)


# Under jit, with everything but the arrays static: a pallas_call traces its kernel and lowers it to
# Triton each time it is called, and a decode step calls these kernels four times a layer. Jitted,
# the calls of one shape and setting are traced once and lowered once per program (a function the
# program calls at each layer): SmolLM2's 30-layer verify forward lowered in 1.0 s instead of 10.2.
@functools.partial(jax.jit, static_argnames=("kernel", "name", "width", "interpret", "tiling", "summed", "params",
                                             "out_dtype"))
def _pallas_call(rows: jax.Array, *operands: jax.Array, kernel, name: str, width: int, interpret: bool,
                 tiling: Tiling, summed: bool, params: tuple, out_dtype):
    out_shape = jax.ShapeDtypeStruct((rows.shape[0], width), out_dtype)
    grid = (pl.cdiv(rows.shape[0], tiling.block_m), pl.cdiv(width, tiling.block_n))
    if summed:  # operands start with the parts; outputs: the input's sum, and a copy of it a column block
        out_shape = (out_shape, jax.ShapeDtypeStruct(rows.shape, rows.dtype),
                     jax.ShapeDtypeStruct((grid[1], *rows.shape), rows.dtype))

    def body(x_ref, *refs):
        if not summed:
            return kernel(x_ref, *refs, tiling=tiling, **dict(params))
        parts_ref, *refs, summed_ref, copies_ref = refs
        # (interpret mode runs a program's threads as one: no barrier, which it could not lower)
        return kernel(x_ref, *refs, tiling=tiling, sums=(parts_ref, summed_ref, copies_ref, not interpret),
                      **dict(params))

    return pl.pallas_call(
        body,
        out_shape=out_shape,
        grid=grid,
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        interpret=interpret,
        name=name,
    )(rows, *operands)


@functools.partial(jax.jit, static_argnames=("interpret", "tiling"))
def _split_k_call(rows: jax.Array, weight: jax.Array, *, interpret: bool, tiling: Tiling) -> jax.Array:
    """[S, M, N] float32: part s = rows[:, chunk s] @ weight[chunk s, :], chunks of block_k features."""
    size, width = weight.shape
    splits = pl.cdiv(size, tiling.block_k)
    return pl.pallas_call(
        functools.partial(_linear_part_kernel, tiling=tiling),
        out_shape=jax.ShapeDtypeStruct((splits, rows.shape[0], width), jnp.float32),
        grid=(pl.cdiv(rows.shape[0], tiling.block_m), pl.cdiv(width, tiling.block_n), splits),
        compiler_params=plgpu.CompilerParams(num_warps=tiling.num_warps, num_stages=tiling.num_stages),
        interpret=interpret,
        name="linear_parts",
    )(rows, weight)


def row_block(rows: int) -> int:
    """Rows per program for M rows: one block holding them all (a power of two >= 16, Triton's
    dot), at most MAX_ROWS; more rows take several blocks."""
    return min(max(16, pl.next_power_of_2(rows)), MAX_ROWS)


def _mask(start, shape, limits) -> jax.Array:
    """[shape] bool: which elements of the tile at `start` lie inside `limits` (2-D)."""
    rows = start[0] + jnp.arange(shape[0]) < limits[0]
    columns = start[1] + jnp.arange(shape[1]) < limits[1]
    return rows[:, None] & columns[None, :]


def _window(ref, start, shape, part=None):
    """The 2-D window ref[start : start + shape] of a [rows, columns] ref, or of part `part` of
    a [parts, rows, columns] one."""
    index = (pl.ds(start[0], shape[0]), pl.ds(start[1], shape[1]))
    return ref.at[index if part is None else (part, *index)]


def _tile(ref, start, shape, limits=None, part=None) -> jax.Array:
    """ref[start : start + shape] (2-D; of part `part` of a 3-D ref), zeros outside `limits`
    (default: the window's array's shape)."""
    mask = _mask(start, shape, limits or ref.shape[-2:])
    return plgpu.load(_window(ref, start, shape, part), mask=mask, other=0.0)


def _vector(ref, start, size: int) -> jax.Array:
    """ref[start : start + size] (1-D), zeros past the end."""
    return plgpu.load(ref.at[pl.ds(start, size)], mask=start + jnp.arange(size) < ref.shape[0], other=0.0)


def _store(ref, start, value: jax.Array, part=None, when=True) -> None:
    """ref[start : start + value.shape] = value (2-D; of part `part` of a 3-D ref) inside the
    array, where `when` holds."""
    mask = _mask(start, value.shape, ref.shape[-2:]) & when
    plgpu.store(_window(ref, start, value.shape, part), value, mask=mask)


def _origin(tiling: Tiling) -> tuple[jax.Array, jax.Array]:
    """(first row, first output column) of this program's output block."""
    return pl.program_id(0) * tiling.block_m, pl.program_id(1) * tiling.block_n


def _summed_input(x_ref, parts_ref, row: jax.Array, k: jax.Array, tiling: Tiling) -> jax.Array:
    """[block_m, block_k] of x plus the rounded sum of its parts (`add_parts`) from feature k on, in x's dtype."""
    x = _tile(x_ref, (row, k), (tiling.block_m, tiling.block_k))
    total = sum(_tile(parts_ref, (row, k), (tiling.block_m, tiling.block_k), part=jnp.int32(part))
                for part in range(parts_ref.shape[0]))
    dtype = x_ref.dtype
    return (x.astype(jnp.float32) + total.astype(dtype).astype(jnp.float32)).astype(dtype)


def _inverse_rms(x_ref, row: jax.Array, eps: float, tiling: Tiling, sums=None):
    """[block_m, 1] float32 1 / rms of the program's rows of the input [M, K], and where the
    weights' loop reads the input from (a function of k: the program's [block_m, block_k] from
    feature k on): x_ref, or with sums = (parts, summed and copies refs, barrier) the program's own
    copy of x + its parts (barrier: whether the program's threads need one between storing that
    copy and reading it; interpret mode runs them as one).

    With parts, the sum is made here, once, and stored twice: by the first column block's
    programs as the summed output, and by every program into its own copy, which its weights'
    loop then reads as it would read x. Summing in that loop instead had Triton's software
    pipelining stage every part's chunk in shared memory (254 KB asked of an H100's 227 KB).
    """
    size = x_ref.shape[1]
    parts_ref, summed_ref, copies_ref, barrier = sums or (None, None, None, False)
    # Unrolled (K is static and a few chunks long): the chunks' loads are issued together, one
    # memory round trip before the weights' loop starts instead of one a chunk.
    total = jnp.zeros((tiling.block_m, 1), jnp.float32)
    for chunk in range(pl.cdiv(size, tiling.block_k)):  # a traced start: the last chunk's edge is masked
        k = jnp.int32(chunk * tiling.block_k)
        if parts_ref is None:
            x = _tile(x_ref, (row, k), (tiling.block_m, tiling.block_k))
        else:
            x = _summed_input(x_ref, parts_ref, row, k, tiling)
            _store(summed_ref, (row, k), x, when=pl.program_id(1) == 0)
            _store(copies_ref, (row, k), x, part=pl.program_id(1))
        x = x.astype(jnp.float32)
        total = total + jnp.sum(x * x, axis=1, keepdims=True)
    shape = (tiling.block_m, tiling.block_k)
    if parts_ref is None:
        return lax.rsqrt(total / size + eps), lambda k: _tile(x_ref, (row, k), shape)
    if barrier:  # the program's stores to its copy, by all its threads, before any reads them
        plgpu.debug_barrier()
    program = pl.program_id(1)  # read here: the loop's body is its own function
    return lax.rsqrt(total / size + eps), lambda k: _tile(copies_ref, (row, k), shape, part=program)


def _normed(load, dtype, norm_ref, k: jax.Array, inverse_rms: jax.Array, tiling: Tiling) -> jax.Array:
    """[block_m, block_k] of rmsnorm(x) in dtype, from feature k on (x's from `load(k)`), rounded as
    `rms_norm` rounds."""
    return _rounded_norm(load(k), _vector(norm_ref, k, tiling.block_k), inverse_rms, dtype)


def _rounded_norm(x: jax.Array, scale: jax.Array, inverse_rms: jax.Array, dtype) -> jax.Array:
    """scale [F] x (x [M, F] x inverse_rms [M, 1]) in dtype, rounded as `rms_norm` rounds."""
    scale = scale.astype(dtype).astype(jnp.float32)
    # The product of two dtype values is exact in float32, so rounding it once equals a
    # multiplication in dtype (math is done in float32: Triton lacks most bf16 arithmetic).
    return (scale[None, :] * (x.astype(jnp.float32) * inverse_rms).astype(dtype).astype(jnp.float32)).astype(dtype)


def _normed_columns(x_ref, norm_ref, rows: jax.Array, columns: jax.Array, inverse_rms: jax.Array, dtype) -> jax.Array:
    """[M, F] of rmsnorm(x) at `rows` and `columns` (zeros outside x; columns may run below 0 or past
    its width), loaded by index: a window starting below 0 would be clamped in interpret mode."""
    in_rows, in_columns = rows < x_ref.shape[0], (columns >= 0) & (columns < x_ref.shape[1])
    row_index, column_index = jnp.clip(rows, 0, x_ref.shape[0] - 1), jnp.clip(columns, 0, x_ref.shape[1] - 1)
    x = plgpu.load(x_ref.at[row_index[:, None], column_index[None, :]], mask=in_rows[:, None] & in_columns[None, :],
                   other=0.0)
    scale = plgpu.load(norm_ref.at[column_index], mask=in_columns, other=0.0)
    return _rounded_norm(x, scale, inverse_rms, dtype)


def _project(rows_at, w_ref, columns, tiling: Tiling) -> tuple[jax.Array, ...]:
    """sum over k of rows_at(k) [block_m, block_k] @ w[k : k + block_k, start : start + block_n].

    One float32 [block_m, block_n] result per (start, limit) in `columns`; weight columns at or
    past `limit` read as zeros. The strips share each chunk of rows.
    """
    size = w_ref.shape[0]
    block_k, block_n = tiling.block_k, tiling.block_n

    def accumulate(chunk, sums):
        k = chunk * block_k
        rows = rows_at(k)
        strips = [_tile(w_ref, (k, start), (block_k, block_n), (size, limit)).astype(rows.dtype)
                  for start, limit in columns]
        return tuple(total + jnp.dot(rows, strip, preferred_element_type=jnp.float32)
                     for total, strip in zip(sums, strips))

    zeros = jnp.zeros((tiling.block_m, block_n), jnp.float32)
    return lax.fori_loop(0, pl.cdiv(size, block_k), accumulate, (zeros,) * len(columns))


def _norm_linear_kernel(x_ref, norm_ref, w_ref, *refs, eps: float, tiling: Tiling, sums=None):
    """refs: (out,), or (scale, out) over an int8 weight (widened to x's dtype, exactly), its float32
    sums times the columns' scales."""
    *scale_ref, out_ref = refs
    row, column = _origin(tiling)
    inverse_rms, load = _inverse_rms(x_ref, row, eps, tiling, sums)
    normed = lambda k: _normed(load, x_ref.dtype, norm_ref, k, inverse_rms, tiling)
    [out] = _project(normed, w_ref, [(column, w_ref.shape[1])], tiling)
    for scale in scale_ref:
        out = out * _vector(scale, column, tiling.block_n)[None, :]
    _store(out_ref, (row, column), out.astype(out_ref.dtype))


def _norm_pair_linear_kernel(a_ref, b_ref, a_norm_ref, b_norm_ref, w_ref, out_ref, *, eps: float, tiling: Tiling):
    """Features [0, Ka) of the weights' input are a's, [Ka, Ka + Kb) b's: a chunk of K may hold both."""
    row, column = _origin(tiling)
    inverse_a, _ = _inverse_rms(a_ref, row, eps, tiling)
    inverse_b, _ = _inverse_rms(b_ref, row, eps, tiling)
    rows, width_a, dtype = row + jnp.arange(tiling.block_m), a_ref.shape[1], a_ref.dtype

    def normed(k):
        features = k + jnp.arange(tiling.block_k)
        a = _normed_columns(a_ref, a_norm_ref, rows, features, inverse_a, dtype)
        b = _normed_columns(b_ref, b_norm_ref, rows, features - width_a, inverse_b, dtype)
        return jnp.where((features < width_a)[None, :], a, b)

    [out] = _project(normed, w_ref, [(column, w_ref.shape[1])], tiling)
    _store(out_ref, (row, column), out.astype(out_ref.dtype))


def _norm_gate_up_kernel(x_ref, norm_ref, w_ref, out_ref, *, eps: float, tiling: Tiling, sums=None):
    row, column = _origin(tiling)
    width = out_ref.shape[1]  # F: gate is w[:, :F], up is w[:, F:]
    inverse_rms, load = _inverse_rms(x_ref, row, eps, tiling, sums)
    normed = lambda k: _normed(load, x_ref.dtype, norm_ref, k, inverse_rms, tiling)
    gate, up = _project(normed, w_ref, [(column, width), (width + column, 2 * width)], tiling)
    # Rounded to dtype first, as the unfused gate_up_proj output is; the activation in float32.
    gate, up = (part.astype(out_ref.dtype).astype(jnp.float32) for part in (gate, up))
    _store(out_ref, (row, column), (jax.nn.silu(gate) * up).astype(out_ref.dtype))


def _linear_residual_kernel(x_ref, w_ref, residual_ref, out_ref, *, tiling: Tiling):
    row, column = _origin(tiling)
    rows = lambda k: _tile(x_ref, (row, k), (tiling.block_m, tiling.block_k))
    # Loaded before the weights' loop, so its round trip overlaps the loop instead of following it.
    residual = _tile(residual_ref, (row, column), (tiling.block_m, tiling.block_n)).astype(jnp.float32)
    [out] = _project(rows, w_ref, [(column, w_ref.shape[1])], tiling)
    # Rounded to dtype before the add, as the unfused linear layer's output is.
    _store(out_ref, (row, column), (out.astype(out_ref.dtype).astype(jnp.float32) + residual).astype(out_ref.dtype))


def _linear_part_kernel(x_ref, w_ref, out_ref, *, tiling: Tiling):
    """One block_k chunk of K: no loop, a single round trip for its rows and its weight strip."""
    row, column = _origin(tiling)
    part = pl.program_id(2)
    k = part * tiling.block_k
    rows = _tile(x_ref, (row, k), (tiling.block_m, tiling.block_k))
    strip = _tile(w_ref, (k, column), (tiling.block_k, tiling.block_n)).astype(rows.dtype)
    _store(out_ref, (row, column), jnp.dot(rows, strip, preferred_element_type=jnp.float32), part=part)
