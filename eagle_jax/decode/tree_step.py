"""A tree step: draft an EAGLE-2 tree (`tree_draft`), verify its N+1 nodes in one target forward
with a tree mask, accept the longest agreeing path (`tree.accept`), move that path's target keys
and values into consecutive slots, and commit exactly as the chain does, k being the tree's depth.

Processors see each node's path: its target distribution is processed with the drafts from the
root to it as the penalties' prefix (`tree.path_tokens`) and its depth as its emitted count, and
the target draws one token per node from that (the argmax for greedy rows): `tree.accept`
then keeps the exact law of plain sampling under every row's settings.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from eagle_jax.decode import chain
from eagle_jax.decode import commit as commit_lib
from eagle_jax.decode import row_sampling
from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.decode import state as state_lib
from eagle_jax.decode import tree as tree_lib
from eagle_jax.decode import tree_draft
from eagle_jax.model import attention_ops
from eagle_jax.model import eagle
from eagle_jax.model import kv_cache as kv_cache_lib
from eagle_jax.model import layers
from eagle_jax.model import llama


def ranker(head, state: state_lib.DecodeState, opts: state_lib.Options, vocab_size: int) -> tree_draft.Rank | None:
    """How the tree ranks candidates under the rows' processors; None when nothing processes logits."""
    if not opts.sampling_mode.processes:
        return None

    def rank(logits, paths, depth):  # logits [B, F, V_draft], paths [B, F, D]; children emit token num_generated + depth
        emitted = jnp.broadcast_to((state.num_generated + depth)[:, None], logits.shape[:2])
        processed = row_sampling.process(state, opts, row_sampling.in_target_vocab(head, logits, vocab_size), paths,
                                         emitted)
        # Greedy rows rank by their penalised softmax (their distribution is one-hot, useless to rank by).
        return jax.nn.log_softmax(processed, axis=-1)

    return rank


def draft_tree(target: llama.Llama, head, state: state_lib.DecodeState, opts: state_lib.Options):
    """Drafts this step's EAGLE-2 tree: the pending pairs first, then `tree_draft.draft`.

    Returns:
        (the `tree.Tree`, the updated draft cache).
    """
    features, logits, draft_cache = chain.read_pending(target, head, state, kernels=opts.kernels)
    return tree_draft.draft(target, head, draft_cache, chain.last_pending(state, features),
                            chain.last_pending(state, logits), state.next_token, state.cache.lengths, opts.tree,
                            ranker(head, state, opts, target.config.vocab_size), opts.kernels,
                            unroll=opts.unroll_draft)


def step(target: llama.Llama, head, state: state_lib.DecodeState, opts: state_lib.Options) -> state_lib.DecodeState:
    """One EAGLE-2 step: draft a tree, verify its N+1 nodes in one forward, accept, compact, commit."""
    rng, step_rng = jax.random.split(state.rng)
    committed = state.cache.lengths
    nodes, draft_cache = draft_tree(target, head, state, opts)
    # Node i is written to slot L + i at position L + depth; it sees the context and its ancestors
    # (the root, node 0, at L: so the Pallas attention kernel can take the tree, `among_new`).
    mask = layers.SlotMask(committed, attention_ops.visible_slots(committed, nodes.ancestors, state.cache.max_length),
                           among_new=nodes.ancestors)
    hidden, cache, captured = target(nodes.tokens, committed[:, None] + nodes.depths, state.cache,
                                     eagle.capture_layers(head), mask=mask, kernels=opts.kernels)
    processed = row_sampling.process(state, opts, target.logits(hidden), tree_lib.path_tokens(nodes, opts.k),
                                     state.num_generated[:, None] + nodes.depths)  # [B, N+1, V]
    if opts.sampling_mode.sample:  # one draw per node, from the node's own distribution
        choices = sampling_lib.sample(processed, state.params, row_sampling.keys(state, step_rng, 1)[:, 0])
    else:
        choices = sampling_lib.argmax(processed)
    num_accepted, next_token, path = tree_lib.accept(nodes, choices, opts.k)
    # The path's entries to slots L..L+k, in one kernel for every layer under the Pallas settings.
    cache = kv_cache_lib.compact(cache, committed, path, layers.fused_kernels(opts.decode_kernels))
    on_path = lambda x: None if x is None else jnp.take_along_axis(x, path[..., None], axis=1)
    drafts = jnp.take_along_axis(nodes.tokens, path[:, 1:], axis=1)
    logprobs = None
    if opts.sampling_mode.logprobs is not None:  # the path's positions only: [B, k+1, V]
        logprobs = row_sampling.logprobs(opts, on_path(processed), drafts, num_accepted, next_token)
    return commit_lib.commit(state, rng, cache, drafts, num_accepted, next_token, draft_cache,
                             eagle.target_features(head, on_path(hidden), on_path(captured)), logprobs,
                             count_tokens=opts.sampling_mode.penalties, verified_drafts=opts.num_draft_tokens)
