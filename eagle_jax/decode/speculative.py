"""The decode loop as pure, statically shaped device functions: prefill, one step, N steps.

One step drafts k tokens with a `lax.fori_loop` over the EAGLE head, verifies the k+1
positions with one target forward, accepts, and commits, all in one program. With no head
(k = 0) the same step is plain decoding: the verify of one token is a decode step. With
`Options.tree` the step drafts an EAGLE-2 tree instead (`tree_draft`), verifies its N+1 nodes
with a tree mask, accepts the longest agreeing path (`tree.accept`), moves that path's target
keys and values into consecutive slots, and commits exactly as the chain does, k being the
tree's depth.

Positions. The target cache holds committed tokens t_0..t_{L-1}; `next_token` is t_L, already
emitted, not yet in the cache. Draft slot i holds the pair (t_{i+1}, f_i), f_i being the target
feature at position i, at rotary position i. Pairs whose feature is known but that the draft has
not consumed yet wait in `pending_*` (1 to k+1 of them); the step's first draft forward eats
them and so refreshes the draft cache with true features for every accepted token.

Speculation can pause (`Options.disable_by_batch_size`, vLLM's --speculative-disable-by-batch-size):
a step with more active rows than that drafts nothing and verifies one token, chosen inside the
program. Its head still eats the pending pairs and leaves the one new pair pending, exactly as a
step that accepted no draft would, so the draft cache never falls behind and speculation resumes
on the next step with the same state it would have had.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from eagle_jax.decode import acceptance
from eagle_jax.kernels import decode_attention
from eagle_jax.model import attention_ops
from eagle_jax.model import eagle
from eagle_jax.model import kv_cache as kv_cache_lib
from eagle_jax.model import layers
from eagle_jax.model import llama
from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.decode import tree as tree_lib
from eagle_jax.decode import tree_draft


@struct.dataclass
class DecodeState:
    """Everything the loop carries, per row. Donated to each call."""

    cache: kv_cache_lib.KVCache
    next_token: jax.Array  # [B] int32
    output: jax.Array  # [B, max_new_tokens + k + 1] int32 generated tokens
    num_generated: jax.Array  # [B] int32
    done: jax.Array  # [B] bool
    rng: jax.Array
    num_steps: jax.Array  # [B] int32 target forwards after prefill while active
    accepted_per_position: jax.Array  # [B, max(k, 1)] int32 drafts accepted and emitted at each depth
    max_new_tokens: jax.Array  # [B] int32 each row's budget, <= Options.max_new_tokens
    draft_cache: kv_cache_lib.KVCache | None = None
    pending_tokens: jax.Array | None = None  # [B, k+1] int32
    pending_features: jax.Array | None = None  # [B, k+1, D]
    pending_count: jax.Array | None = None  # [B] int32
    num_drafts: jax.Array | None = None  # [B] int32 steps that drafted while active (<= num_steps)


@struct.dataclass
class Options:
    """Static settings of one compiled program (hashable; part of the jit cache key).

    With a tree, k is its depth (num_steps): the most drafts one step can accept.
    """

    k: int = struct.field(pytree_node=False, default=0)
    tree: tree_lib.TreeOptions | None = struct.field(pytree_node=False, default=None)
    sampling: sampling_lib.Sampling = struct.field(pytree_node=False, default=sampling_lib.Sampling())
    eos_ids: tuple[int, ...] = struct.field(pytree_node=False, default=())
    max_new_tokens: int = struct.field(pytree_node=False, default=128)  # output capacity; rows may budget fewer
    cache_length: int = struct.field(pytree_node=False, default=256)
    # Speculate only in steps where at most this many rows are active; None: always.
    disable_by_batch_size: int | None = struct.field(pytree_node=False, default=None)
    # Attention reads cache slots [0, attend_length) only (None: the whole cache). The host sets
    # it per device call to cover every slot the call can write, so that a cache sized for the
    # longest request is not read whole at every step (`scheduler`). Chains and plain decoding.
    attend_length: int | None = struct.field(pytree_node=False, default=None)
    # The kernels of cached calls, in target and head (`layers.Kernels`: "xla", "pallas" or
    # "pallas_linear", and the Pallas attention kernel's tiling); "auto" is resolved before here.
    decode_kernels: str = struct.field(pytree_node=False, default="xla")
    attention_tiling: decode_attention.Tiling | None = struct.field(pytree_node=False, default=None)
    # Write the draft loop out (`lax.fori_loop(..., unroll=True)`) instead of looping on the device:
    # on GPU a device loop is not captured into the step's CUDA graph, so each iteration pays its
    # launches; unrolled, the program grows with k.
    unroll_draft: bool = struct.field(pytree_node=False, default=False)

    def __post_init__(self):
        if self.tree is not None and self.k != self.tree.num_steps:  # state shapes follow k
            raise ValueError(f"with a tree, k must be its depth {self.tree.num_steps}, got {self.k}")
        if self.attend_length is not None and (self.tree is not None or not 0 < self.attend_length <= self.cache_length):
            raise ValueError(f"attend_length must be in 1..cache_length={self.cache_length} and without a tree, "
                             f"got {self.attend_length}")

    @property
    def kernels(self) -> layers.Kernels:
        """What every forward of these programs runs its cached calls in."""
        return layers.Kernels(self.decode_kernels, self.attention_tiling)

    @property
    def num_draft_tokens(self) -> int:
        """Drafts verified per step."""
        return self.tree.num_draft_tokens if self.tree is not None else self.k

    @property
    def cache_headroom(self) -> int:
        """Cache slots past a row's committed length that one step may write."""
        return self.tree.cache_headroom if self.tree is not None else self.k + 1


