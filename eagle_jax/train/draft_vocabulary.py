"""An EAGLE-3 head's draft vocabulary: the target tokens its lm_head scores.

A head drafts over a subset of the target's vocabulary (`Eagle3Head.d2t`: draft id i is target
id i + d2t[i]), chosen as the tokens most frequent in the trained text; the smaller it is, the
cheaper the head's lm_head, and the more of the text's tokens a draft cannot propose.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import nnx

from eagle_jax.model import eagle


def token_counts(dataset: dict[str, np.ndarray], vocab_size: int) -> np.ndarray:
    """How often each target token appears among the trained (assistant) tokens."""
    return np.bincount(dataset["input_ids"][dataset["loss_mask"]].ravel(), minlength=vocab_size)[:vocab_size]


def draft_vocabulary(token_counts: np.ndarray, size: int) -> np.ndarray:
    """d2t for the `size` most frequent target tokens: draft id i -> target id i + d2t[i] (ids ascending)."""
    if size > len(token_counts):
        raise ValueError(f"draft_vocab_size {size} exceeds the target vocabulary {len(token_counts)}")
    chosen = np.sort(np.argsort(-token_counts, kind="stable")[:size])
    return (chosen - np.arange(size)).astype(np.int32)


def extend_draft_vocabulary(head: eagle.Eagle3Head, token_counts: np.ndarray, size: int,
                            output_embedding: np.ndarray) -> eagle.Eagle3Head:
    """A trained EAGLE-3 head with a `size`-token draft vocabulary: its own tokens plus the most
    frequent others (by `token_counts`), for draft-vocabulary sweeps that continue a trained head.

    The rest of the head is shared, and so are the trained tokens' lm_head columns. Each added
    token's column starts where a least-squares fit over the trained ones puts it: a column as a
    linear function of its token's row of the target's `output_embedding` [V, D], the token's log
    count and a constant (frequent tokens score higher a priori). A trained head's columns follow
    the target's geometry closely. Measured on a CPU on 2026-12-01 (commit d109116,
    `benchmarks/vocab_init_probe.py`; docs/training.md): a 16,384-token head whose 8,192 added
    columns were placed from an 8,192-token head's agreed with the target's top-1 token 0.923 of
    the time at once, against 0.817 with every added column at the trained columns' mean, and
    0.925 once trained.
    """
    old_size = head.config.draft_vocab_size
    if not old_size <= size <= len(token_counts):
        raise ValueError(f"a {old_size}-token draft vocabulary extends to {old_size}..{len(token_counts)} "
                         f"tokens, not {size}")
    old_ids = np.arange(old_size) + np.asarray(head.d2t[...])
    by_count = np.argsort(-token_counts, kind="stable")
    added = by_count[~np.isin(by_count, old_ids)][:size - old_size]
    new_ids = np.sort(np.concatenate([old_ids, added]))
    kernel = np.asarray(head.lm_head.kernel[...], np.float64)  # [hidden, old_size]
    embedding = np.asarray(output_embedding, np.float64)
    features = lambda ids: np.concatenate([embedding[ids], np.log1p(token_counts[ids])[:, None],
                                           np.ones((len(ids), 1))], axis=1)
    fit, *_ = np.linalg.lstsq(features(old_ids), kernel.T, rcond=None)
    columns = np.zeros((kernel.shape[0], size))
    is_old = np.isin(new_ids, old_ids)
    columns[:, is_old] = kernel  # new_ids is sorted and old_ids too: the trained columns keep their order
    columns[:, ~is_old] = (features(new_ids[~is_old]) @ fit).T
    extended = eagle.make_head(dataclasses.replace(head.config, draft_vocab_size=size), rngs=nnx.Rngs(0),
                               dtype=head.lm_head.dtype, param_dtype=head.lm_head.kernel[...].dtype)
    extended.fc, extended.midlayer, extended.layers, extended.norm = head.fc, head.midlayer, head.layers, head.norm
    extended.lm_head.kernel[...] = jnp.asarray(columns, head.lm_head.kernel[...].dtype)
    extended.d2t[...] = jnp.asarray(new_ids - np.arange(size), jnp.int32)
    return extended
