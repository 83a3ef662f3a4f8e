"""A Llama decoder stack's one-token decode step in one persistent kernel: every layer, one launch.

At batch 1 a SmolLM2 step on the fused kernels runs ~200 launches of 2-6 us, each reading far
less than its share of the GPU's bandwidth (the weights take ~80 us to read on an H100): the
step is bound by the count and fixed cost of its kernels. Here one launch of as many programs as
the GPU has SMs, all resident at once, walks every layer in five stages and meets at a grid-wide
barrier between stages (a counter in global memory: each program adds one, then waits until all
have): a megakernel after Hazy Research's Llama-1B one, which waits on finer per-stage counters
instead. A layer costs five barriers in place of six launches. Measured on an H100 that does not
pay: a grid barrier costs about what a launch does (1.5-1.8 us), and the kernel runs slower than
the fused kernels (docs/benchmarks.md, "The decode step"); it is kept to measure against.

Stages of layer l, each a loop over work items shared round-robin by the programs; an item is
a few output features (by default as few as leave each program one item, `work_rows`), whose
weight rows (stacked over layers and transposed by `stack_layers`) are contiguous:

  1 qkv      qkv = rmsnorm(x) @ Wqkv (each program recomputes the norm of x: D values)
  2 attend   per (kv head, part of `part_slots` cache slots): rotary of the q heads and the new
             key, an online-softmax partial over the part's older slots; the part holding the
             token's position folds in the new key and value from registers and writes them to
             the cache (no program reads that slot in this launch)
  3 o_proj   each working program merges the partials (log-sum-exp), then x[rows] += attended @ Wo
  4 gate/up  h = silu(rmsnorm(x) @ Wgate) * (rmsnorm(x) @ Wup)
  5 down     x[rows] += h @ Wdown

What a program reads that another wrote in this launch (x, qkv, the partials, h) it loads past
its SM's L1 (volatile loads), after the barrier's acquire. What no program writes (the weights,
the cache's older slots) a program of a stage with one item each (`prefetch`) loads before the
barrier ahead of that stage, so the memory's latency overlaps the wait. Values round to the
weights' dtype where the model's layers round (`layers.DecoderLayer` in that dtype);
accumulation is float32.

The programs must all be resident at once or the first barrier never opens: the grid is at most
the GPU's SM count, one program each, with nothing else running. Pallas interpret mode (CPU
tests) runs programs one after another, so it runs one program, whose barriers never wait.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from eagle_jax.kernels import grid_barrier
from eagle_jax.model import attention_ops

CHUNK = 64  # weight columns a matvec loads at once
STAGES = ("qkv", "attend", "o", "gate_up", "down")  # a layer's, one barrier after each


class StackedLayers(NamedTuple):
    """A decoder stack's weights, stacked over layers, projections transposed to [out, in]."""

    input_norm: jax.Array  # [L, D]
    qkv: jax.Array  # [L, (N + 2K) H, D]
    o: jax.Array  # [L, D, N H]
    post_norm: jax.Array  # [L, D]
    gate: jax.Array  # [L, I, D]
    up: jax.Array  # [L, I, D]
    down: jax.Array  # [L, D, I]


class Work(NamedTuple):
    """Output features of a work item, by projection stage (powers of two)."""

    qkv: int
    o: int
    gate_up: int
    down: int


def work_rows(programs: int, qkv_width: int, hidden: int, inter: int, rows: int | None = None) -> Work:
    """`rows` for every stage, or (None) for each the fewest that leave each program at most one
    item: as many programs as the stage can use, each loading its weights ahead (`prefetch`).
    At SmolLM2's shapes on 132 programs: 8 (qkv, 120 items), 8 (o, 72), 16 (gate/up, 96), 8 (down, 72)."""
    def fewest(features: int) -> int:
        size = 1
        while pl.cdiv(features, size) > programs:
            size *= 2
        return size
    if rows is not None:
        return Work(rows, rows, rows, rows)
    return Work(fewest(qkv_width), fewest(hidden), fewest(inter), fewest(hidden))


