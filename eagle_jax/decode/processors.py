"""Logit processors as pure array functions: the min_tokens stop mask, penalties, temperature,
min-p / top-k / top-p masks, and the token counts the penalties read, position by position under
speculation.

Every function takes logits [B, T, V] (T positions per row: 1 for plain decoding, k + 1 for a
chain verify, the node count for a tree) and per-row settings as [B] arrays
(`sampling.SamplingParams`), and returns float32 logits with removed tokens at -inf, so one
compiled program serves rows with different settings. `process` applies them in vLLM's order:
the min_tokens mask, penalties, temperature, min-p, then top-k and top-p. The rejection sampler reproduces whatever
distribution the target's processed logits give, so speculation stays exact under any of them
(vLLM applies them to the target before its rejection sampler in the same way).

Integration
-----------
The decode step does this (`decode.state`, `speculative.start`, `chain`, `tree_step`, `commit`,
through `row_sampling`). What it carries, per row, in its (donated) state:

* ``params``: a `sampling.SamplingParams` ([B] arrays, stop ids [B, S]), replaced row by row when
  a slot is refilled. The static `sampling.SamplingMode` (`state.Options.sampling_mode`) is part
  of the jit key; it `covers` every row (`SamplingMode.of(samplings)` or a generous fixed one).
* ``counts``: a `TokenCounts` (only when ``mode.penalties``): ``output`` [B, V] int32, how often
  each token was emitted (the prefill's first token included, the prompt not), and ``prompt``
  [B, V] bool, the prompt's tokens (for the repetition penalty). At insert:
  ``TokenCounts.create(prompt_ids, prompt_lengths, V)``; after the prefill's first token:
  ``counts.add(first[:, None])``; after each step: ``counts.commit(drafts, num_accepted,
  next_token)``. 5 B x V bytes per row (246 KB at V = 49,152).
* a per-row counter for seeded rows (the row's number of emitted tokens, `num_generated`):
  ``sampling.row_keys(params, rng, counter)`` gives each row its own key. The same count, plus
  the position's depth, is what ``emitted`` passes for the min_tokens mask.

Where the step calls what:

1. Prefill's first token: ``sampling.sample(process(logits[:, None], params, mode, counts,
   emitted=0), params, keys)`` (T = 1, no prefix); ``sampling.argmax`` when ``not mode.sample``.
2. Draft step j of a chain: the draft's logits [B, 1, V] in target vocabulary through
   ``process(..., counts, prefix=drafts_so_far[:, None], emitted=num_generated + j)`` (drafts
   not drawn yet are `NO_TOKEN`), so q is the draft's own distribution under the same
   processors; draw with ``sampling.sample`` and keep q = ``sampling.distribution`` ([B, V] per
   step; greedy rows get a one-hot q, and a greedy-only mode passes ``draft_probs=None``).
3. Verify: the target's logits [B, k+1, V] through ``process(..., counts,
   prefix=chain_prefix(drafts), emitted=num_generated + j)``, so position j counts the row's
   output plus drafts 0..j-1; then ``acceptance.verify(drafts, q, processed, params, mode, keys)``
   (greedy mode: prefix match on the processed argmax; otherwise rejection sampling). A tree
   passes for each node the tokens on the path from the root to it (`NO_TOKEN`-padded,
   `tree.path_tokens`) as its prefix and num_generated + its depth as its emitted count, and
   draws once per node.
4. Logprobs (``mode.logprobs is not None``): ``sampling.logprobs(processed,
   emitted_ids(drafts, num_accepted, next_token), mode.logprobs)`` on the verify's processed
   logits; the host keeps positions 0..num_accepted.
5. Commit: ``counts.commit(drafts, num_accepted, next_token)``.

Cost: the processed logits are [B, T, V] float32 like the logits (1.6 MB per row at T = 8,
V = 49,152); the drafts' effect on the counts touches [B, T, P] entries only, never a
[B, T, V] int array. top-p sorts [B, T, V]; top-k alone runs `lax.top_k` with the mode's cap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import struct

if TYPE_CHECKING:  # sampling imports this module; the types are for readers only
    from eagle_jax.decode import sampling

NO_TOKEN = -1  # padding in prefixes and token lists: counts nothing


def _rows(values: jax.Array, ndim: int) -> jax.Array:
    """[B] per-row values shaped to broadcast against an array of `ndim` dims led by B."""
    return jnp.asarray(values).reshape((-1,) + (1,) * (ndim - 1))


def chain_prefix(drafts: jax.Array) -> jax.Array:
    """The drafts before each verified position of a chain: [B, k] -> [B, k+1, k].

    Entry [b, j, i] is drafts[b, i] for i < j and `NO_TOKEN` otherwise: position j is verified
    after drafts 0..j-1, so its penalties count them.
    """
    k = drafts.shape[1]
    before = jnp.arange(k)[None, :] < jnp.arange(k + 1)[:, None]  # [k+1, k]
    return jnp.where(before[None], drafts[:, None, :], NO_TOKEN).astype(jnp.int32)


def mask_stop_ids(logits: jax.Array, stop_ids: jax.Array, min_tokens: jax.Array, emitted: jax.Array) -> jax.Array:
    """vLLM's min_tokens: a row's stop ids (EOS included) get -inf at positions where it has emitted
    fewer than min_tokens tokens, so that no position may end the row too early.

    Args:
        logits: [B, T, V].
        stop_ids: [B, S] int32, `NO_TOKEN`-padded.
        min_tokens: [B] int32.
        emitted: [B, T] int32, the row's tokens emitted before each position (a draft or verify
            position j of a chain: `num_generated + j`; a tree node: `num_generated + depth`).
    """
    batch, positions, vocab = logits.shape
    blocked = (emitted < min_tokens[:, None])[..., None] & (stop_ids >= 0)[:, None, :]  # [B, T, S]
    columns = jnp.where(blocked, jnp.broadcast_to(stop_ids[:, None, :], blocked.shape), vocab)  # vocab: dropped
    rows = jnp.arange(batch)[:, None, None]
    steps = jnp.arange(positions)[None, :, None]
    return logits.at[rows, steps, columns].set(-jnp.inf, mode="drop")


def _penalize_values(values, counts, seen, repetition, presence, frequency):
    """HF/vLLM repetition penalty on seen tokens, then OpenAI presence/frequency on output counts."""
    seen = seen | (counts > 0)
    values = jnp.where(seen, jnp.where(values > 0, values / repetition, values * repetition), values)
    return values - frequency * counts.astype(jnp.float32) - presence * (counts > 0).astype(jnp.float32)


def penalize(logits: jax.Array, output_counts: jax.Array, prompt_seen: jax.Array,
             repetition_penalty: jax.Array, presence_penalty: jax.Array, frequency_penalty: jax.Array,
             prefix: jax.Array | None = None) -> jax.Array:
    """Repetition, presence and frequency penalties, position by position.

    Repetition (HF, vLLM): a token seen in the prompt or the output has its logit divided by the
    penalty when positive and multiplied by it when negative. Presence and frequency (OpenAI,
    vLLM): subtract ``presence * (count > 0) + frequency * count`` over output tokens only.

    Args:
        logits: [B, T, V].
        output_counts: [B, V] int32 counts of the row's emitted tokens.
        prompt_seen: [B, V] bool, tokens of the row's prompt.
        repetition_penalty, presence_penalty, frequency_penalty: [B] float32.
        prefix: [B, T, P] int32, tokens emitted before position t beyond `output_counts`
            (`chain_prefix(drafts)` for a verify), `NO_TOKEN`-padded; None for none.
    Returns:
        [B, T, V] float32 penalised logits.
    """
    logits = logits.astype(jnp.float32)
    batch, positions, vocab = logits.shape
    repetition, presence, frequency = (_rows(x, 3) for x in (repetition_penalty, presence_penalty, frequency_penalty))
    out = _penalize_values(logits, output_counts[:, None, :], prompt_seen[:, None, :], repetition, presence, frequency)
    if prefix is None or prefix.shape[-1] == 0:
        return out
    # Only the prefix's own tokens change: recompute those columns with their counts raised by
    # how often they occur in the prefix, and write them back (duplicates write equal values).
    valid = prefix >= 0
    columns = jnp.where(valid, prefix, 0)  # [B, T, P]
    raw = jnp.take_along_axis(logits, columns, axis=-1)
    base = jnp.take_along_axis(output_counts[:, None, :], columns, axis=-1)
    seen = jnp.take_along_axis(prompt_seen[:, None, :], columns, axis=-1)
    repeats = jnp.sum((prefix[..., :, None] == prefix[..., None, :]) & valid[..., None, :], axis=-1)  # [B, T, P]
    new = _penalize_values(raw, base + repeats.astype(base.dtype), seen, repetition, presence, frequency)
    rows = jnp.arange(batch)[:, None, None]
    steps = jnp.arange(positions)[None, :, None]
    return out.at[rows, steps, jnp.where(valid, prefix, vocab)].set(new, mode="drop")


def apply_temperature(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """logits / T per row; rows with T = 0 (greedy) are left unscaled (their argmax is unchanged).

    Args:
        logits: [B, ..., V]; temperature: [B].
    """
    temperature = _rows(temperature, logits.ndim)
    greedy = temperature <= 0
    return jnp.where(greedy, logits, logits / jnp.where(greedy, 1.0, temperature)).astype(jnp.float32)


def top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array, top_k_cap: int, use_top_p: bool) -> jax.Array:
    """Masks (to -inf) tokens outside each row's top-k, then outside the top-p nucleus of what is left.

    top-k keeps every token tied with the k-th largest logit; top-p keeps the smallest prefix
    of tokens, by probability, whose mass reaches top_p (the token crossing it included, and every
    token tied with it), computed on the top-k-renormalised distribution, as HF does.

    Args:
        logits: [B, ..., V] float32 (temperature already applied).
        top_k: [B] int32, 0 = off. Values above `top_k_cap` act as the cap.
        top_p: [B] float32 in (0, 1], 1 = off.
        top_k_cap: static, the largest top_k any row may use (0: no row uses top-k).
        use_top_p: static, whether any row has top_p < 1 (it needs a full sort).
    """
    vocab = logits.shape[-1]
    cap = min(top_k_cap, vocab)
    if not cap and not use_top_p:
        return logits
    if use_top_p:
        ordered = -jnp.sort(-logits, axis=-1)  # [..., V] descending
    else:
        ordered = jax.lax.top_k(logits, cap)[0]  # [..., cap] descending
    top_k = _rows(top_k, logits.ndim)
    threshold = jnp.full(logits.shape[:-1] + (1,), -jnp.inf, logits.dtype)
    if cap:
        index = jnp.clip(jnp.minimum(top_k, cap) - 1, 0, None) + jnp.zeros_like(threshold, jnp.int32)  # [..., 1]
        kth = jnp.take_along_axis(ordered, index, axis=-1)
        threshold = jnp.where(top_k > 0, kth, threshold)
    if use_top_p:
        top_p = _rows(top_p, logits.ndim)
        probs = jax.nn.softmax(jnp.where(ordered >= threshold, ordered, -jnp.inf), axis=-1)
        # A token is kept while the mass *before* it is still below top_p (the most likely
        # token always is); ties with the last kept token are kept by the >= below.
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        kept = jnp.sum(mass_before < top_p, axis=-1, keepdims=True)
        nucleus = jnp.take_along_axis(ordered, kept - 1, axis=-1)
        threshold = jnp.where(top_p < 1, jnp.maximum(threshold, nucleus), threshold)
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def apply_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Masks tokens whose probability is below min_p times the most likely token's.

    p(x) / p_max = exp(l_x - l_max), so the test needs no softmax, and it is the same before or
    after renormalising over the top-k / top-p survivors (the most likely token survives both).

    Args:
        logits: [B, ..., V] float32 (temperature already applied); min_p: [B] in [0, 1], 0 = off.
    """
    min_p = _rows(min_p, logits.ndim)
    floor = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(min_p)  # log(0) = -inf keeps everything
    return jnp.where(logits >= floor, logits, -jnp.inf)


