"""Llama building blocks: RMSNorm, attention over a KV cache, MLP, the decoder layer, and which
kernels (XLA's or the fused Pallas ones) its cached calls run.

Rotary embeddings live in `rotary`, the cache-free attention of training in `causal_attention`.
Submodule and parameter names follow HF (`self_attn.o_proj`, `mlp.down_proj`, ...) so that
weight conversion is a short table; HF's q/k/v and gate/up projections are stored fused
(`self_attn.qkv_proj`, `mlp.gate_up_proj`), concatenated along the output axis.
Einsum letters: B batch, T query, S key, D model, N query heads, K kv heads, G group,
H head dim, F feed-forward.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from eagle_jax.model import attention_ops
from eagle_jax.model import causal_attention
from eagle_jax.model import config as config_lib
from eagle_jax.model import rotary
from eagle_jax.kernels import decode_attention
from eagle_jax.kernels import fused_linear

# Settings of `Kernels.decode_kernels`: XLA alone; every fused Pallas kernel; or the fused linear
# kernels around XLA's attention (in a whole step the attention kernel cost 24-27 us a layer on a
# 6-token verify, where speculation with every kernel ran slower than with XLA's alone:
# docs/BENCHMARKS.md).
DECODE_KERNELS = ("xla", "pallas", "pallas_linear")


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Which kernels cached (decode) calls run: a static argument of every forward, so part of
    every program compiled from it.

    "xla" (default): norms, projections and attention as XLA compiles them. "pallas": fused Pallas
    kernels (`kernels.fused_linear`, `kernels.decode_attention`) in cached calls of up to
    `fused_linear.MAX_ROWS` rows (five per target layer, a tree's verify included; a head's MLP
    and attention too), and the attention kernel alone in larger ones (`uses_attention_kernel`).
    "pallas_linear": the fused linears with XLA's attention between them. Either Pallas setting
    compacts a tree's accepted path in one kernel (`kernels.compact_cache`); off a GPU they run in
    interpret mode. `attention_tiling`: the attention kernel's block size and launch settings
    ("pallas" only; None: `decode_attention.Tiling.for_rows`).
    """

    decode_kernels: str = "xla"
    attention_tiling: decode_attention.Tiling | None = None

    def __post_init__(self):
        if self.decode_kernels not in DECODE_KERNELS:
            raise ValueError(f"decode_kernels must be one of {DECODE_KERNELS}, got {self.decode_kernels!r}")
        if self.attention_tiling is not None and self.decode_kernels != "pallas":
            raise ValueError(f"an attention tiling sets the Pallas attention kernel, which decode_kernels="
                             f"{self.decode_kernels!r} does not run")


XLA = Kernels()


def fused_kernels(decode_kernels: str) -> str:
    """The implementation ("xla" or "pallas") of the kernels a `decode_kernels` setting runs
    besides attention: `kernels.fused_linear`, and `kernels.compact_cache` after a tree's verify."""
    return "xla" if decode_kernels == "xla" else "pallas"


class RMSNorm(nnx.Module):
    """HF LlamaRMSNorm: normalise in float32, cast back, then scale."""

    def __init__(self, size: int, eps: float, *, dtype=jnp.float32, param_dtype=jnp.float32):
        self.weight = nnx.Param(jnp.ones((size,), param_dtype))
        self.eps = eps
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...].astype(self.dtype) * x32.astype(self.dtype)


class SlotMask(NamedTuple):
    """A cache layout other than "position p lives in slot p, sees slots <= p": tree attention.

    A tree's nodes share positions (siblings sit at the same depth), so a node's slot can no
    longer be its position, nor can causality follow from slot order.

    Attributes:
        start: [B] int32 slot where the T new keys and values are written, consecutively.
        visible: [B, T, S] bool: the cache slots each new query attends to (itself included).
        among_new: optional [B, T, T] bool, visible's part among the T new slots, given where that
            is all the mask changes from the contiguous layout: every query sees every slot before
            start, and positions[:, 0] is start (a tree's verify: its root sits at its write slot).
            With it the Pallas attention kernel can run the call (`uses_attention_kernel`).
    """

    start: jax.Array
    visible: jax.Array
    among_new: jax.Array | None = None