def stack_layers(model) -> StackedLayers:
    """The kernel's weights from a `llama.Llama` (no biases, one shard: the HF Llama layout)."""
    cfg, layers = model.config, model.layers
    if cfg.attention_bias or cfg.mlp_bias:
        raise ValueError("the persistent kernel takes layers without biases")
    inter = cfg.intermediate_size
    stack = lambda weight: jnp.stack([weight(layer) for layer in layers])
    return StackedLayers(
        input_norm=stack(lambda layer: layer.input_layernorm.weight[...]),
        qkv=stack(lambda layer: layer.self_attn.qkv_proj.kernel[...].T),
        o=stack(lambda layer: layer.self_attn.o_proj.kernel[...].T),
        post_norm=stack(lambda layer: layer.post_attention_layernorm.weight[...]),
        gate=stack(lambda layer: layer.mlp.gate_up_proj.kernel[...][:, :inter].T),
        up=stack(lambda layer: layer.mlp.gate_up_proj.kernel[...][:, inter:].T),
        down=stack(lambda layer: layer.mlp.down_proj.kernel[...].T))


def decode_layers(x: jax.Array, position: jax.Array, weights: StackedLayers, keys: jax.Array, values: jax.Array, *,
                  num_heads: int, eps: float, inv_freq: np.ndarray, programs: int | None = None,
                  part_slots: int = 256, rows: int | None = None, num_warps: int = 8, prefetch: bool = True,
                  spin: str = "volatile", skip: tuple[str, ...] = (), interpret: bool | None = None):
    """Every layer of one token's decode step.

    Args:
        x: [D] the token's embedding, in the layers' dtype.
        position: int32 scalar, the token's position and cache slot (< S).
        weights: `stack_layers`'s.
        keys, values: [L, S, K, H] the stack's caches; the new key and value are written at
            `position` (in place when donated).
        num_heads, eps, inv_freq: N, the norms' epsilon, rotary's [H/2] inverse frequencies.
        programs: the grid, at most (and by default) the GPU's SMs; 1 in interpret mode, which runs
            programs in turn.
        part_slots: cache slots of an attention work item (a power of two >= 16).
        rows: output features of a projection's work item; None: each stage's own (`work_rows`).
        prefetch: each stage of at most one item a program loads what no program writes in this
            launch (its weights, the older cache slots) before the barrier ahead of it.
        spin: how the barriers poll (`grid_barrier.wait`).
        skip: stages (of `STAGES`) left out, their barriers kept: a timing ablation that tells
            each stage's share of a step; the result is then wrong.
        interpret: Pallas interpret mode; None: unless the default backend is a GPU.
    Returns:
        (x [D] float32 after the last layer, rounded as the layers round it, keys, values).
    """
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    for name, size, least in (("rows", rows or 1, 1), ("part_slots", part_slots, 16)):
        if size < least or size & (size - 1):
            raise ValueError(f"{name} must be a power of two >= {least} (a Triton block), got {size}")
    programs = grid_barrier.grid(programs, interpret)
    if not set(skip) <= set(STAGES):
        raise ValueError(f"skip takes stages of {STAGES}, got {skip}")
    _, qkv_width, hidden = weights.qkv.shape
    work = work_rows(programs, qkv_width, hidden, weights.gate.shape[1], rows)
    frequencies = jnp.asarray(np.concatenate([inv_freq, inv_freq]), jnp.float32)
    return _decode_layers(jnp.reshape(position, (1,)).astype(jnp.int32), frequencies, x, *weights, keys, values,
                          num_heads=num_heads, eps=eps, programs=programs, part_slots=part_slots, work=work,
                          num_warps=num_warps, prefetch=prefetch, spin=spin, skip=tuple(skip), interpret=interpret)


@functools.partial(jax.jit, static_argnames=("num_heads", "eps", "programs", "part_slots", "work", "num_warps",
                                             "prefetch", "spin", "skip", "interpret"))
