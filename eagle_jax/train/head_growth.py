"""Growing a trained head: wider MLPs, more decoder layers, each starting where the head left off.

Both add parameters whose initial contribution is zero (Net2Net-style), so the grown head
computes what the trained one did and training continues from there instead of starting over:
a way to try a wider or deeper head for the price of its extra training only. A larger draft
vocabulary is `draft_vocabulary.extend_draft_vocabulary`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from flax import nnx

from eagle_jax.model import eagle
from eagle_jax.model import layers


def widen_mlp(head, intermediate_size: int, seed: int = 0):
    """Widens a trained head's (either kind's) MLPs, every layer's, to `intermediate_size` in place; returns the head.

    The added units get fresh gate and up columns and zero down_proj rows, so the head's output
    is unchanged at the start; training then grows them (Net2Net-style widening), to try a wider
    head without starting over.
    """
    layer = head.config.layer
    old = layer.intermediate_size
    if intermediate_size < old or layer.mlp_bias:
        raise ValueError(f"an MLP {old} wide (bias {layer.mlp_bias}) widens to {old} or more units without biases, "
                         f"not {intermediate_size}")
    wide_layer = dataclasses.replace(layer, intermediate_size=intermediate_size)

    def widened(mlp):
        wide = layers.MLP(wide_layer, rngs=nnx.Rngs(seed), dtype=mlp.down_proj.dtype,
                          param_dtype=mlp.down_proj.kernel.dtype)
        gate_up, fresh = mlp.gate_up_proj.kernel[...], wide.gate_up_proj.kernel[...]  # [H, 2F]: [gate | up]
        wide.gate_up_proj.kernel[...] = jnp.concatenate(
            [gate_up[:, :old], fresh[:, old:intermediate_size], gate_up[:, old:], fresh[:, intermediate_size + old:]],
            axis=1)
        down = mlp.down_proj.kernel[...]
        wide.down_proj.kernel[...] = jnp.concatenate([down, jnp.zeros((intermediate_size - old, down.shape[1]),
                                                                      down.dtype)])
        return wide

    first = head.midlayer if isinstance(head, eagle.Eagle3Head) else head
    for owner in (first, *head.extra_layers):
        owner.mlp = widened(owner.mlp)
    head.config = dataclasses.replace(head.config, layer=wide_layer)
    return head


def add_layers(head: eagle.Eagle3Head, num_layers: int, seed: int = 0) -> eagle.Eagle3Head:
    """Deepens a trained EAGLE-3 head to `num_layers` decoder layers in place; returns the head.

    Each added layer is a fresh Llama decoder layer whose o_proj and down_proj are zero, so it
    adds nothing to its residual stream and the head's output is unchanged at the start; training
    then grows it, to try a deeper head without starting over.
    """
    cfg = head.config
    if num_layers < cfg.num_layers:
        raise ValueError(f"a head of {cfg.num_layers} layers deepens to {cfg.num_layers} or more, not {num_layers}")
    kernel = head.midlayer.mlp.down_proj.kernel
    for index in range(cfg.num_layers, num_layers):
        layer = layers.DecoderLayer(cfg.layer, rngs=nnx.Rngs(seed + index), dtype=head.midlayer.mlp.down_proj.dtype,
                                    param_dtype=kernel.dtype)
        for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
            linear.kernel[...] = jnp.zeros_like(linear.kernel[...])
        head.layers.append(layer)
    head.config = dataclasses.replace(cfg, num_layers=num_layers)
    return head
