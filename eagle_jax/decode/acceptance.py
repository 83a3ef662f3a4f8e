"""Verifying drafted tokens against the target: greedy prefix match and lossless rejection sampling.

Both return, per row, how many drafts were accepted (n in 0..k) and the token that follows
them (the target's correction at the first rejection, or the bonus token when all k pass),
so a step always emits n + 1 tokens.

With per-row settings (`sampling.SamplingParams`, `processors`), `verify` takes the target's
processed logits: the rejection sampler then keeps the processed distribution exactly, and a
greedy row's distribution is one-hot at its processed argmax, for which the same rule is a prefix
match (a draft other than the argmax has p = 0 and is rejected, the residual is the argmax).
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


def rejection(draft_ids: jax.Array, draft_probs: jax.Array | None, target_probs: jax.Array,
              rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Speculative rejection sampling (Leviathan et al.; vLLM's rejection sampler).

    Draft x at position j is kept with probability min(1, p_j(x) / q_j(x)); at the first
    rejection the next token is drawn from normalise(max(p_j - q_j, 0)); if all k pass, the
    bonus token is drawn from p_k. The emitted tokens are then distributed exactly as the target.

    Args:
        draft_ids: [B, k] int32 tokens drawn from draft_probs.
        draft_probs: [B, k, V] the draft distributions q (in target vocabulary), or None for drafts
            chosen deterministically (greedy or n-gram drafts: q is one-hot at the draft, as vLLM
            takes it when a proposer gives no probabilities).
        target_probs: [B, k+1, V] the target distributions p.
        rng: one PRNG key, or [B] keys, one per row (`sampling.row_keys`).
    """
    batch, k = draft_ids.shape
    if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.ndim == 1:  # one key per row
        accept_rngs, residual_rngs = jax.vmap(jax.random.split, out_axes=1)(rng)
        uniform = jax.vmap(lambda key: jax.random.uniform(key, (k,)))(accept_rngs)
        draw = lambda probs: jax.vmap(sampling_lib.sample_from)(probs, residual_rngs)
    else:
        accept_rng, residual_rng = jax.random.split(rng)
        uniform = jax.random.uniform(accept_rng, (batch, k))
        draw = lambda probs: sampling_lib.sample_from(probs, residual_rng)
    p_draft = jnp.take_along_axis(target_probs[:, :k], draft_ids[..., None], axis=-1)[..., 0]
    if draft_probs is None:
        draft_probs = jax.nn.one_hot(draft_ids, target_probs.shape[-1], dtype=target_probs.dtype)
    q_draft = jnp.take_along_axis(draft_probs, draft_ids[..., None], axis=-1)[..., 0]
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
    return num_accepted, draw(residual)


def verify(draft_ids: jax.Array, draft_probs: jax.Array | None, target_logits: jax.Array,
           params: sampling_lib.SamplingParams, mode: sampling_lib.SamplingMode,
           rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Accepts drafts against the target's processed logits, each row under its own settings.

    A greedy-only mode is the prefix match on the processed argmax (penalties move the argmax);
    otherwise `rejection` on `sampling.distribution`, which is one-hot at the argmax for greedy rows.

    Args:
        draft_ids: [B, k] int32.
        draft_probs: [B, k, V] the q the drafts were drawn from, or None (one-hot drafts).
        target_logits: [B, k+1, V] processed (`processors.process`, the penalties seeing the drafts
            before each position).
        rng: one PRNG key, or [B] keys (`sampling.row_keys`).
    Returns:
        (num_accepted [B] int32, next_token [B] int32).
    """
    if not mode.sample:
        return greedy(draft_ids, sampling_lib.argmax(target_logits))
    return rejection(draft_ids, draft_probs, sampling_lib.distribution(target_logits, params), rng)
