"""Verifying drafted tokens against the target: greedy prefix match and lossless rejection sampling.

Both return, per row, how many drafts were accepted (n in 0..k) and the token that follows
them (the target's correction at the first rejection, or the bonus token when all k pass),
so a step always emits n + 1 tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle_jax.decode import sampling as sampling_lib


def greedy(draft_ids: jax.Array, target_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Longest prefix of drafts equal to the target's argmax.

    Args:
        draft_ids: [B, k] int32 drafted tokens.
        target_ids: [B, k+1] int32 target argmax at each verified position.
    Returns:
        (num_accepted [B] int32, next_token [B] int32).
    """
    k = draft_ids.shape[1]
    matches = (draft_ids == target_ids[:, :k]).astype(jnp.int32)
    num_accepted = jnp.sum(jnp.cumprod(matches, axis=1), axis=1).astype(jnp.int32)
    next_token = jnp.take_along_axis(target_ids, num_accepted[:, None], axis=1)[:, 0]
    return num_accepted, next_token.astype(jnp.int32)


def rejection(draft_ids: jax.Array, draft_probs: jax.Array, target_probs: jax.Array,
              rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Speculative rejection sampling (Leviathan et al.; vLLM's rejection sampler).

    Draft x at position j is kept with probability min(1, p_j(x) / q_j(x)); at the first
    rejection the next token is drawn from normalise(max(p_j - q_j, 0)); if all k pass, the
    bonus token is drawn from p_k. The emitted tokens are then distributed exactly as the target.

    Args:
        draft_ids: [B, k] int32 tokens drawn from draft_probs.
        draft_probs: [B, k, V] the draft distributions q (in target vocabulary).
        target_probs: [B, k+1, V] the target distributions p.
        rng: PRNG key.
    """
    batch, k = draft_ids.shape
    accept_rng, residual_rng = jax.random.split(rng)
    p_draft = jnp.take_along_axis(target_probs[:, :k], draft_ids[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(draft_probs, draft_ids[..., None], axis=-1)[..., 0]
    uniform = jax.random.uniform(accept_rng, (batch, k))
    accepted = (uniform * q_draft < p_draft).astype(jnp.int32)
    num_accepted = jnp.sum(jnp.cumprod(accepted, axis=1), axis=1).astype(jnp.int32)
    # q is zero past the last draft, so the bonus case is the same formula: max(p_k - 0, 0) = p_k.
    padded_q = jnp.concatenate([draft_probs, jnp.zeros_like(draft_probs[:, :1])], axis=1)
    pick = lambda probs: jnp.take_along_axis(probs, num_accepted[:, None, None], axis=1)[:, 0]
    p_next, q_next = pick(target_probs), pick(padded_q)
    residual = jnp.maximum(p_next - q_next, 0.0)
    total = jnp.sum(residual, axis=-1, keepdims=True)
    # p == q leaves no residual mass; rejection then had probability 0, so any valid choice is exact.
    residual = jnp.where(total > 0, residual / jnp.where(total > 0, total, 1.0), p_next)
    return num_accepted, sampling_lib.sample_from(residual, residual_rng)