def qkv_sizes(cfg: config_lib.LlamaConfig) -> tuple[int, int, int]:
    """Output widths of q, k and v inside the fused `qkv_proj` (HF's q_proj, k_proj, v_proj)."""
    return cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim


def gate_up_sizes(cfg: config_lib.LlamaConfig) -> tuple[int, int]:
    """Output widths of gate and up inside the fused `gate_up_proj` (HF's gate_proj, up_proj)."""
    return cfg.intermediate_size, cfg.intermediate_size


class Attention(nnx.Module):
    """Grouped-query self-attention over an explicit, statically shaped KV cache."""

    def __init__(self, cfg: config_lib.LlamaConfig, *, input_size: int | None = None, rngs: nnx.Rngs,
                 dtype=jnp.float32, param_dtype=jnp.float32):
        input_size = input_size or cfg.hidden_size
        linear = lambda i, o, bias: nnx.Linear(i, o, use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        # q, k and v in one matrix: one matmul instead of three per layer (fewer, larger
        # kernels; at batch 1 a decode step is a chain of small memory-bound matvecs).
        self.qkv_proj = linear(input_size, sum(qkv_sizes(cfg)), cfg.attention_bias)
        self.o_proj = linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.attention_bias)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # Blocks the fused output axis is laid out in: P under tensor parallelism, where block p
        # holds device p's own q, k and v heads (`sharding.shard_target` reorders and sets it).
        self.num_shards = 1
        # Hashable rope settings, not an array: module attributes that are not Params are static.
        self.rope = (cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)

    def project(self, x: jax.Array, positions: jax.Array):
        """Queries [B, T, N, H], keys and values [B, T, K, H] of the inputs, rotary applied."""
        return self.split_heads(self.qkv_proj(x), positions)

    def split_heads(self, qkv: jax.Array, positions: jax.Array):
        """`project` from qkv_proj's output [B, T, (N + 2K) H]."""
        batch, length, _ = qkv.shape
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        fused = qkv.reshape(batch, length, self.num_shards, -1)  # [B, T, P, (N + 2K) H / P]
        q, k, v = jnp.split(fused, [q_size // self.num_shards, (q_size + kv_size) // self.num_shards], axis=-1)
        q = q.reshape(batch, length, self.num_heads, self.head_dim)
        k = k.reshape(batch, length, self.num_kv_heads, self.head_dim)
        v = v.reshape(batch, length, self.num_kv_heads, self.head_dim)
        inv_freq = rotary.rope_inverse_frequencies(*self.rope)
        rotate = lambda x: rotary.apply_rotary(x, positions, inv_freq)
        return rotate(q), rotate(k), v

    def __call__(self, x: jax.Array, positions: jax.Array, keys: jax.Array | None, values: jax.Array | None,
                 implementation: str = "xla", mask: SlotMask | None = None, attend_length: int | None = None):
        """Attends T new tokens to the cache after writing their keys and values into it.

        Args:
            x: [B, T, input_size] inputs.
            positions: [B, T] int32 positions, contiguous per row; they are also the cache slots.
            keys, values: [B, S, K, H] this layer's cache, or None for cache-free causal
                self-attention among the inputs (then None is returned for both).
            implementation: of the cache-free attention (`causal_attention.causal_attention`).
            mask: where to write and what to see when positions are not slots (a tree's nodes).
            attend_length: read only cache slots [0, attend_length) (None: all S). The caller
                guarantees that every visible slot lies below it; the writes may go anywhere.

        Returns:
            ([B, T, D] output, updated keys, updated values). Without a mask, slot s is visible
            to a query at position p iff s <= p, so stale entries past a row's cursor are never read.
        """
        q, k, v = self.project(x, positions)
        if keys is None:  # no cache: causal self-attention over the T inputs (training features)
            return self.output(causal_attention.causal_attention(q, k, v, implementation)), None, None
        attended, keys, values = self.attend(q, k, v, positions, keys, values, mask, attend_length)
        return self.output(attended), keys, values

    def attend(self, q, k, v, positions: jax.Array, keys: jax.Array, values: jax.Array, mask: SlotMask | None = None,
               attend_length: int | None = None):
        """Writes k and v [B, T, K, H] into the cache [B, S, K, H], then attends q [B, T, N, H] over
        its first `attend_length` slots (all S if None).

        Returns:
            (attended values [B, T, N, H] before o_proj, updated keys, updated values).
        """
        start = positions[:, 0] if mask is None else mask.start
        keys = attention_ops.write_rows(keys, k, start)
        values = attention_ops.write_rows(values, v, start)
        # Attention cost grows with the slots it reads: a cache sized for the longest request
        # would otherwise be read whole at every step, filled or not.
        read = keys.shape[1] if attend_length is None else attend_length
        if mask is None:
            slots = jnp.arange(read, dtype=jnp.int32)
            visible = slots[None, None, :] <= positions[:, :, None]  # [B, T, read]
        else:
            visible = mask.visible[..., :read]
        return attention_ops.grouped_attention(q, keys[:, :read], values[:, :read], visible), keys, values

    def output(self, attended: jax.Array) -> jax.Array:
        """o_proj of attended values [B, T, N, H]."""
        batch, length = attended.shape[:2]
        return self.o_proj(attended.reshape(batch, length, self.num_heads * self.head_dim))


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: config_lib.LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        linear = lambda i, o: nnx.Linear(i, o, use_bias=cfg.mlp_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_up_proj = linear(cfg.hidden_size, sum(gate_up_sizes(cfg)))  # gate and up, fused like q/k/v
        self.down_proj = linear(cfg.intermediate_size, cfg.hidden_size)
        self.num_shards = 1  # blocks [gate_p | up_p] of gate_up_proj's output, as in `Attention`

    def __call__(self, x: jax.Array) -> jax.Array:
        fused = self.gate_up_proj(x).reshape(*x.shape[:-1], self.num_shards, -1)  # [..., P, 2F / P]
        gate, up = jnp.split(fused, 2, axis=-1)
        return self.down_proj((jax.nn.silu(gate) * up).reshape(*x.shape[:-1], -1))


class DecoderLayer(nnx.Module):
    """Pre-norm Llama decoder layer."""

    def __init__(self, cfg: config_lib.LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        kw = dict(dtype=dtype, param_dtype=param_dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.self_attn = Attention(cfg, rngs=rngs, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = MLP(cfg, rngs=rngs, **kw)

    def __call__(self, x, positions, keys, values, implementation: str = "xla", mask: SlotMask | None = None,
                 attend_length: int | None = None, kernels: Kernels = XLA, pending: bool = False):
        """x: [B, T, D], or a `PendingResidual`. pending: the fused linear kernels may return a
        `PendingResidual` for the next layer to sum (a caller that reads the output itself
        leaves it False)."""
        attention = self.self_attn
        linears = (attention.qkv_proj, attention.o_proj, self.mlp.gate_up_proj, self.mlp.down_proj)
        # Cached calls only: cache-free calls compute training features, which need gradients
        # (the Pallas kernels define none).
        base = x.base if isinstance(x, PendingResidual) else x
        if keys is not None and uses_decode_kernels(kernels.decode_kernels, base, *linears):
            out, keys, values = self._fused_decode(x, positions, keys, values, mask, attend_length, kernels)
            return (out if pending else summed(out)), keys, values
        x = summed(x)
        if keys is not None and uses_attention_kernel(kernels.decode_kernels, x, mask, attention):
            return self._kernel_decode(x, positions, keys, values, mask, attend_length, kernels)
        attended, keys, values = attention(self.input_layernorm(x), positions, keys, values, implementation, mask,
                                           attend_length)
        x = x + attended
        return residual_mlp(x, self.post_attention_layernorm, self.mlp), keys, values

    def _kernel_decode(self, x, positions, keys, values, mask: SlotMask | None, attend_length: int | None,
                       kernels: Kernels):
        """The cached call with the Pallas attention kernel alone (more rows than the linear
        kernels take), between XLA's norms and matmuls: it reads each row's filled slots only,
        where XLA's attention reads all attend_length of them."""
        attention = self.self_attn
        qkv = attention.qkv_proj(self.input_layernorm(x))
        attended, keys, values = self._attend(qkv, positions, keys, values, mask, attend_length, kernels)
        x = x + attention.output(attended)
        return residual_mlp(x, self.post_attention_layernorm, self.mlp), keys, values

    def _fused_decode(self, x, positions, keys, values, mask: SlotMask | None, attend_length: int | None,
                      kernels: Kernels):
        """The cached call with the fused linear kernels: norm + qkv_proj (summing the previous
        layer's pending residual), attention, o_proj + residual, norm + gate_up_proj + silu,
        down_proj: at one row its partial sums, returned pending; past `SPLIT_K_MAX_ROWS` rows
        down_proj + residual. Five kernels with the attention kernel (and its split's combine)."""
        attention, mlp = self.self_attn, self.mlp
        implementation = fused_kernels(kernels.decode_kernels)
        norm, weight = self.input_layernorm, attention.qkv_proj.kernel[...]
        if isinstance(x, PendingResidual):
            qkv, x = fused_linear.norm_linear(x.base, norm.weight[...], norm.eps, weight, parts=x.parts,
                                              implementation=implementation)
        else:
            qkv = fused_linear.norm_linear(x, norm.weight[...], norm.eps, weight, implementation=implementation)
        attended, keys, values = self._attend(qkv, positions, keys, values, mask, attend_length, kernels)
        x = fused_linear.linear_residual(attended.reshape(*x.shape[:2], -1), attention.o_proj.kernel[...], x,
                                         implementation=implementation)
        norm = self.post_attention_layernorm
        hidden = fused_linear.norm_gate_up(x, norm.weight[...], norm.eps, mlp.gate_up_proj.kernel[...],
                                           implementation=implementation)
        if not splits_down_proj(x):
            return fused_linear.linear_residual(hidden, mlp.down_proj.kernel[...], x,
                                                implementation=implementation), keys, values
        down_parts = fused_linear.linear_parts(hidden, mlp.down_proj.kernel[...], implementation=implementation)
        return PendingResidual(x, down_parts), keys, values

    def _attend(self, qkv, positions, keys, values, mask: SlotMask | None, attend_length: int | None,
                kernels: Kernels):
        """Attention from the fused [q | k | v] projection: the Pallas kernel where
        `uses_attention_kernel` says so (a tree's verify too when its SlotMask carries `among_new`:
        the kernel then reads which new tokens a query sees from it); other masks, and every call
        under "pallas_linear", attend in XLA."""
        attention = self.self_attn
        if uses_attention_kernel(kernels.decode_kernels, qkv, mask, attention):
            return kernel_attend(attention, qkv, positions, keys, values, mask, attend_length, kernels.attention_tiling)
        q, k, v = attention.split_heads(qkv, positions)
        return attention.attend(q, k, v, positions, keys, values, mask, attend_length)


# down_proj runs split-K (`fused_linear.linear_parts`) in calls of at most this many token rows.
# H100, 2026-12-06 (`tools/gpu/step_levers.sh ab`, docs/benchmarks.md): a plain step ran 745-753 us
# split against 775-800 whole, while an EAGLE-3 k = 6 step, whose 7-row verify then split too,
# kept 20 us more busy time (996 against 975-976).
SPLIT_K_MAX_ROWS = 1
# A draft head's MLP (`residual_mlp`) adds its parts in XLA either way, so a chain's first draft
# forward over k + 1 = 7 pending pairs splits too: on an H100 (2026-12-07, `step_levers.sh ab`)
# the shipped EAGLE-3 head's 7-row down_proj (K = 3,072) took 8.4 us in whole columns, and the
# k = 6 step's busy time fell by 4 us split.
HEAD_SPLIT_K_MAX_ROWS = 8


def splits_down_proj(x: jax.Array, max_rows: int = SPLIT_K_MAX_ROWS) -> bool:
    """Whether a fused call on x [..., D] runs down_proj split-K: at most `max_rows` token rows
    (`SPLIT_K_MAX_ROWS` in a target layer, `HEAD_SPLIT_K_MAX_ROWS` in a draft head's MLP)."""
    return math.prod(x.shape[:-1]) <= max_rows


class PendingResidual(NamedTuple):
    """A residual stream not summed yet: base + round(sum of parts) (`fused_linear.add_parts`).

    A target layer on the fused kernels ends in a split-K down_proj (`fused_linear.linear_parts`)
    whose float32 parts [S, B, T, D] the next layer's first kernel sums as it loads its input,
    so the sum needs no kernel of its own; `summed` adds them up in XLA where a caller reads
    the stream (the final norm, EAGLE-3's captured features).
    """

    base: jax.Array
    parts: jax.Array

    def value(self) -> jax.Array:
        return fused_linear.add_parts(self.base, self.parts)


def summed(x) -> jax.Array:
    """x itself, or a `PendingResidual`'s value."""
    return x.value() if isinstance(x, PendingResidual) else x


class NormedInputs(NamedTuple):
    """An attention's input [norm_0(x_0); norm_1(x_1); ...] not normed yet: a draft head's cached call
    hands it to q/k/v's fused kernel (`project_qkv`), which norms (and concatenates) as it loads.
    EAGLE-3's midlayer reads two (the token embedding and the feature), a plain layer one."""

    inputs: tuple[jax.Array, ...]
    norms: tuple[RMSNorm, ...]

    def value(self) -> jax.Array:
        return jnp.concatenate([norm(x) for x, norm in zip(self.inputs, self.norms)], axis=-1)


def normed_inputs(inputs: tuple[jax.Array, ...], norms: tuple[RMSNorm, ...], decode_kernels: str = "xla"):
    """[norm_0(x_0); ...] as `NormedInputs` where the fused kernels may take it (`project_qkv` norms it
    in q/k/v's kernel), else its value now."""
    x = NormedInputs(inputs, norms)
    return x if uses_decode_kernels(decode_kernels, inputs[0]) else x.value()


def input_value(x) -> jax.Array:
    """x itself, or a `NormedInputs`' value."""
    return x.value() if isinstance(x, NormedInputs) else x


def project_qkv(attention: Attention, x, decode_kernels: str = "xla") -> jax.Array:
    """qkv_proj of x (an array or `NormedInputs`): the norms in the projection's kernel where
    `uses_decode_kernels` says so (`fused_linear.norm_linear`, `norm_pair_linear`)."""
    if not isinstance(x, NormedInputs):
        return attention.qkv_proj(x)
    first, weight = x.inputs[0], attention.qkv_proj.kernel[...]
    if (len(x.inputs) > 2 or len({norm.eps for norm in x.norms}) > 1
            or not uses_decode_kernels(decode_kernels, first, attention.qkv_proj)):
        return attention.qkv_proj(x.value())
    implementation, eps = fused_kernels(decode_kernels), x.norms[0].eps
    if len(x.inputs) == 1:
        return fused_linear.norm_linear(first, x.norms[0].weight[...], eps, weight, implementation=implementation)
    (a, b), (a_norm, b_norm) = x.inputs, x.norms
    return fused_linear.norm_pair_linear(a, a_norm.weight[...], b, b_norm.weight[...], eps, weight,
                                         implementation=implementation)


def output_residual(attention: Attention, attended: jax.Array, residual: jax.Array, decode_kernels: str = "xla"):
    """residual + o_proj(attended [B, T, N, H]): one fused kernel where `uses_decode_kernels` says so
    (a draft head's cached call; a target layer's `_fused_decode` does the same in its own order)."""
    if not uses_decode_kernels(decode_kernels, residual, attention.o_proj):
        return residual + attention.output(attended)
    return fused_linear.linear_residual(attended.reshape(*residual.shape[:-1], -1), attention.o_proj.kernel[...],
                                        residual, implementation=fused_kernels(decode_kernels))


def residual_mlp(x: jax.Array, norm: RMSNorm, mlp: MLP, decode_kernels: str = "xla") -> jax.Array:
    """x + mlp(norm(x)), in two fused kernels when `uses_decode_kernels` says so (a draft head's
    MLP). In calls of at most `HEAD_SPLIT_K_MAX_ROWS` rows down_proj runs split-K, its parts added
    in XLA: a whole-column kernel runs few programs over the head's long K (3,072 in the shipped
    EAGLE-3 head's MLP)."""
    if not uses_decode_kernels(decode_kernels, x, mlp.gate_up_proj, mlp.down_proj):
        return x + mlp(norm(x))
    implementation = fused_kernels(decode_kernels)
    hidden = fused_linear.norm_gate_up(x, norm.weight[...], norm.eps, mlp.gate_up_proj.kernel[...],
                                       implementation=implementation)
    if not splits_down_proj(x, HEAD_SPLIT_K_MAX_ROWS):
        return fused_linear.linear_residual(hidden, mlp.down_proj.kernel[...], x, implementation=implementation)
    parts = fused_linear.linear_parts(hidden, mlp.down_proj.kernel[...], implementation=implementation)
    return fused_linear.add_parts(x, parts)


def uses_decode_kernels(decode_kernels: str, x: jax.Array, *linears: nnx.Linear) -> bool:
    """Whether `decode_kernels` ("pallas" or "pallas_linear") replaces these linear layers on inputs x [..., D].

    Only decode steps, at most `fused_linear.MAX_ROWS` rows: there the fused kernels save
    launches, while longer inputs (prefill, training) are large matmuls XLA runs well. Layers
    with biases, or computing in another dtype than x's, keep the XLA path: the kernels have
    no bias and compute in x's dtype.
    """
    rows = math.prod(x.shape[:-1])
    return (decode_kernels != "xla" and rows <= fused_linear.MAX_ROWS
            and all(not l.use_bias and l.dtype == x.dtype for l in linears))


def uses_attention_kernel(decode_kernels: str, x: jax.Array, mask: SlotMask | None, attention: Attention) -> bool:
    """Whether a cached call on x [B, T, D] attends with the Pallas kernel (setting "pallas" only),
    with or without the fused linear kernels around it: a decode step, a chain's verify or a tree's
    (T <= its MAX_TOKENS; a mask only with `among_new`) at any batch, with the unsharded
    [q | k | v] layout the kernel reads."""
    return (decode_kernels == "pallas" and (mask is None or mask.among_new is not None)
            and x.shape[1] <= decode_attention.MAX_TOKENS and attention.num_shards == 1)


def kernel_attend(attention: Attention, qkv: jax.Array, positions: jax.Array, keys: jax.Array, values: jax.Array,
                  mask: SlotMask | None, attend_length: int | None, tiling: decode_attention.Tiling | None):
    """`attention`'s cached attention from qkv_proj's output in the Pallas kernel (where
    `uses_attention_kernel`): (attended [B, T, N, H], keys, values), before o_proj."""
    return decode_attention.attend(
        qkv, positions, keys, values, num_heads=attention.num_heads, num_kv_heads=attention.num_kv_heads,
        head_dim=attention.head_dim, inv_freq=rotary.rope_inverse_frequencies(*attention.rope),
        attend_length=attend_length, implementation="pallas", tiling=tiling,
        new_visible=None if mask is None else mask.among_new)

