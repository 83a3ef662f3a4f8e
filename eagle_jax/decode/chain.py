"""A chain step: draft k tokens with the EAGLE head, verify the k+1 positions with one target
forward, accept (`acceptance.verify`), commit. With k = 0 the same step is plain decoding.

Drafts are drawn from the draft's processed distribution q (`row_sampling.draft_choice`), and the
target's logits are processed position by position with the drafts before each position
(`processors.chain_prefix`): the rejection sampler then emits exactly the target's processed
distribution, under every row's own settings.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle_jax.decode import acceptance
from eagle_jax.decode import commit as commit_lib
from eagle_jax.decode import processors
from eagle_jax.decode import row_sampling
from eagle_jax.decode import state as state_lib
from eagle_jax.model import eagle
from eagle_jax.model import layers
from eagle_jax.model import llama


def read_pending(target: llama.Llama, head, state: state_lib.DecodeState, attend_length: int | None = None,
                 kernels: layers.Kernels = layers.XLA):
    """The head's forward over the pending pairs: (features, logits, draft cache holding them).

    The pairs fill slots draft length .. committed length - 1; the forward runs over all k+1
    buffer entries, and those past `pending_count` write slots at or past the committed length,
    which later writes overwrite before any query can see them. `last_pending` picks the last
    pair's output: the feature the next draft builds on and the first draft's logits.
    """
    first_slot = state.draft_cache.lengths  # == committed length - pending count
    positions = first_slot[:, None] + jnp.arange(state.pending_tokens.shape[1], dtype=jnp.int32)
    return head(state.pending_tokens, state.pending_features, positions, state.draft_cache, target,
                attend_length=attend_length, kernels=kernels)


def last_pending(state: state_lib.DecodeState, x: jax.Array) -> jax.Array:
    """The entry of `x` [B, k+1, ...] (a `read_pending` output) at each row's last pending pair."""
    return x[jnp.arange(x.shape[0]), state.pending_count - 1]


def draft(target: llama.Llama, head, state: state_lib.DecodeState, opts: state_lib.Options,
          k: int | None = None, keys: jax.Array | None = None):
    """Drafts k tokens: one wide forward over the pending pairs, then k-1 single-token steps.

    Args:
        k: 1..opts.k; None: what the program's steps draft (`Options.num_draft_tokens`).
        keys: [B, k] one key per row and draft (`row_sampling.keys`); None when no row samples.
    Returns:
        (draft ids [B, k] int32, draft probs q [B, k, V] or None when no row samples, updated draft cache).
    """
    batch, vocab = state.next_token.shape[0], target.config.vocab_size
    k = opts.num_draft_tokens if k is None else k
    features, logits, cache = read_pending(target, head, state, opts.attend_length, opts.kernels)
    feature, logits = last_pending(state, features), last_pending(state, logits)

    def choose(j, logits, ids):
        prefix = jnp.where(jnp.arange(k) < j, ids, processors.NO_TOKEN)[:, None, :]  # drafts 0..j-1
        return row_sampling.draft_choice(head, state, opts, logits, vocab, prefix, (state.num_generated + j)[:, None],
                                         None if keys is None else keys[:, j])

    ids = jnp.zeros((batch, k), jnp.int32)
    token, probs = choose(0, logits, ids)
    ids = ids.at[:, 0].set(token)
    all_probs = None if probs is None else jnp.zeros((batch, k, vocab), probs.dtype).at[:, 0].set(probs)
    position = state.cache.lengths  # slot of the first drafted token

    def body(j, carry):
        ids, all_probs, feature, cache = carry
        token = ids[:, j - 1]
        out, logits, cache = head(token[:, None], feature[:, None], (position + j - 1)[:, None], cache, target,
                                  attend_length=opts.attend_length, kernels=opts.kernels)
        token, probs = choose(j, logits[:, 0], ids)
        ids = ids.at[:, j].set(token)
        if all_probs is not None:
            all_probs = all_probs.at[:, j].set(probs)
        return ids, all_probs, out[:, 0], cache

    ids, all_probs, _, cache = jax.lax.fori_loop(1, k, body, (ids, all_probs, feature, cache),
                                                 unroll=opts.unroll_draft)
    return ids, all_probs, cache


def step(target: llama.Llama, head, state: state_lib.DecodeState, opts: state_lib.Options,
         k: int) -> state_lib.DecodeState:
    """A chain step drafting `k` tokens: up to opts.k (`Options.num_draft_tokens`), or 0 (with a head: a
    plain step that keeps its state)."""
    batch = state.next_token.shape[0]
    uses_head = bool(opts.k)  # the state carries a draft cache and pending pairs
    mode = opts.sampling_mode
    rng, step_rng = jax.random.split(state.rng)
    keys = row_sampling.keys(state, step_rng, k + 1) if mode.sample else None  # k drafts, then the verify
    if k:
        draft_ids, draft_probs, draft_cache = draft(target, head, state, opts, k, keys)
    else:
        draft_ids, draft_probs, draft_cache = jnp.zeros((batch, 0), jnp.int32), None, None
        if uses_head:  # no drafts, but the pending pairs still enter the draft cache
            _, _, draft_cache = read_pending(target, head, state, opts.attend_length, opts.kernels)
    committed = state.cache.lengths
    verify_tokens = jnp.concatenate([state.next_token[:, None], draft_ids], axis=1)  # [B, k+1]
    positions = committed[:, None] + jnp.arange(k + 1, dtype=jnp.int32)
    hidden, cache, captured = target(verify_tokens, positions, state.cache, eagle.capture_layers(head) if uses_head else (),
                                     attend_length=opts.attend_length, kernels=opts.kernels)
    # Position j follows drafts 0..j-1: its penalties count them, and it is output token num_generated + j.
    processed = row_sampling.process(state, opts, target.logits(hidden), processors.chain_prefix(draft_ids),
                                     state.num_generated[:, None] + jnp.arange(k + 1, dtype=jnp.int32))
    num_accepted, next_token = acceptance.verify(draft_ids, draft_probs, processed, state.params, mode,
                                                 None if keys is None else keys[:, k])
    features = eagle.target_features(head, hidden, captured) if uses_head else None
    return commit_lib.commit(state, rng, cache, draft_ids, num_accepted, next_token, draft_cache, features,
                             row_sampling.logprobs(opts, processed, draft_ids, num_accepted, next_token),
                             count_tokens=mode.penalties)
