"""EAGLE-2 dynamic draft trees as static-shape arrays: expansion, rerank, masks, acceptance.

Settings (SGLang's names): K = `topk`, D = `num_steps`, N = `num_draft_tokens`. Unlike SGLang,
N counts the drafted nodes only, not the root: K = 1, D = N = k is the chain of k drafts.

Drafting (`tree_draft`) grows a pool of candidates. Depth 1 holds the root's K best children by
draft log-probability; each further depth expands the K best nodes of the depth before (the
frontier) into K children each and keeps the K best of those K^2 as its frontier. A node's score
is the sum of the log-probabilities along its path. Every node generated, K + (D-1)K^2 of them,
is a candidate, and the N best form the tree (EAGLE-2's rerank; SafeAILab's and SGLang's pool).
The pool is laid out depth by depth, so a parent precedes its children; a child scores at most
its parent (log-probabilities are <= 0) and `lax.top_k` puts the lower index first on ties, so
the N best contain every chosen node's parent: the tree is connected.

A step's tree (`Tree`): node 0 is the root, the token emitted last step (t_L at position L, not
yet in the target cache); nodes 1..N are the chosen candidates in pool order, so parents precede
children and siblings keep their draft rank. Node i has position L + depth[i] and, during the
verify forward, cache slot L + i.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct



def check(topk, num_steps, num_draft_tokens, names=("topk", "num_steps", "num_draft_tokens")) -> str | None:
    """The first thing wrong with these settings, naming them as `names` spells them; None if valid.

    N >= D: a tree of N nodes is at most N deep, so deeper drafting would be wasted.
    N <= K + (D-1)K^2: the pool holds no more candidates.
    """
    topk_name, steps_name, tokens_name = names
    for name, value in ((topk_name, topk), (steps_name, num_steps)):
        if not (isinstance(value, (int, np.integer)) and value >= 1):
            return f"{name} must be an integer >= 1, got {value}"
    pool = topk + (num_steps - 1) * topk ** 2
    if not (isinstance(num_draft_tokens, (int, np.integer)) and num_steps <= num_draft_tokens <= pool):
        return (f"{tokens_name} must be an integer from {steps_name} ({num_steps}) to {topk_name} + "
                f"({steps_name} - 1) * {topk_name}^2 ({pool}), got {num_draft_tokens}")
    return None


@dataclasses.dataclass(frozen=True)
class TreeOptions:
    """The static shape of the draft tree (hashable: part of a compiled program's key)."""

    topk: int  # K: children per expanded node, and nodes expanded per depth
    num_steps: int  # D: depth of the tree (head forwards per step)
    num_draft_tokens: int  # N: drafted nodes verified per step, the root excluded

    def __post_init__(self):
        problem = check(self.topk, self.num_steps, self.num_draft_tokens)
        if problem:
            raise ValueError(problem)

    @property
    def pool_size(self) -> int:
        return self.topk + (self.num_steps - 1) * self.topk ** 2

    @property
    def cache_headroom(self) -> int:
        """Cache slots past the committed length one step writes: the verify's N + 1 nodes in the
        target cache, or the (D-1)K frontier nodes the head reads in the draft cache."""
        return max(self.num_draft_tokens + 1, (self.num_steps - 1) * self.topk)

    def pool_depths(self) -> np.ndarray:
        """[pool_size] depth of each pool entry (the pool is laid out depth by depth)."""
        widths = [self.topk] + [self.topk ** 2] * (self.num_steps - 1)
        return np.repeat(np.arange(1, self.num_steps + 1), widths).astype(np.int32)


@struct.dataclass
class Tree:
    """One step's draft tree per row (see the module docstring for the node order)."""

    tokens: jax.Array  # [B, N+1] int32 target ids; node 0 is the root
    parents: jax.Array  # [B, N+1] int32 parent node; the root is its own parent
    depths: jax.Array  # [B, N+1] int32; the root's is 0
    ancestors: jax.Array  # [B, N+1, N+1] bool: [b, i, j] iff node j is node i or one of its ancestors
    scores: jax.Array  # [B, N+1] float32 cumulative draft log-probabilities; the root's is 0


# XLA's GPU top-k kernel runs one block of threads per row: a frontier's K rows of a 16 k draft
# vocabulary keep K of the H200's 132 SMs busy. Splitting each row into chunks of this many gives
# the kernel K * V / CHUNK rows; the K best of each chunk then go through a second, short top-k
# (XLA sorts rows that short). H200, [1, K, 16384] float32 (docs/results/kernels_h200.json,
# draft_top_k): top-8 42.7 µs in one call, 16.3 µs in two stages; top-4 14.8 against 10.2.
# Chunks of 1,024 beat 256 and 128 (whose first stage XLA also lowers to a sort).
TOP_K_CHUNK = 1024


def top_k(values: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k` over the last axis, in two stages for long rows: the same values and indices,
    ties included (the lower index first: chunks are laid out in order, each chunk's best in
    `lax.top_k`'s order, and the second stage keeps that order among equals)."""
    length = values.shape[-1]
    if length < 4 * TOP_K_CHUNK or k > TOP_K_CHUNK:
        return jax.lax.top_k(values, k)
    chunks = -(-length // TOP_K_CHUNK)
    padded = jnp.pad(values, [(0, 0)] * (values.ndim - 1) + [(0, chunks * TOP_K_CHUNK - length)],
                     constant_values=-jnp.inf)  # pads sit past every real index, so they lose ties
    best, local = jax.lax.top_k(padded.reshape(values.shape[:-1] + (chunks, TOP_K_CHUNK)), k)  # [..., C, k]
    indices = local + (jnp.arange(chunks, dtype=local.dtype) * TOP_K_CHUNK)[:, None]
    flat = lambda x: x.reshape(values.shape[:-1] + (chunks * k,))
    top, position = jax.lax.top_k(flat(best), k)
    return top, jnp.take_along_axis(flat(indices), position, axis=-1)


def expand(scores: jax.Array, log_probs: jax.Array, topk: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The K best children of each of F nodes, scored by cumulative log-probability.

    Args:
        scores: [B, F] the nodes' own scores.
        log_probs: [B, F, V] their children's draft log-probabilities.
    Returns:
        (scores [B, F*K], draft ids [B, F*K] int32, parent [B, F*K] int32 in 0..F-1), parent-major.
    """
    batch, width = scores.shape
    child_log_probs, ids = top_k(log_probs, topk)
    parents = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32)[:, None], (width, topk))
    flat = lambda x: x.reshape(batch, width * topk)
    return flat(scores[..., None] + child_log_probs), flat(ids.astype(jnp.int32)), flat(jnp.broadcast_to(parents, ids.shape))


def ancestor_matrix(parents: jax.Array, max_depth: int) -> jax.Array:
    """[B, T, T] bool: [b, i, j] iff node j is node i or an ancestor of it, for parents [B, T] (the
    root its own parent) of a tree at most `max_depth` deep: each pass adds one generation."""
    size = parents.shape[1]
    ancestors = jnp.broadcast_to(jnp.eye(size, dtype=bool), parents.shape + (size,))
    for _ in range(max_depth):
        ancestors = ancestors | jnp.take_along_axis(ancestors, parents[..., None], axis=1)
    return ancestors


def select(pool_tokens: jax.Array, pool_scores: jax.Array, pool_parents: jax.Array, root_token: jax.Array,
           opts: TreeOptions) -> Tree:
    """The tree of the N best pool candidates (EAGLE-2's rerank).

    Args:
        pool_tokens, pool_scores: [B, P] target ids and cumulative log-probabilities.
        pool_parents: [B, P] int32 pool index of each candidate's parent, -1 for the root.
        root_token: [B] int32.
    """
    batch = pool_scores.shape[0]
    _, chosen = jax.lax.top_k(pool_scores, opts.num_draft_tokens)
    chosen = jnp.sort(chosen, axis=1)  # pool order: parents before children
    rows = jnp.arange(batch)[:, None]
    node_ids = jnp.arange(1, opts.num_draft_tokens + 1, dtype=jnp.int32)
    node_of = jnp.zeros(pool_scores.shape, jnp.int32).at[rows, chosen].set(node_ids)  # 0 = not chosen
    parent_entries = jnp.take_along_axis(pool_parents, chosen, axis=1)
    parents = jnp.where(parent_entries < 0, 0, jnp.take_along_axis(node_of, jnp.maximum(parent_entries, 0), axis=1))
    root = jnp.zeros((batch, 1), jnp.int32)
    parents = jnp.concatenate([root, parents], axis=1)
    depths = jnp.concatenate([root, jnp.asarray(opts.pool_depths())[chosen]], axis=1)
    tokens = jnp.concatenate([root_token[:, None], jnp.take_along_axis(pool_tokens, chosen, axis=1)], axis=1)
    scores = jnp.concatenate([jnp.zeros((batch, 1)), jnp.take_along_axis(pool_scores, chosen, axis=1)], axis=1)
    return Tree(tokens=tokens.astype(jnp.int32), parents=parents, depths=depths,
                ancestors=ancestor_matrix(parents, opts.num_steps), scores=scores.astype(jnp.float32))


def path_tokens(tree: Tree, max_depth: int) -> jax.Array:
    """[B, N+1, D] int32: row i lists the drafts on the path to node i, by depth (node i's own token
    last), -1-padded (`processors.NO_TOKEN`): the tokens emitted before the one that follows node i,
    as the penalties of that node's target distribution count them. The root's row is empty."""
    batch, size = tree.tokens.shape
    columns = jnp.where(tree.ancestors & (tree.depths[:, None, :] > 0), tree.depths[:, None, :] - 1, max_depth)
    rows, nodes = jnp.arange(batch)[:, None, None], jnp.arange(size)[None, :, None]
    return jnp.full((batch, size, max_depth), -1, jnp.int32).at[rows, nodes, columns].set(
        jnp.broadcast_to(tree.tokens[:, None, :], columns.shape), mode="drop")


def accept(tree: Tree, choices: jax.Array, max_depth: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The longest root-to-node path whose every draft the target chose.

    `choices[b, i]` is the target's token after node i: its argmax (greedy) or a sample from its
    distribution. Sampling stays exact: the drafts are fixed before the target's draws, so at each
    node this is SpecInfer's multi-draft rejection sampling with one-hot draft distributions (try
    the children in order; accept child x with probability p'(x), p' being the target's p with the
    children tried before removed and renormalised; finally draw from p'), which emits child x with
    probability p(x) and any other token y with probability p(y): the same law as one draw from p,
    followed down the child that drew it. Siblings hold distinct tokens (one top-K each), so at
    most one child matches.

    Returns:
        (num_accepted [B] int32, next_token [B] int32: the target's choice after the path's last
        node, path [B, max_depth+1] int32: the path's nodes by depth, root first, 0 past its end).
    """
    agrees = tree.tokens == jnp.take_along_axis(choices, tree.parents, axis=1)
    agrees = agrees.at[:, 0].set(True)
    accepted = ~jnp.any(tree.ancestors & ~agrees[:, None, :], axis=2)  # the node and all its ancestors agree
    best = jnp.argmax(jnp.where(accepted, tree.depths, -1), axis=1)  # the deepest accepted node
    pick = lambda x: jnp.take_along_axis(x, best[:, None], axis=1)[:, 0]
    on_path = jnp.take_along_axis(tree.ancestors, best[:, None, None], axis=1)[:, 0]  # [B, N+1]
    batch, size = on_path.shape
    where_on_path = jnp.where(on_path, tree.depths, max_depth + 1)  # off the path: dropped
    path = jnp.zeros((batch, max_depth + 1), jnp.int32).at[jnp.arange(batch)[:, None], where_on_path].set(
        jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), (batch, size)), mode="drop")
    return pick(tree.depths).astype(jnp.int32), pick(choices).astype(jnp.int32), path
