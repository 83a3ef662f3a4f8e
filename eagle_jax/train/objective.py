"""The EAGLE training objective: target features, the unrolled head ("training-time test"), losses.

Alignment. For base position i the head's first step reads the pair (t_{i+1}, f_i), exactly as
draft slot i does at inference, and predicts the target's distribution at position i+1. Step j
reads (t_{i+1+j}, its own step-(j-1) output) at rotary position i+j and predicts position
i+1+j. Its attention sees what a drafting step sees at inference: step-0 keys (true features)
at positions <= i, and its own earlier steps' keys for the same i (the "diagonal"); in a head of
several layers, each layer's attention does.

EAGLE-1 (SafeAILab recipe): SmoothL1(out, f_{i+1}) + 0.1 * CE(lm_head(out), softmax(lm_head(f_{i+1}))),
with uniform noise on the target features. EAGLE-3: CE against the target distribution restricted
to the draft vocabulary. Step j's loss is weighted 0.8^j.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from eagle_jax.model import causal_attention
from eagle_jax.model import eagle
from eagle_jax.model import llama


@dataclasses.dataclass(frozen=True)
class Objective:
    """Static settings of the loss (hashable: part of the compiled train step)."""

    num_steps: int = 1  # unrolled head steps (1 = plain teacher forcing)
    step_decay: float = 0.8
    feature_noise: float = 0.2  # EAGLE-1: width of the uniform noise added to target features
    regression_weight: float = 1.0  # EAGLE-1
    distribution_weight: float = 0.1  # EAGLE-1 (EAGLE-3 uses CE alone, weight 1)
    attention: str = "xla"  # target and head attention: "xla" or "cudnn" (`causal_attention.causal_attention`)


def target_outputs(target: llama.Llama, tokens: jax.Array, capture_layers: tuple[int, ...],
                   vocab_ids: jax.Array | None = None, implementation: str = "xla"):
    """Target hidden states [B, T, D], captured features and float32 logits, no gradient.

    The logits cover `vocab_ids` only when given ([B, T, len(vocab_ids)]; EAGLE-3's draft
    vocabulary), else the whole vocabulary. No KV cache: plain causal attention.
    """
    batch, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    hidden, _, captured = target(tokens, positions, None, capture_layers, implementation)
    return jax.lax.stop_gradient((hidden, captured, target.logits(hidden, vocab_ids)))


def _shift(array: jax.Array, offset: int, length: int, fill=0) -> jax.Array:
    """array[:, offset:offset+length] along axis 1, padded with `fill` past the end."""
    part = array[:, offset:offset + length]
    pad = [(0, 0)] * array.ndim
    pad[1] = (0, length - part.shape[1])
    return jnp.pad(part, pad, constant_values=fill)


def unrolled_head(head, target: llama.Llama, tokens: jax.Array, features: jax.Array, num_steps: int,
                  implementation: str = "xla"):
    """Runs the head `num_steps` times on its own outputs.

    Args:
        tokens: [B, T] the full token sequences.
        features: [B, n] head-space features of positions 0..n-1 (n = T - 1).
        implementation: of the attention (`causal_attention.causal_attention`).
    Returns:
        list over steps of (out [B, n, D], logits [B, n, V_draft]).
    """
    batch, n = features.shape[:2]
    positions = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (batch, n))
    num_layers = 1 + len(head.extra_layers)
    # Per layer: step 0's keys and values (true features) and each later step's ("the diagonal").
    first_keys, first_values = [None] * num_layers, [None] * num_layers
    diagonal_keys, diagonal_values = [[] for _ in range(num_layers)], [[] for _ in range(num_layers)]
    results = []
    for step in range(num_steps):

        def attend(index, attention, x, residual, step=step):
            q, k, v = attention.project(x, positions + step)
            if step == 0:
                first_keys[index], first_values[index] = k, v
            else:
                diagonal_keys[index].append(k)
                diagonal_values[index].append(v)
            attended = causal_attention.causal_attention(q, first_keys[index], first_values[index], implementation,
                                                         tuple(diagonal_keys[index]), tuple(diagonal_values[index]))
            return residual + attention.output(attended)

        out = eagle.forward_layers(head, target.embed_tokens(_shift(tokens, 1 + step, n)), features, attend)
        results.append((out, head.logits(out, target)))
        features = out
    return results


def loss(head, target: llama.Llama, tokens: jax.Array, loss_mask: jax.Array, rng: jax.Array,
         objective: Objective, draft_ids: jax.Array | None = None):
    """Mean weighted loss and metrics for one batch.

    Args:
        tokens: [B, T] int32; loss_mask: [B, T] bool, True on tokens the target generated
            (assistant tokens): a prediction counts when the token it predicts is masked in.
        draft_ids: EAGLE-3 only: [V_draft] target ids of the draft vocabulary.
    Returns:
        (loss, {"loss": .., "accuracy_<j>": ..}).
    """
    is_eagle3 = isinstance(head, eagle.Eagle3Head)
    # EAGLE-3's teacher is the target's distribution restricted to the draft vocabulary.
    hidden, captured, target_logits = target_outputs(target, tokens, eagle.capture_layers(head),
                                                     draft_ids if is_eagle3 else None, objective.attention)
    n = tokens.shape[1] - 1
    features = eagle.target_features(head, hidden, captured)[:, :n]
    if not is_eagle3:  # EAGLE-1 trains on noised features, as the paper does
        noise = jax.random.uniform(rng, features.shape, minval=-0.5, maxval=0.5) * objective.feature_noise
        features = features + noise.astype(features.dtype)
    total, weights, metrics = 0.0, 0.0, {}
    steps = unrolled_head(head, target, tokens, features, objective.num_steps, objective.attention)
    for step, (out, logits) in enumerate(steps):
        valid = _shift(loss_mask, 2 + step, n, fill=False).astype(jnp.float32)  # predicted token is t_{i+2+step}
        count = jnp.maximum(valid.sum(), 1.0)
        teacher = _shift(target_logits, 1 + step, n)
        cross_entropy = optax.softmax_cross_entropy(logits, jax.nn.softmax(teacher, axis=-1))
        step_loss = (cross_entropy * valid).sum() / count
        if not is_eagle3:
            regression = optax.huber_loss(out.astype(jnp.float32), _shift(hidden, 1 + step, n).astype(jnp.float32))
            step_loss = objective.regression_weight * (regression.mean(-1) * valid).sum() / count \
                + objective.distribution_weight * step_loss
        weight = objective.step_decay ** step
        total, weights = total + weight * step_loss, weights + weight
        agree = jnp.argmax(logits, axis=-1) == jnp.argmax(teacher, axis=-1)
        metrics[f"accuracy_{step}"] = (agree * valid).sum() / count
    metrics["loss"] = total / weights
    return total / weights, metrics