def _decode_layers(position, frequencies, x, *arrays, num_heads, eps, programs, part_slots, work, num_warps,
                   prefetch, interpret, spin="volatile", skip=()):
    *weights, keys, values = arrays
    weights = StackedLayers(*weights)
    _, qkv_width, hidden = weights.qkv.shape
    num_layers, slots, num_kv_heads, head_dim = keys.shape
    parts = pl.cdiv(slots, part_slots)
    f32 = jnp.float32
    partial_shape = (num_heads, parts)
    out_shape = (jax.ShapeDtypeStruct((hidden,), f32),  # x, the residual stream
                 jax.ShapeDtypeStruct(keys.shape, keys.dtype), jax.ShapeDtypeStruct(values.shape, values.dtype),
                 jax.ShapeDtypeStruct((1,), jnp.int32),  # the barrier's counter
                 jax.ShapeDtypeStruct((qkv_width,), f32),
                 jax.ShapeDtypeStruct((*partial_shape, head_dim), f32),  # attention partials: outputs,
                 jax.ShapeDtypeStruct(partial_shape, f32), jax.ShapeDtypeStruct(partial_shape, f32),  # maxima, sums
                 jax.ShapeDtypeStruct((weights.gate.shape[1],), f32))  # h, the MLP's hidden
    counter = jnp.zeros((1,), jnp.int32)
    first_cache = 3 + len(weights)
    results = pl.pallas_call(
        functools.partial(_kernel, num_heads=num_heads, eps=eps, programs=programs, part_slots=part_slots, work=work,
                          prefetch=prefetch, spin=spin, skip=skip, interpret=interpret),
        out_shape=out_shape,
        grid=(programs,),
        input_output_aliases={first_cache: 1, first_cache + 1: 2, first_cache + 2: 3},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="persistent_decode_layers",
    )(position, frequencies, x, *weights, keys, values, counter)
    return results[0], results[1], results[2]


def _block(size: int) -> int:
    """Triton's block for `size` elements: a power of two, >= 16 where it meets a dot."""
    return max(16, pl.next_power_of_2(size))