@struct.dataclass
class TokenCounts:
    """The tokens each row's penalties see: its output's counts and its prompt's tokens."""

    output: jax.Array  # [B, V] int32: emitted tokens (the first, from the prefill, included)
    prompt: jax.Array  # [B, V] bool: tokens of the prompt (the repetition penalty counts them too)

    @classmethod
    def create(cls, prompt_ids: jax.Array, prompt_lengths: jax.Array, vocab_size: int) -> TokenCounts:
        """No output yet; the prompt's tokens are the first prompt_lengths[b] of prompt_ids [B, S]."""
        batch = prompt_ids.shape[0]
        valid = jnp.arange(prompt_ids.shape[1])[None, :] < prompt_lengths[:, None]
        rows = jnp.arange(batch)[:, None]
        prompt = jnp.zeros((batch, vocab_size), bool).at[rows, jnp.where(valid, prompt_ids, vocab_size)].set(
            True, mode="drop")
        return cls(output=jnp.zeros((batch, vocab_size), jnp.int32), prompt=prompt)

    def add(self, tokens: jax.Array, valid: jax.Array | None = None) -> TokenCounts:
        """Counts tokens [B, n] as emitted, where `valid` [B, n] (`NO_TOKEN` entries never count)."""
        keep = tokens >= 0 if valid is None else valid & (tokens >= 0)
        rows = jnp.arange(tokens.shape[0])[:, None]
        output = self.output.at[rows, jnp.where(keep, tokens, self.output.shape[1])].add(1, mode="drop")
        return self.replace(output=output)

    def commit(self, drafts: jax.Array, num_accepted: jax.Array, next_token: jax.Array) -> TokenCounts:
        """After a step emitted drafts[:, :num_accepted] then next_token (the correction or the bonus).

        Args:
            drafts: [B, k] int32; num_accepted, next_token: [B] int32 (`acceptance.verify`'s outputs).
        """
        accepted = jnp.arange(drafts.shape[1])[None, :] < num_accepted[:, None]
        return self.add(drafts, accepted).add(next_token[:, None])