def append_tokens(state: DecodeState, tokens: jax.Array, counts: jax.Array, opts: Options) -> DecodeState:
    """Appends the first `counts[b]` of `tokens[b]` to each row's output, stopping at EOS or the budget."""
    width = tokens.shape[1]
    index = jnp.arange(width, dtype=jnp.int32)
    if opts.eos_ids:
        is_eos = jnp.isin(tokens, jnp.asarray(opts.eos_ids, jnp.int32)) & (index[None] < counts[:, None])
        first_eos = jnp.min(jnp.where(is_eos, index[None], width), axis=1)
        hit_eos = first_eos < width
        counts = jnp.where(hit_eos, first_eos + 1, counts)
    else:
        hit_eos = jnp.zeros_like(state.done)
    room = state.max_new_tokens - state.num_generated
    counts = jnp.where(state.done, 0, jnp.minimum(counts, room))
    write = jax.vmap(lambda row, new, start: jax.lax.dynamic_update_slice_in_dim(row, new, start, axis=0))
    output = write(state.output, tokens, state.num_generated)
    num_generated = state.num_generated + counts
    done = state.done | hit_eos | (num_generated >= state.max_new_tokens)
    return state.replace(output=output, num_generated=num_generated, done=done)


def start(target: llama.Llama, head, tokens: jax.Array, lengths: jax.Array, rng: jax.Array,
          opts: Options, max_new_tokens: jax.Array | None = None) -> DecodeState:
    """Prefills target (and head) with right-padded prompts and emits the first token.

    Args:
        tokens: [B, T] int32 prompts, right-padded to a bucket T.
        lengths: [B] int32 true prompt lengths (>= 1).
        max_new_tokens: [B] int32 per-row budgets in [1, opts.max_new_tokens]; None gives every
            row opts.max_new_tokens.
    """
    batch, width = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    cache = target.init_cache(batch, opts.cache_length)
    hidden, cache, captured = target(tokens, positions, cache, eagle.capture_layers(head), kernels=opts.kernels)
    rows = jnp.arange(batch)
    rng, select_rng = jax.random.split(rng)
    first = sampling_lib.select(target.logits(hidden[rows, lengths - 1]), opts.sampling, select_rng)
    k = opts.k
    state = DecodeState(
        cache=cache.replace(lengths=lengths),
        next_token=first,
        output=jnp.zeros((batch, opts.max_new_tokens + k + 1), jnp.int32),
        num_generated=jnp.zeros((batch,), jnp.int32),
        done=jnp.zeros((batch,), bool),
        rng=rng,
        num_steps=jnp.zeros((batch,), jnp.int32),
        accepted_per_position=jnp.zeros((batch, max(k, 1)), jnp.int32),
        max_new_tokens=(jnp.full((batch,), opts.max_new_tokens, jnp.int32) if max_new_tokens is None
                        else jnp.minimum(max_new_tokens.astype(jnp.int32), opts.max_new_tokens)),
    )
    state = append_tokens(state, first[:, None], jnp.ones((batch,), jnp.int32), opts)
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
    )


