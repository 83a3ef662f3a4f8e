"""The decode loop as pure, statically shaped device functions: prefill (`start`), one step
(`step`), N steps (`run_steps`).

One step drafts k tokens with a `lax.fori_loop` over the EAGLE head, verifies the k+1
positions with one target forward, accepts, and commits, all in one program (`chain`). With no
head (k = 0) the same step is plain decoding: the verify of one token is a decode step. With
`Options.tree` the step drafts an EAGLE-2 tree instead (`tree_step`). The state and its static
options live in `state`, the end of a step in `commit`, the processors' calls in `row_sampling`.

Speculation can pause (`Options.disable_by_batch_size`, vLLM's --speculative-disable-by-batch-size):
a step with more active rows than that drafts nothing and verifies one token, chosen inside the
program. Its head still eats the pending pairs and leaves the one new pair pending, exactly as a
step that accepted no draft would, so the draft cache never falls behind and speculation resumes
on the next step with the same state it would have had.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle_jax.decode import chain
from eagle_jax.decode import commit as commit_lib
from eagle_jax.decode import processors
from eagle_jax.decode import row_sampling
from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.decode import state as state_lib
from eagle_jax.decode import tree_step
from eagle_jax.model import eagle
from eagle_jax.model import llama


def start(target: llama.Llama, head, tokens: jax.Array, lengths: jax.Array, rng: jax.Array,
          opts: state_lib.Options, max_new_tokens: jax.Array | None = None,
          params: sampling_lib.SamplingParams | None = None) -> state_lib.DecodeState:
    """Prefills target (and head) with right-padded prompts and emits the first token.

    Args:
        tokens: [B, T] int32 prompts, right-padded to a bucket T.
        lengths: [B] int32 true prompt lengths (>= 1).
        max_new_tokens: [B] int32 per-row budgets in [1, opts.max_new_tokens]; None gives every
            row opts.max_new_tokens.
        params: each row's settings and stop ids (`sampling.SamplingParams.stack`), covered by
            `opts.sampling_mode`; None: greedy rows that stop only at their budget.
    """
    batch, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    cache = target.init_cache(batch, opts.cache_length)
    hidden, cache, captured = target(tokens, positions, cache, eagle.capture_layers(head), kernels=opts.kernels)
    rows = jnp.arange(batch)
    mode = opts.sampling_mode
    params = sampling_lib.SamplingParams.neutral(batch) if params is None else params
    # The penalties count the prompt's tokens (repetition) and every emitted one, the first included.
    counts = processors.TokenCounts.create(tokens, lengths, target.config.vocab_size) if mode.penalties else None
    k = opts.k
    capacity = opts.max_new_tokens + k + 1
    state = state_lib.DecodeState(
        cache=cache.replace(lengths=lengths),
        next_token=jnp.zeros((batch,), jnp.int32),
        output=jnp.zeros((batch, capacity), jnp.int32),
        num_generated=jnp.zeros((batch,), jnp.int32),
        done=jnp.zeros((batch,), bool),
        rng=rng,
        num_steps=jnp.zeros((batch,), jnp.int32),
        accepted_per_position=jnp.zeros((batch, max(k, 1)), jnp.int32),
        max_new_tokens=(jnp.full((batch,), opts.max_new_tokens, jnp.int32) if max_new_tokens is None
                        else jnp.minimum(max_new_tokens.astype(jnp.int32), opts.max_new_tokens)),
        params=params,
        counts=counts,
        logprobs=None if mode.logprobs is None else sampling_lib.Logprobs(
            token=jnp.zeros((batch, capacity), jnp.float32), rank=jnp.zeros((batch, capacity), jnp.int32),
            top_ids=jnp.zeros((batch, capacity, mode.logprobs), jnp.int32),
            top=jnp.zeros((batch, capacity, mode.logprobs), jnp.float32)),
    )
    rng, first_rng = jax.random.split(rng)
    processed = row_sampling.process(state, opts, target.logits(hidden[rows, lengths - 1])[:, None], None,
                                     jnp.zeros((batch, 1), jnp.int32))  # [B, 1, V]: no token emitted before it
    if mode.sample:  # a seeded row's first key: its seed and count 0
        first = sampling_lib.sample(processed, params, row_sampling.keys(state, first_rng, 1)[:, 0])[:, 0]
    else:
        first = sampling_lib.argmax(processed[:, 0])
    logprobs = None if mode.logprobs is None else sampling_lib.logprobs(processed, first[:, None], mode.logprobs)
    state = state.replace(next_token=first, rng=rng, counts=None if counts is None else counts.add(first[:, None]))
    state = commit_lib.append_tokens(state, first[:, None], jnp.ones((batch,), jnp.int32), logprobs)
    if head is None or k == 0:
        return state
    # Draft prefill: slot i gets (t_{i+1}, f_i); the slot of the last prompt token pairs with
    # the token just sampled. That pair also stays pending, so every step starts the same way.
    features = eagle.target_features(head, hidden, captured)
    shifted = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], axis=1)
    shifted = shifted.at[rows, lengths - 1].set(first)
    draft_cache = eagle.init_cache(head.config, batch, opts.cache_length, features.dtype)
    _, _, draft_cache = head(shifted, features, positions, draft_cache, target, kernels=opts.kernels)
    pending_features = jnp.zeros((batch, k + 1, features.shape[-1]), features.dtype)
    return state.replace(
        draft_cache=draft_cache.replace(lengths=lengths - 1),
        pending_tokens=jnp.zeros((batch, k + 1), jnp.int32).at[:, 0].set(first),
        pending_features=pending_features.at[:, 0].set(features[rows, lengths - 1]),
        pending_count=jnp.ones((batch,), jnp.int32),
        num_drafts=jnp.zeros((batch,), jnp.int32),
        num_draft_tokens=jnp.zeros((batch,), jnp.int32),
    )


def step(target: llama.Llama, head, state: state_lib.DecodeState, opts: state_lib.Options) -> state_lib.DecodeState:
    """One speculative step (or one plain decode step when k == 0), chain or tree.

    With `opts.disable_by_batch_size`, a `lax.cond` on the active rows picks a step of k drafts
    (or the tree) or of none, in the same program: nothing recompiles and the host is not asked.
    """
    def speculate(state):  # a chain of k drafts, or the tree
        if opts.tree is not None:
            return tree_step.step(target, head, state, opts)
        return chain.step(target, head, state, opts, opts.num_draft_tokens)

    if not opts.k or opts.disable_by_batch_size is None:
        return speculate(state)
    busy = jnp.sum(~state.done) > opts.disable_by_batch_size
    return jax.lax.cond(busy, lambda s: chain.step(target, head, s, opts, 0), speculate, state)


def run_steps(target: llama.Llama, head, state: state_lib.DecodeState, num_steps: int | jax.Array,
              opts: state_lib.Options, steps_per_check: int = 1, stop_on_finish: bool = False,
              min_finished: jax.Array | int = 1) -> state_lib.DecodeState:
    """Up to `num_steps` steps on the device (an int, or an int32 scalar the host picks per call
    without a recompile), stopping early once every row is done.

    The exit test (`all rows done`) runs every `steps_per_check` steps; between tests the steps
    run in a fixed-length `fori_loop`. A data-dependent exit every step may cost a device-to-host
    sync per iteration on GPU (docs/BENCHMARKS.md); checking less often trades that for up to
    `steps_per_check - 1` idle steps at the end. Outputs are identical either way: a finished
    row's step changes nothing.

    With `stop_on_finish` (continuous batching) the loop also exits as soon as `min_finished`
    rows that were running at entry are done (an int32 scalar, traced: the host picks it per
    call without a recompile), so that the host can refill their slots instead of carrying idle
    rows through the rest of the call. Waiting for several trades some idle row-steps for fewer
    device-to-host round trips; more than the batch never exits early.
    """
    running_at_entry = ~state.done

    def cond(carry):
        i, state = carry
        keep_going = (i < num_steps) & ~jnp.all(state.done)
        if stop_on_finish:
            keep_going &= jnp.sum(state.done & running_at_entry) < min_finished
        return keep_going

    def body(carry):
        i, state = carry
        if steps_per_check == 1:
            return i + 1, step(target, head, state, opts)
        state = jax.lax.fori_loop(0, steps_per_check, lambda _, s: step(target, head, s, opts), state)
        return i + steps_per_check, state

    return jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]
