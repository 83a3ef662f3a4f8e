"""The processors as a decode step calls them: each row's keys, its processed logits at draft and
verify positions, its draft draws, and the log-probabilities of what it emitted.

These follow `processors`' "Integration" section. Under a `sampling.SamplingMode` that processes
nothing (greedy, no penalties, no min_tokens) none of this is traced: drafts and verifies take
the raw argmax, as the plain greedy program always did.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle_jax.decode import processors
from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.decode import state as state_lib


def keys(state: state_lib.DecodeState, rng: jax.Array, count: int) -> jax.Array:
    """[B, count] PRNG keys, one set per row: a seeded row's from its seed and `num_generated` alone
    (`sampling.row_keys`), the others' from `rng`."""
    base = sampling_lib.row_keys(state.params, rng, state.num_generated)
    return jax.vmap(lambda key: jax.random.split(key, count))(base)


def process(state: state_lib.DecodeState, opts: state_lib.Options, logits: jax.Array,
            prefix: jax.Array | None = None, emitted: jax.Array | None = None) -> jax.Array:
    """`processors.process` of logits [B, T, V] with the rows' settings and counts.

    Args:
        prefix: [B, T, P] tokens before each position beyond the committed ones (the drafts).
        emitted: [B, T] tokens the row emitted before each position (for min_tokens).
    """
    return processors.process(logits, state.params, opts.sampling_mode, state.counts, prefix, emitted)


def in_target_vocab(head, logits: jax.Array, vocab_size: int) -> jax.Array:
    """Draft logits [..., V_draft] as float32 logits over the target vocabulary (EAGLE-3's draft
    vocabulary is a subset: the other tokens get -inf, probability 0 under the draft)."""
    logits = logits.astype(jnp.float32)
    if logits.shape[-1] == vocab_size:
        return logits
    targets = head.to_target_ids(jnp.arange(logits.shape[-1], dtype=jnp.int32))
    return jnp.full(logits.shape[:-1] + (vocab_size,), -jnp.inf, jnp.float32).at[..., targets].set(logits)


def draft_choice(head, state: state_lib.DecodeState, opts: state_lib.Options, logits: jax.Array, vocab_size: int,
                 prefix: jax.Array, emitted: jax.Array, keys: jax.Array | None):
    """One chain draft per row: (target ids [B] int32, q [B, V] or None).

    The draft's logits go through the same processors as the target's at that position (its
    prefix of earlier drafts, its emitted count), so q is the draft's own processed distribution,
    and a token the target may not emit there (a stop id under min_tokens) is not proposed either.

    Args:
        logits: [B, V_draft] the head's logits.
        prefix: [B, 1, P] the drafts before this one; emitted: [B, 1].
        keys: [B] one key per row (None when no row samples).
    Returns:
        q is None when no row samples (drafts are argmaxes; acceptance is a prefix match).
    """
    mode = opts.sampling_mode
    if not mode.processes:
        return head.to_target_ids(sampling_lib.argmax(logits)), None
    processed = process(state, opts, in_target_vocab(head, logits, vocab_size)[:, None], prefix, emitted)
    if not mode.sample:
        return sampling_lib.argmax(processed[:, 0]), None
    token = sampling_lib.sample(processed, state.params, keys)[:, 0]
    return token, sampling_lib.distribution(processed, state.params)[:, 0]


def logprobs(opts: state_lib.Options, processed: jax.Array, drafts: jax.Array, num_accepted: jax.Array,
             next_token: jax.Array) -> sampling_lib.Logprobs | None:
    """Log-probabilities of the tokens a step emitted (the accepted drafts, then the next token)
    under the processed logits [B, k+1, V] of the positions they were emitted at; None unless asked."""
    if opts.sampling_mode.logprobs is None:
        return None
    emitted = processors.emitted_ids(drafts, num_accepted, next_token)
    return sampling_lib.logprobs(processed, emitted, opts.sampling_mode.logprobs)
