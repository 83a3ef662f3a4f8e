"""Training and inference run the same head: step j of `unrolled_head` is the j-th draft step.

Inference drafts from a state (after prefill, and after some speculative steps) while a wrapper
records the logits of every head forward `chain.draft` makes; the drafted tokens then
extend the sequence, and `unrolled_head` runs over that whole sequence with the target's
features. For base position i = L - 1 (L committed tokens; t_L emitted, not yet committed) step 0
reads (t_L, f_{L-1}) like the draft's first forward, and step j reads (d_j, its own step-(j-1)
output) at rotary position i + j like draft step j, attending to the same keys: so the logits
must agree up to float32 rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eagle_jax.model import eagle
from eagle_jax.decode import speculative
from eagle_jax.train import objective as train_objective
from eagle_jax.decode import chain
from eagle_jax.decode import state as state_lib

K = 4
PROMPT_LENGTHS = (5, 9)
NUM_STEPS = 4  # drafts recorded: after prefill, then after each of 3 speculative steps
WIDTH = 32  # >= the longest prompt + 1 + (NUM_STEPS - 1) * (K + 1) + K = 29


class RecordingHead:
    """A head that records the logits of each of its forwards (run eagerly: values, not tracers)."""

    def __init__(self, head):
        self.head = head
        self.logits = []

    def __call__(self, *args, **kwargs):
        out, logits, cache = self.head(*args, **kwargs)
        self.logits.append(np.asarray(logits))
        return out, logits, cache

    def __getattr__(self, name):
        return getattr(self.head, name)


@pytest.fixture(scope="module")
def target(speculation_target):
    return speculation_target


@pytest.fixture(scope="module")
def heads(target, random_head, agreeing_head):
    cfg = target.config
    return {
        # Two decoder layers: each layer's cache at inference, each layer's diagonal in training.
        # Its first layer runs the code a one-layer head runs (`eagle.forward_layers`), so one
        # EAGLE-3 case covers both (each case drafts eagerly, ~30 s on a CI core).
        "eagle3-two-layers": random_head(cfg, "eagle3", seed=2, draft_vocab_size=64, num_layers=2),
        # EAGLE-1 (with fc's bias): agrees with the target often, so steps accept drafts and
        # later drafts start from several pending pairs at once.
        "eagle-agreeing": agreeing_head(cfg, 0.3, residual=1.0, fc_bias=True, seed=3),
    }


def inference_drafts(target, head):
    """After prefill and after each of the next few speculative steps, per row:
    (tokens t_0..t_L, draft ids [K], draft logits [K, V_draft], pending pair count)."""
    tokens = np.zeros((len(PROMPT_LENGTHS), 16), np.int32)
    for row, length in enumerate(PROMPT_LENGTHS):
        tokens[row, :length] = np.random.default_rng(length).integers(0, 101, length)
    opts = state_lib.Options(k=K, max_new_tokens=32, cache_length=64)
    with jax.disable_jit():  # eager, so the recorder sees values
        state = speculative.start(target, head, jnp.asarray(tokens), jnp.asarray(PROMPT_LENGTHS, jnp.int32),
                                  jax.random.key(0), opts)
        for _ in range(NUM_STEPS):
            recorder = RecordingHead(head)
            draft_ids, _, _ = chain.draft(target, recorder, state, opts)
            assert len(recorder.logits) == K  # one wide forward over the pending pairs, then K - 1 single steps
            output, generated = np.asarray(state.output), np.asarray(state.num_generated)
            pending = np.asarray(state.pending_count)
            for row, length in enumerate(PROMPT_LENGTHS):
                sequence = np.concatenate([tokens[row, :length], output[row, :generated[row]]])
                assert len(sequence) == int(state.cache.lengths[row]) + 1  # committed tokens, then emitted t_L
                logits = [recorder.logits[0][row, pending[row] - 1]] + [step[row, 0] for step in recorder.logits[1:]]
                yield sequence, np.asarray(draft_ids[row]), np.stack(logits), int(pending[row])
            state = speculative.step(target, head, state, opts)


def unrolled_logits(target, head, sequence):
    """`unrolled_head` over one sequence with noise-free target features: [K, n, V_draft].

    The sequence is right-padded to WIDTH (one shape for every call): positions before the
    padding do not see it.
    """
    tokens = jnp.asarray(np.pad(sequence, (0, WIDTH - len(sequence))), jnp.int32)[None]
    is_eagle3 = isinstance(head, eagle.Eagle3Head)
    capture = head.config.feature_layers if is_eagle3 else ()
    hidden, captured, _ = train_objective.target_outputs(target, tokens, capture)
    n = tokens.shape[1] - 1
    # As `train_objective.loss` builds them, less EAGLE-1's training noise.
    features = head.project(captured[:, :n]) if is_eagle3 else hidden[:, :n]
    steps = train_objective.unrolled_head(head, target, tokens, features, K)
    return np.stack([np.asarray(logits[0]) for _, logits in steps])


@pytest.mark.parametrize("kind", ["eagle3-two-layers", "eagle-agreeing"])
def test_unrolled_steps_equal_draft_steps(target, heads, kind):
    head = heads[kind]
    pending_counts = []
    for sequence, draft_ids, draft_logits, pending in inference_drafts(target, head):
        pending_counts.append(pending)
        base = len(sequence) - 2  # i = L - 1: step 0 reads (t_L, f_{L-1})
        unrolled = unrolled_logits(target, head, np.concatenate([sequence, draft_ids]))
        for j in range(K):
            np.testing.assert_allclose(unrolled[j, base], draft_logits[j], rtol=1e-4, atol=1e-4,
                                       err_msg=f"{kind}: step {j}, base position {base}")
        # The drafts are the argmax of those logits: the unrolled steps read the very tokens drafted.
        argmax = head.to_target_ids(jnp.asarray(np.argmax(unrolled[:, base], axis=-1), jnp.int32))
        assert np.asarray(argmax).tolist() == draft_ids.tolist()
    if kind == "eagle-agreeing":
        assert max(pending_counts) > 1  # a first draft forward over several pending pairs was covered