def _kernel(position_ref, frequencies_ref, x0_ref, input_norm_ref, qkv_w_ref, o_w_ref, post_norm_ref, gate_ref, up_ref,
            down_ref, keys_ref, values_ref, _counter_in, x_ref, keys_out, values_out, counter_ref, qkv_ref,
            part_out_ref, part_max_ref, part_sum_ref, h_ref, *, num_heads: int, eps: float, programs: int,
            part_slots: int, work: Work, prefetch: bool, spin: str, skip: tuple[str, ...], interpret: bool):
    program = pl.program_id(0)
    num_layers, qkv_width, hidden = qkv_w_ref.shape
    slots, num_kv_heads, head_dim = keys_ref.shape[1:]
    inter = gate_ref.shape[1]
    group, parts = num_heads // num_kv_heads, part_max_ref.shape[1]
    dtype = x0_ref.dtype
    f32 = jnp.float32
    position = position_ref[jnp.int32(0)]
    rnd = lambda value: value.astype(dtype).astype(f32)  # where the layers hold a value in their dtype

    barrier = functools.partial(grid_barrier.wait, counter_ref, programs=programs, interpret=interpret, spin=spin)
    shared = grid_barrier.shared_load

    def vector(ref, size):
        """ref[:size] (another program's stores) as CHUNK-wide float32 pieces."""
        pieces = []
        for chunk in range(pl.cdiv(size, CHUNK)):
            index = chunk * CHUNK + jnp.arange(CHUNK)
            pieces.append(shared(ref, (index,), index < size))
        return pieces

    def rmsnorm(pieces, weight_ref, layer):
        """`layers.RMSNorm` of x's pieces with layer `layer`'s weight."""
        total = jnp.sum(sum(piece * piece for piece in pieces))  # one reduction across the threads, not one a piece
        scale = lax.rsqrt(total / hidden + eps)
        normed = []
        for chunk, piece in enumerate(pieces):
            index = chunk * CHUNK + jnp.arange(CHUNK)
            weight = plgpu.load(weight_ref.at[layer, index], mask=index < hidden, other=0).astype(f32)
            normed.append(rnd(rnd(piece * scale) * weight))
        return normed

    def features_of(item, rows):
        return item * rows + jnp.arange(rows)

    def weight_rows(weight_ref, layer, item, size, rows):
        """Item `item`'s rows of weight[layer] ([rows, size], in CHUNK-wide tiles of the weights'
        dtype); an item past the last feature loads nothing."""
        features = features_of(item, rows)
        real = features < weight_ref.shape[1]
        tiles = []
        for chunk in range(pl.cdiv(size, CHUNK)):
            index = chunk * CHUNK + jnp.arange(CHUNK)
            tiles.append(plgpu.load(weight_ref.at[layer, features[:, None], index[None, :]],
                                    mask=real[:, None] & (index < size)[None, :], other=0))
        return tiles

    def matvec(tiles, pieces):
        """[rows] float32: weight rows (`weight_rows`) . a vector's pieces."""
        total = jnp.zeros((tiles[0].shape[0], CHUNK), f32)
        for tile, piece in zip(tiles, pieces):
            total += tile.astype(f32) * piece[None, :]
        return jnp.sum(total, axis=1)

    def each_item(count, body):
        """body(item) for this program's items of `count`: program, program + programs, ..."""
        mine = lax.div(count - program + programs - 1, programs)
        lax.fori_loop(0, mine, lambda step, carry: (body(program + step * programs), carry)[1], 0)

    def early(count) -> bool:
        """Whether a stage of `count` items loads its inputs that no program writes (weights, the
        older cache slots) before the barrier ahead of it: with `prefetch`, when each program has
        at most one item (its own index). Their latency then overlaps the wait."""
        return prefetch and count <= programs

    def stage(name, load, compute, loaded=None):
        """Stage `name`'s items: compute(item, load(item)) each, or, with `loaded` (`early`), its one
        item's compute on what was loaded before the barrier."""
        count = counts[name]
        if name in skip:
            return
        if loaded is not None:
            pl.when(program < count)(lambda: compute(program, loaded))  # the programs past the items wait
        else:
            each_item(count, lambda item: compute(item, load(item)))

    # Stage 0: the residual stream starts as the embedding.
    @pl.when(program == 0)
    def _():
        for chunk in range(pl.cdiv(hidden, CHUNK)):
            index = chunk * CHUNK + jnp.arange(CHUNK)
            value = plgpu.load(x0_ref.at[index], mask=index < hidden, other=0).astype(f32)
            plgpu.store(x_ref.at[index], value, mask=index < hidden)

    head_rows = jnp.arange(_block(group))  # a kv head's query heads, padded for the dot
    columns = jnp.arange(_block(head_dim))
    in_head = columns < head_dim
    half = head_dim // 2
    partner = jnp.where(columns < half, columns + half, columns - half)
    frequencies = plgpu.load(frequencies_ref.at[columns], mask=in_head, other=0)
    angles = position.astype(f32) * frequencies
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    counts = dict(qkv=pl.cdiv(qkv_width, work.qkv), attend=num_kv_heads * parts, o=pl.cdiv(hidden, work.o),
                  gate_up=pl.cdiv(inter, work.gate_up), down=pl.cdiv(hidden, work.down))

    def rotated(starts, real):
        """Rotate-half rotary of qkv[starts[r] : starts[r] + H] [R, H'], rounded as `rotary` rounds."""
        mask = real[:, None] & in_head[None, :]
        x = shared(qkv_ref, (starts[:, None] + columns[None, :],), mask)
        pair = shared(qkv_ref, (starts[:, None] + partner[None, :],), mask)
        pair = jnp.where((columns < half)[None, :], -pair, pair)
        return rnd(x * cos[None, :] + pair * sin[None, :])

    def attention_item(item):
        """(kv head, part) of attention item `item`, its older cache slots and whether it is one."""
        kv_head, part = lax.div(item, parts), lax.rem(item, parts)
        first = part * part_slots
        cache_slots = first + jnp.arange(part_slots)
        older = (cache_slots < jnp.minimum(first + part_slots, position)) & (item < counts["attend"])
        return kv_head, part, cache_slots, older

    def attend_load(layer, item):
        """The item's older keys and values [part_slots, H'] (slots below the position: no program
        writes them in this launch)."""
        kv_head, _, cache_slots, older = attention_item(item)
        index = (layer, cache_slots[:, None], kv_head, columns[None, :])
        mask = older[:, None] & in_head[None, :]
        return (plgpu.load(keys_ref.at[index], mask=mask, other=0).astype(dtype),
                plgpu.load(values_ref.at[index], mask=mask, other=0).astype(dtype))

    def attend(layer, item, loaded):
        """Attention item `item`'s online-softmax partial over its part; the part holding the
        position also folds in the new key and value and writes them to the cache."""
        part_keys, part_values = loaded
        kv_head, part, _, older = attention_item(item)
        heads = kv_head * group + head_rows
        real = (head_rows < group) & (item < counts["attend"])
        q = rotated(heads * head_dim, real)  # [G', H']
        one = jnp.zeros((1,), jnp.int32)
        new_key = rotated(one + (num_heads + kv_head) * head_dim, one == 0)  # [1, H']
        new_value = shared(qkv_ref, ((num_heads + num_kv_heads + kv_head) * head_dim + columns,), in_head)
        new_value = new_value[None, :]
        scale = 1.0 / math.sqrt(head_dim)
        scores = lax.dot_general(q.astype(dtype), part_keys, (((1,), (1,)), ((), ())),
                                 preferred_element_type=f32) * scale
        scores = jnp.where(older[None, :], scores, attention_ops.MASK_VALUE)
        holds_new = (part == lax.div(position, part_slots)) & (item < counts["attend"])
        new_score = jnp.where(holds_new, jnp.sum(q * new_key, axis=1) * scale, attention_ops.MASK_VALUE)
        maximum = jnp.maximum(jnp.max(scores, axis=1), new_score)
        probs = jnp.where(older[None, :], jnp.exp(scores - maximum[:, None]), 0.0)
        new_prob = jnp.where(holds_new, jnp.exp(new_score - maximum), 0.0)
        total = jnp.sum(probs, axis=1) + new_prob
        out = jnp.dot(probs.astype(dtype), part_values, preferred_element_type=f32)
        out = out + new_prob[:, None] * new_value.astype(dtype).astype(f32)
        plgpu.store(part_max_ref.at[heads, part], maximum, mask=real)
        plgpu.store(part_sum_ref.at[heads, part], total, mask=real)
        plgpu.store(part_out_ref.at[heads[:, None], part, columns[None, :]], out, mask=real[:, None] & in_head[None, :])
        written = (one == 0)[:, None] & in_head[None, :] & holds_new
        cache_index = (layer, position + one[:, None], kv_head, columns[None, :])
        plgpu.store(keys_out.at[cache_index], new_key.astype(keys_out.dtype), mask=written)
        plgpu.store(values_out.at[cache_index], new_value.astype(values_out.dtype), mask=written)

    all_heads = jnp.arange(_block(num_heads))

    def o_load(layer, item):
        """Item `item`'s rows of Wo[layer] as [rows, N', H'] (query head, head dim)."""
        features = features_of(item, work.o)
        inputs = all_heads[:, None] * head_dim + columns[None, :]
        mask = (features < hidden)[:, None, None] & ((all_heads < num_heads)[:, None] & in_head[None, :])[None]
        return plgpu.load(o_w_ref.at[layer, features[:, None, None], inputs[None, :, :]], mask=mask, other=0)

    def o_proj(item, weights):
        """The partials merged (log-sum-exp) into the attended heads; x[rows] += attended @ Wo."""
        part_index = jnp.arange(pl.next_power_of_2(parts))
        real = all_heads < num_heads
        mask = real[:, None] & (part_index < parts)[None, :]
        maxima = shared(part_max_ref, (all_heads[:, None], part_index[None, :]), mask, attention_ops.MASK_VALUE)
        sums = shared(part_sum_ref, (all_heads[:, None], part_index[None, :]), mask)
        outs = shared(part_out_ref, (all_heads[:, None, None], part_index[None, :, None], columns[None, None, :]),
                      mask[:, :, None] & in_head[None, None, :])
        maximum = jnp.max(maxima, axis=1)
        weight = jnp.exp(maxima - maximum[:, None])
        total = jnp.sum(sums * weight, axis=1)
        attended = jnp.sum(outs * weight[:, :, None], axis=1) / jnp.where(real, total, 1.0)[:, None]
        attended = jnp.where(real[:, None], rnd(attended), 0.0)  # [N', H']
        update = jnp.sum(jnp.sum(weights.astype(f32) * attended[None], axis=2), axis=1)
        add_residual(features_of(item, work.o), update)

    def add_residual(features, update):
        residual = shared(x_ref, (features,), features < hidden)
        plgpu.store(x_ref.at[features], rnd(residual + rnd(update)), mask=features < hidden)

    def qkv_load(layer, item):
        return weight_rows(qkv_w_ref, layer, item, hidden, work.qkv)

    def ahead(name, load):
        """What stage `name` loads before the barrier ahead of it (`early`), else None."""
        return load(program) if early(counts[name]) and name not in skip else None

    def layer_step(layer, qkv_weights):
        base = 1 + len(STAGES) * layer

        # 1: qkv = rmsnorm(x) @ Wqkv
        def qkv(item, tiles):
            features = features_of(item, work.qkv)
            plgpu.store(qkv_ref.at[features], rnd(matvec(tiles, normed)), mask=features < qkv_width)

        if "qkv" not in skip:
            normed = rmsnorm(vector(x_ref, hidden), input_norm_ref, layer)
        stage("qkv", functools.partial(qkv_load, layer), qkv, qkv_weights)
        loaded = ahead("attend", functools.partial(attend_load, layer))
        barrier(base + 1)

        # 2: attention partials, one item a (kv head, part of the cache)
        stage("attend", functools.partial(attend_load, layer), functools.partial(attend, layer), loaded)
        loaded = ahead("o", functools.partial(o_load, layer))
        barrier(base + 2)

        # 3: merge the partials; x += attended @ Wo
        stage("o", functools.partial(o_load, layer), o_proj, loaded)
        gate_up_load = lambda item: (weight_rows(gate_ref, layer, item, hidden, work.gate_up),
                                     weight_rows(up_ref, layer, item, hidden, work.gate_up))
        loaded = ahead("gate_up", gate_up_load)
        barrier(base + 3)

        # 4: h = silu(rmsnorm(x) @ Wgate) * (rmsnorm(x) @ Wup)
        if "gate_up" not in skip:
            normed = rmsnorm(vector(x_ref, hidden), post_norm_ref, layer)

        def gate_up(item, tiles):
            features = features_of(item, work.gate_up)
            gate, up = rnd(matvec(tiles[0], normed)), rnd(matvec(tiles[1], normed))
            plgpu.store(h_ref.at[features], rnd(rnd(gate / (1.0 + jnp.exp(-gate))) * up), mask=features < inter)

        stage("gate_up", gate_up_load, gate_up, loaded)
        down_load = lambda item: weight_rows(down_ref, layer, item, inter, work.down)
        loaded = ahead("down", down_load)
        barrier(base + 4)

        # 5: x += h @ Wdown
        hidden_pieces = vector(h_ref, inter) if "down" not in skip else None
        stage("down", down_load,
              lambda item, tiles: add_residual(features_of(item, work.down), matvec(tiles, hidden_pieces)), loaded)
        following = ahead("qkv", functools.partial(qkv_load, jnp.minimum(layer + 1, num_layers - 1)))
        barrier(base + 5)
        return following

    first = ahead("qkv", functools.partial(qkv_load, jnp.int32(0)))
    barrier(1)
    lax.fori_loop(0, num_layers, layer_step, first)