def _draft_choice(logits, head, opts: Options, rng, vocab_size: int):
    """A draft token (target ids) and, when sampling, its distribution q over the target vocabulary."""
    if opts.sampling.greedy:
        return head.to_target_ids(jnp.argmax(logits, axis=-1).astype(jnp.int32)), None
    probs = sampling_lib.probabilities(logits, opts.sampling)
    draft_ids = sampling_lib.sample_from(probs, rng)
    if probs.shape[-1] != vocab_size:  # EAGLE-3: scatter q from the draft vocabulary into the target's
        targets = head.to_target_ids(jnp.arange(probs.shape[-1], dtype=jnp.int32))
        probs = jnp.zeros(probs.shape[:-1] + (vocab_size,), probs.dtype).at[..., targets].set(probs)
    return head.to_target_ids(draft_ids), probs


def read_pending(target: llama.Llama, head, state: DecodeState, attend_length: int | None = None,
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


def last_pending(state: DecodeState, x: jax.Array) -> jax.Array:
    """The entry of `x` [B, k+1, ...] (a `read_pending` output) at each row's last pending pair."""
    return x[jnp.arange(x.shape[0]), state.pending_count - 1]


def draft(target: llama.Llama, head, state: DecodeState, opts: Options, rng: jax.Array):
    """Drafts k tokens: one wide forward over the pending pairs, then k-1 single-token steps.

    Returns:
        (draft ids [B, k] int32, draft probs [B, k, V] or None, updated draft cache).
    """
    batch, k, vocab = state.next_token.shape[0], opts.k, target.config.vocab_size
    features, logits, cache = read_pending(target, head, state, opts.attend_length, opts.kernels)
    feature, logits = last_pending(state, features), last_pending(state, logits)
    rngs = jax.random.split(rng, k)
    token, probs = _draft_choice(logits, head, opts, rngs[0], vocab)
    ids = jnp.zeros((batch, k), jnp.int32).at[:, 0].set(token)
    all_probs = None if probs is None else jnp.zeros((batch, k, vocab), probs.dtype).at[:, 0].set(probs)
    position = state.cache.lengths  # slot of the first drafted token

    def body(j, carry):
        ids, all_probs, feature, cache = carry
        token = ids[:, j - 1]
        out, logits, cache = head(token[:, None], feature[:, None], (position + j - 1)[:, None], cache, target,
                                  attend_length=opts.attend_length, kernels=opts.kernels)
        token, probs = _draft_choice(logits[:, 0], head, opts, rngs[j], vocab)
        ids = ids.at[:, j].set(token)
        if all_probs is not None:
            all_probs = all_probs.at[:, j].set(probs)
        return ids, all_probs, out[:, 0], cache

    ids, all_probs, _, cache = jax.lax.fori_loop(1, k, body, (ids, all_probs, feature, cache),
                                                 unroll=opts.unroll_draft)
    return ids, all_probs, cache


def step(target: llama.Llama, head, state: DecodeState, opts: Options) -> DecodeState:
    """One speculative step (or one plain decode step when k == 0), chain or tree.

    With `opts.disable_by_batch_size`, a `lax.cond` on the active rows picks a step of k drafts
    (or the tree) or of none, in the same program: nothing recompiles and the host is not asked.
    """
    def speculate(state):  # a chain of k drafts, or the tree
        if opts.tree is not None:
            return _tree_step(target, head, state, opts)
        return _step(target, head, state, opts, opts.k)

    if not opts.k or opts.disable_by_batch_size is None:
        return speculate(state)
    busy = jnp.sum(~state.done) > opts.disable_by_batch_size
    return jax.lax.cond(busy, lambda s: _step(target, head, s, opts, 0), speculate, state)


def _step(target: llama.Llama, head, state: DecodeState, opts: Options, k: int) -> DecodeState:
    """A chain step drafting `k` tokens: opts.k, or 0 (with a head: a plain step that keeps its state)."""
    batch = state.next_token.shape[0]
    uses_head = bool(opts.k)  # the state carries a draft cache and pending pairs
    rng, draft_rng, accept_rng = jax.random.split(state.rng, 3)
    if k:
        draft_ids, draft_probs, draft_cache = draft(target, head, state, opts, draft_rng)
    else:
        draft_ids, draft_probs, draft_cache = jnp.zeros((batch, 0), jnp.int32), None, None
        if uses_head:  # no drafts, but the pending pairs still enter the draft cache
            _, _, draft_cache = read_pending(target, head, state, opts.attend_length, opts.kernels)
    committed = state.cache.lengths
    verify_tokens = jnp.concatenate([state.next_token[:, None], draft_ids], axis=1)  # [B, k+1]
    positions = committed[:, None] + jnp.arange(k + 1, dtype=jnp.int32)
    hidden, cache, captured = target(verify_tokens, positions, state.cache, eagle.capture_layers(head) if uses_head else (),
                                     attend_length=opts.attend_length, kernels=opts.kernels)
    logits = target.logits(hidden)  # [B, k+1, V]
    if opts.sampling.greedy:
        num_accepted, next_token = acceptance.greedy(draft_ids, jnp.argmax(logits, axis=-1).astype(jnp.int32))
    elif k:
        target_probs = sampling_lib.probabilities(logits, opts.sampling)
        num_accepted, next_token = acceptance.rejection(draft_ids, draft_probs, target_probs, accept_rng)
    else:
        num_accepted = jnp.zeros((batch,), jnp.int32)
        next_token = sampling_lib.select(logits[:, 0], opts.sampling, accept_rng)
    features = eagle.target_features(head, hidden, captured) if uses_head else None
    return _commit(state, opts, rng, cache, draft_ids, num_accepted, next_token, draft_cache, features)


def draft_tree(target: llama.Llama, head, state: DecodeState, opts: Options):
    """Drafts this step's EAGLE-2 tree: the pending pairs first, then `tree_draft.draft`.

    Returns:
        (the `tree.Tree`, the updated draft cache).
    """
    features, logits, draft_cache = read_pending(target, head, state, kernels=opts.kernels)
    return tree_draft.draft(target, head, draft_cache, last_pending(state, features), last_pending(state, logits),
                            state.next_token, state.cache.lengths, opts.tree, opts.sampling, opts.kernels,
                            unroll=opts.unroll_draft)


def _tree_step(target: llama.Llama, head, state: DecodeState, opts: Options) -> DecodeState:
    """One EAGLE-2 step: draft a tree, verify its N+1 nodes in one forward, accept, compact, commit."""
    rng, accept_rng = jax.random.split(state.rng)
    committed = state.cache.lengths
    nodes, draft_cache = draft_tree(target, head, state, opts)
    # Node i is written to slot L + i at position L + depth; it sees the context and its ancestors
    # (the root, node 0, at L: so the Pallas attention kernel can take the tree, `among_new`).
    mask = layers.SlotMask(committed, attention_ops.visible_slots(committed, nodes.ancestors, state.cache.max_length),
                           among_new=nodes.ancestors)
    hidden, cache, captured = target(nodes.tokens, committed[:, None] + nodes.depths, state.cache,
                                     eagle.capture_layers(head), mask=mask, kernels=opts.kernels)
    choices = sampling_lib.select(target.logits(hidden), opts.sampling, accept_rng)  # [B, N+1]: one draw per node
    num_accepted, next_token, path = tree_lib.accept(nodes, choices, opts.k)
    # The path's entries to slots L..L+k, in one kernel for every layer under the Pallas settings.
    cache = kv_cache_lib.compact(cache, committed, path, layers.fused_kernels(opts.decode_kernels))
    on_path = lambda x: None if x is None else jnp.take_along_axis(x, path[..., None], axis=1)
    drafts = jnp.take_along_axis(nodes.tokens, path[:, 1:], axis=1)
    return _commit(state, opts, rng, cache, drafts, num_accepted, next_token, draft_cache,
                   eagle.target_features(head, on_path(hidden), on_path(captured)))


def _commit(state: DecodeState, opts: Options, rng: jax.Array, cache: kv_cache_lib.KVCache, drafts: jax.Array,
            num_accepted: jax.Array, next_token: jax.Array, draft_cache: kv_cache_lib.KVCache | None,
            features: jax.Array | None) -> DecodeState:
    """Emits the accepted drafts and the next token, advances the cursors, queues the pending pairs.

    Args:
        cache: the target cache after the verify, the accepted positions at slots L..L+num_accepted.
        drafts: [B, k] the drafts along the accepted path (those past num_accepted are not used);
            k is opts.k, or 0 for a step that did not draft (plain, or paused by disable_by_batch_size).
        draft_cache: the head's cache after eating the pending pairs (and drafting); None without a head.
        features: [B, k+1, D] the head-space target features at the path's positions, root first.
    """
    k, batch = drafts.shape[1], state.next_token.shape[0]
    active = ~state.done
    committed = state.cache.lengths
    # Emitted this step: the accepted drafts, then the correction or bonus token.
    index = jnp.arange(k + 1, dtype=jnp.int32)
    padded_drafts = jnp.concatenate([drafts, jnp.zeros((batch, 1), jnp.int32)], axis=1)
    emitted = jnp.where(index[None] < num_accepted[:, None], padded_drafts, next_token[:, None])
    new = append_tokens(state, emitted, num_accepted + 1, opts)
    # EOS or the budget may keep fewer tokens than the step produced: a draft counts as accepted
    # only if it was emitted (a finished row emits nothing, so it counts nothing either).
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
    )