def emitted_ids(drafts: jax.Array, num_accepted: jax.Array, next_token: jax.Array) -> jax.Array:
    """[B, k+1]: the token emitted at each verified position (drafts, next_token at num_accepted,
    `NO_TOKEN` after it), as `logprobs` wants them."""
    k = drafts.shape[1]
    padded = jnp.concatenate([drafts, jnp.full((drafts.shape[0], 1), NO_TOKEN, drafts.dtype)], axis=1)  # k may be 0
    position = jnp.arange(k + 1)[None, :]
    ids = jnp.where(position < num_accepted[:, None], padded, NO_TOKEN)
    return jnp.where(position == num_accepted[:, None], next_token[:, None], ids).astype(jnp.int32)


def process(logits: jax.Array, params: sampling.SamplingParams, mode: sampling.SamplingMode,
            counts: TokenCounts | None = None, prefix: jax.Array | None = None,
            emitted: jax.Array | None = None) -> jax.Array:
    """All processors in vLLM's order: the min_tokens mask, penalties, temperature, min-p, top-k, top-p.

    Greedy rows keep temperature 1 (their argmax, and their "processed" logprobs, are those of the
    penalised logits); `SamplingParams` gives them no min-p, top-k or top-p. Processors no row of
    `mode` uses are not traced at all, so a greedy mode without penalties returns the logits
    unchanged (as float32) and keeps the argmax program.

    Args:
        logits: [B, T, V] (any [B, ..., V] without penalties; params of one row broadcast to all).
        params: the rows' settings.
        mode: static; must cover every row (`SamplingMode.covers`).
        counts: the rows' `TokenCounts`; required when `mode.penalties`.
        prefix: [B, T, P] int32 tokens emitted before each position beyond `counts` (a verify's
            `chain_prefix(drafts)`), `NO_TOKEN`-padded; None for none.
        emitted: [B, T] int32 tokens the row emitted before each position (`mask_stop_ids`);
            required when `mode.min_tokens`.
    Returns:
        [B, T, V] float32, removed tokens at -inf.
    """
    logits = logits.astype(jnp.float32)
    if mode.min_tokens:
        if emitted is None or logits.ndim != 3:
            raise ValueError("min_tokens needs logits [B, T, V] and the tokens emitted before each position")
        logits = mask_stop_ids(logits, params.stop_ids, params.min_tokens, emitted)
    if mode.penalties:
        if counts is None or logits.ndim != 3:
            raise ValueError("penalties need logits [B, T, V] and the rows' TokenCounts")
        logits = penalize(logits, counts.output, counts.prompt, params.repetition_penalty,
                          params.presence_penalty, params.frequency_penalty, prefix)
    if not mode.sample:
        return logits
    logits = apply_temperature(logits, params.temperature)
    if mode.min_p:
        logits = apply_min_p(logits, params.min_p)
    return top_k_top_p(logits, params.top_k, params.top_p, mode.top_k, mode.top_p)
