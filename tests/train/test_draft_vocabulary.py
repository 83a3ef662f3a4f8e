"""The EAGLE-3 draft vocabulary (`train.draft_vocabulary`): the most frequent tokens, and a trained
head's vocabulary extended with its trained columns kept."""

from __future__ import annotations

import numpy as np
import pytest

from eagle_jax.train import draft_vocabulary
from eagle_jax.train import trainer as train


def test_draft_vocabulary_picks_most_frequent_tokens():
    counts = np.array([5, 0, 9, 1, 7, 0])
    d2t = draft_vocabulary.draft_vocabulary(counts, 3)
    assert sorted((np.arange(3) + d2t).tolist()) == [0, 2, 4]
    with pytest.raises(ValueError):
        draft_vocabulary.draft_vocabulary(counts, 7)


def test_an_extended_draft_vocabulary_keeps_trained_columns_and_places_the_added_ones(target_and_data):
    """`--init-head` with a larger `--draft-vocab-size`: the trained tokens keep their columns, the
    most frequent others join, each at the column a least-squares fit over the trained ones puts
    it: where the trained columns are exactly a linear function of (output embedding, log count,
    1), the added columns are that function too."""
    import jax
    import jax.numpy as jnp

    target, dataset, _ = target_and_data
    counts = draft_vocabulary.token_counts(dataset, 61)
    head = train.new_head(target.config, train.TrainConfig(method="eagle3", draft_vocab_size=40), counts)
    embedding = np.asarray(target.output_embedding(), np.float64)  # [61, D]
    assert embedding.shape[1] + 2 <= 40  # more trained columns than the fit has unknowns per column
    rng = np.random.default_rng(0)
    mapping = rng.standard_normal((embedding.shape[1] + 2, embedding.shape[1]))
    column = lambda ids: (np.concatenate([embedding[ids], np.log1p(counts[ids])[:, None],
                                          np.ones((len(ids), 1))], axis=1) @ mapping).T
    old_ids = np.asarray(head.to_target_ids(jnp.arange(40)))
    head.lm_head.kernel[...] = jnp.asarray(column(old_ids), jnp.float32)
    extended = draft_vocabulary.extend_draft_vocabulary(head, counts, 50, embedding)
    new_ids = np.asarray(extended.to_target_ids(jnp.arange(50)))
    assert set(old_ids) < set(new_ids) and list(new_ids) == sorted(new_ids)
    added = sorted(set(new_ids) - set(old_ids))
    assert counts[added].min() >= np.sort(counts[~np.isin(np.arange(61), new_ids)]).max(initial=0)
    np.testing.assert_allclose(extended.lm_head.kernel[...], column(new_ids), rtol=1e-4, atol=1e-4)
    hidden = jax.random.normal(jax.random.key(0), (64, target.config.hidden_size))
    old_logits, new_logits = head.logits(hidden, target), extended.logits(hidden, target)
    # The trained columns unchanged (a matmul of another width may sum in another order: equal to rounding).
    np.testing.assert_allclose(new_logits[:, np.searchsorted(new_ids, old_ids)], old_logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="extends"):
        draft_vocabulary.extend_draft_vocabulary(head, counts, 10, embedding)