def run_steps(target: llama.Llama, head, state: DecodeState, num_steps: int, opts: Options,
              steps_per_check: int = 1, stop_on_finish: bool = False,
              min_finished: jax.Array | int = 1) -> DecodeState:
    """Up to `num_steps` steps on the device, stopping early once every row is done.

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


def stats(state: DecodeState, opts: Options) -> list[dict[str, Any]]:
    """Per-row acceptance counters (host numbers) in vLLM's conventions.

    `num_drafts` counts the steps that drafted while the row was active; a draft counts as
    accepted only if it was also emitted (EOS or the budget may cut a step's accepted drafts).
    So a row's tokens number 1 + num_drafts + num_accepted_tokens, plus one per step where
    speculation was disabled, or one fewer when its last step was cut before the correction or
    bonus token.
    """
    k = opts.k
    steps = jax.device_get(state.num_drafts if k else state.num_steps)
    per_position = jax.device_get(state.accepted_per_position)[:, :k]
    rows = []
    for row_steps, row_accepted in zip(steps, per_position):
        drafts, accepted = int(row_steps), int(row_accepted.sum())
        rows.append(dict(
            num_drafts=drafts if k else 0,
            num_draft_tokens=drafts * opts.num_draft_tokens,
            num_accepted_tokens=accepted,
            acceptance_length=1 + accepted / drafts if drafts and k else 1.0,
            acceptance_rate_per_position=[int(a) / drafts if drafts else 0.0 for a in row_accepted],
        ))
    return rows
