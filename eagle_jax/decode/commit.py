"""The end of every step: emit the accepted tokens, stop rows at their stop ids or budgets, advance
the cursors, count the tokens for the penalties, and queue the draft's pending pairs."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.decode import state as state_lib
from eagle_jax.model import kv_cache as kv_cache_lib


def _write_rows(buffer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """buffer[b, start[b]:start[b] + n] = new[b] for every row (any trailing axes)."""
    return jax.vmap(lambda row, values, at: jax.lax.dynamic_update_slice_in_dim(row, values, at, axis=0))(
        buffer, new.astype(buffer.dtype), start)


def append_tokens(state: state_lib.DecodeState, tokens: jax.Array, counts: jax.Array,
                  logprobs: sampling_lib.Logprobs | None = None) -> state_lib.DecodeState:
    """Appends the first `counts[b]` of `tokens[b]` to each row's output, stopping at one of the row's
    stop ids (EOS unless ignored, its stop_token_ids: the id is kept as the last token) or its budget.

    Args:
        tokens: [B, n] int32.
        logprobs: the tokens' `sampling.Logprobs` ([B, n] each), written beside them when the
            state keeps logprobs.
    """
    width = tokens.shape[1]
    index = jnp.arange(width, dtype=jnp.int32)
    stop_ids = state.params.stop_ids  # [B, S], -1-padded: never equal to a token
    if stop_ids.shape[1]:
        is_stop = jnp.any(tokens[:, :, None] == stop_ids[:, None, :], axis=-1) & (index[None] < counts[:, None])
        first_stop = jnp.min(jnp.where(is_stop, index[None], width), axis=1)
        hit_stop = first_stop < width
        counts = jnp.where(hit_stop, first_stop + 1, counts)
    else:
        hit_stop = jnp.zeros_like(state.done)
    room = state.max_new_tokens - state.num_generated
    counts = jnp.where(state.done, 0, jnp.minimum(counts, room))
    output = _write_rows(state.output, tokens, state.num_generated)
    if state.logprobs is not None and logprobs is not None:
        state = state.replace(logprobs=jax.tree.map(lambda buffer, new: _write_rows(buffer, new, state.num_generated),
                                                    state.logprobs, logprobs))
    num_generated = state.num_generated + counts
    done = state.done | hit_stop | (num_generated >= state.max_new_tokens)
    return state.replace(output=output, num_generated=num_generated, done=done)


def commit(state: state_lib.DecodeState, rng: jax.Array, cache: kv_cache_lib.KVCache, drafts: jax.Array,
           num_accepted: jax.Array, next_token: jax.Array, draft_cache: kv_cache_lib.KVCache | None,
           features: jax.Array | None, logprobs: sampling_lib.Logprobs | None = None,
           count_tokens: bool = True, verified_drafts: int | None = None) -> state_lib.DecodeState:
    """Emits the accepted drafts and the next token, advances the cursors, queues the pending pairs.

    Args:
        cache: the target cache after the verify, the accepted positions at slots L..L+num_accepted.
        drafts: [B, k] the drafts along the accepted path (those past num_accepted are not used);
            k is the step's drafts (up to opts.k), or 0 for a step that did not draft (plain, or
            paused by disable_by_batch_size).
        draft_cache: the head's cache after eating the pending pairs (and drafting); None without a head.
        features: [B, k+1, D] the head-space target features at the path's positions, root first.
        logprobs: [B, k+1] entries for the emitted tokens, position by position (`row_sampling.logprobs`).
        count_tokens: whether the penalties' token counts (if the state has them) take this
            step's tokens. False in a program with no penalties (`SamplingMode.penalties`): its
            rows never read their counts, and a penalised row starts its own at its prefill.
            Skipping them saves a [B, V] scatter and its index work a step.
        verified_drafts: the drafts the step verified, for `num_draft_tokens`: a tree's nodes;
            None: k.
    """
    k, batch = drafts.shape[1], state.next_token.shape[0]
    active = ~state.done
    committed = state.cache.lengths
    # Emitted this step: the accepted drafts, then the correction or bonus token.
    index = jnp.arange(k + 1, dtype=jnp.int32)
    padded_drafts = jnp.concatenate([drafts, jnp.zeros((batch, 1), jnp.int32)], axis=1)
    emitted = jnp.where(index[None] < num_accepted[:, None], padded_drafts, next_token[:, None])
    new = append_tokens(state, emitted, num_accepted + 1, logprobs)
    # A stop id or the budget may keep fewer tokens than the step produced: a draft counts as
    # accepted only if it was emitted (a finished row emits nothing, so it counts nothing either).
    num_emitted_drafts = jnp.minimum(num_accepted, new.num_generated - state.num_generated)
    depth = jnp.arange(state.accepted_per_position.shape[1], dtype=jnp.int32)
    keep = lambda fresh, old: jnp.where(active.reshape((-1,) + (1,) * (fresh.ndim - 1)), fresh, old)
    new = new.replace(
        cache=cache.replace(lengths=keep(committed + num_accepted + 1, committed)),
        next_token=keep(next_token, state.next_token),
        rng=rng,
        num_steps=state.num_steps + active,
        accepted_per_position=state.accepted_per_position
        + (depth[None] < num_emitted_drafts[:, None]).astype(jnp.int32),
    )
    # A row that just finished counts tokens it did not emit: it never reads them.
    if state.counts is not None and count_tokens:
        new = new.replace(counts=state.counts.commit(drafts, jnp.where(active, num_accepted, 0),
                                                     jnp.where(active, next_token, -1)))
    if draft_cache is None:
        return new
    # The verified positions' true features become the next step's pending pairs (the first
    # k+1 of the buffer); the draft cache rolls back to the committed length, so rejected slots
    # are simply overwritten.
    features = features.astype(state.pending_features.dtype)
    return new.replace(
        draft_cache=draft_cache.replace(lengths=keep(committed, state.draft_cache.lengths)),
        pending_tokens=keep(state.pending_tokens.at[:, :k + 1].set(emitted), state.pending_tokens),
        pending_features=keep(state.pending_features.at[:, :k + 1].set(features), state.pending_features),
        pending_count=keep(num_accepted + 1, state.pending_count),
        num_drafts=state.num_drafts + (active if k else 0),
        num_draft_tokens=state.num_draft_tokens + (active * (k if verified_drafts is None else verified_drafts)
                                                   if k else 0),
    )
