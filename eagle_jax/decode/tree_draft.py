"""EAGLE-2 tree drafting with an EAGLE head: one `lax.fori_loop` over the depths, static shapes.

The head reads its frontier, K nodes at a time, as the chain reads one draft: a node's input is
(its token, the feature its parent's forward returned) at rotary position L + depth - 1, the
chain's position for a draft that deep. The K nodes of depth d are written to draft cache slots
L + (d-1)K .. L + dK - 1, past the committed context; each attends to the context (slots < L) and
to its own ancestors' slots only (`layers.SlotMask`). Those slots are scratch: the next step
rolls the draft cache back to its committed length and overwrites them, as the chain does.

Candidates are ranked by draft log-probabilities (`rank`): of the head's raw logits in its own
vocabulary when nothing processes them, else of its logits in the target vocabulary through the
rows' processors, each frontier node's penalties counting the drafts on its path (`paths`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from eagle_jax.model import attention_ops
from eagle_jax.model import kv_cache as kv_cache_lib
from eagle_jax.model import layers
from eagle_jax.model import llama
from eagle_jax.decode import processors
from eagle_jax.decode import tree as tree_lib

# rank(logits [B, F, V_draft], paths [B, F, D] target ids of each node's drafts NO_TOKEN-padded,
# depth (the nodes' depth, traced)) -> log-probabilities [B, F, V] of their children in the
# target vocabulary.
Rank = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def draft(target: llama.Llama, head, cache: kv_cache_lib.KVCache, root_feature: jax.Array, root_logits: jax.Array,
          root_token: jax.Array, committed: jax.Array, opts: tree_lib.TreeOptions, rank: Rank | None = None,
          kernels: layers.Kernels = layers.XLA, unroll: bool = False) -> tuple[tree_lib.Tree, kv_cache_lib.KVCache]:
    """Grows the candidate pool depth by depth and returns the reranked tree.

    Args:
        cache: the draft cache, holding the committed context (the pending pairs already read).
        root_feature: [B, D] the head's output at the root (the last pending pair's forward).
        root_logits: [B, V_draft] its logits: the distribution of the root's children.
        root_token: [B] int32 the root's token (emitted last step).
        committed: [B] int32 the target's committed length L (the root's position).
        rank: the children's log-probabilities through the processors (`tree_step.ranker`); None:
            log_softmax of the raw logits in the draft vocabulary (no row processes anything).
        kernels: the head's cached-call kernels (`layers.Kernels`, static).
        unroll: write the loop over depths out (`decode.state.Options.unroll_draft`).
    Returns:
        (the tree, the draft cache with scratch entries past L).
    """
    topk, depth = opts.topk, opts.num_steps
    batch = root_token.shape[0]
    if rank is None:  # ids in the draft vocabulary, mapped to the target's after the top-k
        children = lambda logits, paths, level: jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        to_target = head.to_target_ids
    else:
        children, to_target = rank, lambda ids: ids
    tracks_paths = rank is not None  # only the processors read the paths
    scores, ids, _ = tree_lib.expand(jnp.zeros((batch, 1)), children(
        root_logits[:, None], jnp.full((batch, 1, depth), processors.NO_TOKEN, jnp.int32), jnp.int32(0)), topk)
    tokens = to_target(ids)
    pool_tokens = jnp.zeros((batch, opts.pool_size), jnp.int32).at[:, :topk].set(tokens)
    pool_scores = jnp.full((batch, opts.pool_size), -jnp.inf, jnp.float32).at[:, :topk].set(scores)
    pool_parents = jnp.full((batch, opts.pool_size), -1, jnp.int32)
    if depth > 1:
        width = (depth - 1) * topk  # scratch slots: the frontiers of depths 1..D-1
        paths = jnp.full((batch, topk, depth), processors.NO_TOKEN, jnp.int32).at[:, :, 0].set(tokens)
        frontier = (tokens, scores, jnp.broadcast_to(root_feature[:, None], (batch, topk) + root_feature.shape[1:]),
                    jnp.broadcast_to(jnp.arange(topk, dtype=jnp.int32), (batch, topk)),
                    jnp.zeros((batch, topk, width), bool), paths if tracks_paths else None)

        def body(level, carry):  # reads the frontier at depth `level`, proposes depth level + 1
            (tokens, scores, features, entries, seen, paths), (pool_tokens, pool_scores, pool_parents), cache = carry
            first_slot = (level - 1) * topk
            seen = seen | (jnp.arange(width) == first_slot + jnp.arange(topk)[:, None])[None]  # each sees itself
            mask = layers.SlotMask(committed + first_slot, attention_ops.visible_slots(committed, seen, cache.max_length))
            positions = jnp.broadcast_to((committed + level - 1)[:, None], (batch, topk))
            out, logits, cache = head(tokens, features, positions, cache, target, mask, kernels=kernels)
            child_scores, child_ids, parent = tree_lib.expand(scores, children(logits, paths, level), topk)
            child_tokens = to_target(child_ids)
            start = topk + (level - 1) * topk * topk
            write = lambda pool, new: jax.lax.dynamic_update_slice_in_dim(pool, new.astype(pool.dtype), start, axis=1)
            pool = (write(pool_tokens, child_tokens), write(pool_scores, child_scores),
                    write(pool_parents, jnp.take_along_axis(entries, parent, axis=1)))
            scores, best = jax.lax.top_k(child_scores, topk)
            parent = jnp.take_along_axis(parent, best, axis=1)  # [B, K] frontier index of each new node's parent
            new_tokens = jnp.take_along_axis(child_tokens, best, axis=1)
            if paths is not None:  # the parent's drafts, then the node's own at column `level` (depth level + 1)
                paths = jnp.where(jnp.arange(depth) == level, new_tokens[..., None],
                                  jnp.take_along_axis(paths, parent[..., None], axis=1))
            frontier = (new_tokens, scores, jnp.take_along_axis(out, parent[..., None], axis=1), start + best,
                        jnp.take_along_axis(seen, parent[..., None], axis=1), paths)
            return frontier, pool, cache

        _, (pool_tokens, pool_scores, pool_parents), cache = jax.lax.fori_loop(
            1, depth, body, (frontier, (pool_tokens, pool_scores, pool_parents), cache), unroll=unroll)
    return tree_lib.select(pool_tokens, pool_scores, pool_parents, root_token, opts), cache
