"""Token selection settings and draws: greedy, temperature, top-k, top-p, min-p, penalties, logprobs,
and the rules that end a request (stop strings and ids, EOS, min_tokens) and multiply it (n).

Three views of the same settings:
  * `Sampling`, one request's settings (vLLM's `SamplingParams` names and ranges, OpenAI's where
    they overlap), a frozen, hashable dataclass. `select` and `probabilities` take one as a
    static argument for a whole batch (the plain-sampling reference the tests compare against).
  * `SamplingParams`, the settings of every row of a batch as [B] arrays (a pytree): rows of one
    continuous batch carry their own settings through the same compiled program.
  * `SamplingMode`, the static shape of such a program: whether any row samples, whether any
    penalty is on, how many candidates top-k sorts, whether top-p sorts the vocabulary, how many
    logprobs come back. A greedy-only batch keeps the plain argmax program.

The logits transforms themselves live in `processors`; how a decode step wires them in is its
"Integration" section.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from eagle_jax.decode import processors

MAX_LOGPROBS = 20  # the most alternatives one position returns (OpenAI's top_logprobs and vLLM's default cap)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range, as vLLM checks)
MAX_STOP_TOKEN_IDS = 8  # a request's stop_token_ids: the device compares each emitted token with them
MAX_EOS_IDS = 8  # a model's EOS ids (Llama 3 has 3); with the stop ids, one row's [STOP_WIDTH] array
STOP_WIDTH = MAX_STOP_TOKEN_IDS + MAX_EOS_IDS
MAX_N = 128  # samples of one prompt (OpenAI's cap)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Sampling:
    """One request's settings; the defaults change nothing (greedy decoding).

    Penalties follow HF and vLLM: `repetition_penalty` divides the positive logits (and multiplies
    the negative ones) of every token seen in the prompt or the output; `presence_penalty` and
    `frequency_penalty` subtract, per token of the output, a constant and a multiple of its count.
    A greedy row (temperature 0) takes the argmax after the penalties; top-k, top-p and min-p do not
    change an argmax, so they are ignored there.
    """

    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0  # 1: off
    top_k: int = 0  # 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None  # a request with a seed draws the same tokens whatever shares its batch
    logprobs: int | None = None  # top alternatives returned per token (0: the chosen token's only), <= MAX_LOGPROBS
    # Ending a request: the output is cut before the first stop string (host side, on the text) and
    # ends at a stop token id or EOS (device side: the row stops, the id is its last token).
    stop: tuple[str, ...] = ()  # a string or a sequence of them is taken too
    stop_token_ids: tuple[int, ...] = ()  # at most MAX_STOP_TOKEN_IDS
    ignore_eos: bool = False  # EOS does not end the request (stop_token_ids still do)
    # EOS and stop_token_ids cannot be drawn before this many tokens (masked in the processors, so
    # draft and target agree and speculation stays exact); stop strings are not held back by it.
    min_tokens: int = 0
    n: int = 1  # samples of the prompt: n rows, each with its own key (`sample_seed` for seeded requests)

    def __post_init__(self):
        # Sequences become tuples, so that the settings stay hashable (a static jit argument).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        for name in ("stop", "stop_token_ids"):
            if isinstance(getattr(self, name), (list, tuple)):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        problem = self.problem()
        if problem:
            raise ValueError(problem)

    def problem(self) -> str | None:
        """The first setting out of range, as a sentence; None if all are valid."""
        finite = lambda value: _is_real(value) and math.isfinite(value)
        if not (finite(self.temperature) and self.temperature >= 0):
            return f"temperature must be a finite number >= 0 (0: greedy), got {self.temperature!r}"
        if not (_is_real(self.top_p) and 0 < self.top_p <= 1):
            return f"top_p must be in (0, 1], got {self.top_p!r}"
        if not (_is_int(self.top_k) and self.top_k >= 0):
            return f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}"
        if not (_is_real(self.min_p) and 0 <= self.min_p <= 1):
            return f"min_p must be in [0, 1], got {self.min_p!r}"
        if not (finite(self.repetition_penalty) and self.repetition_penalty > 0):
            return f"repetition_penalty must be a finite number > 0 (1: off), got {self.repetition_penalty!r}"
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_real(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
                return f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}"
        if self.seed is not None and not (_is_int(self.seed) and -2 ** 63 <= self.seed < 2 ** 64):
            return f"seed must be None or a 64-bit integer, got {self.seed!r}"
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            return f"logprobs must be None or an integer in 0..{MAX_LOGPROBS}, got {self.logprobs!r}"
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            return f"stop must be a non-empty string or a list of them, got {self.stop!r}"
        if not (isinstance(self.stop_token_ids, tuple) and all(_is_int(i) and i >= 0 for i in self.stop_token_ids)
                and len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS):
            return (f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids >= 0, "
                    f"got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            return f"ignore_eos must be true or false, got {self.ignore_eos!r}"
        if not (_is_int(self.min_tokens) and self.min_tokens >= 0):
            return f"min_tokens must be an integer >= 0, got {self.min_tokens!r}"
        if not (_is_int(self.n) and 1 <= self.n <= MAX_N):
            return f"n must be an integer in 1..{MAX_N}, got {self.n!r}"
        return None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalised(self) -> bool:
        """Whether any penalty is on (the row then needs its token counts, `processors.TokenCounts`)."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def stop_ids(self, eos_ids: Iterable[int] = ()) -> tuple[int, ...]:
        """The ids that end this request's rows: the model's EOS ids (unless ignored), then stop_token_ids."""
        return tuple(dict.fromkeys((() if self.ignore_eos else tuple(eos_ids)) + self.stop_token_ids))

    def sample_seed(self, index: int) -> int | None:
        """The seed of sample `index` of n: the request's own for the first, then a splitmix64 step
        per further sample, so that the n rows draw apart and stay reproducible."""
        if self.seed is None or index == 0:
            return self.seed
        return (self.seed + index * 0x9E3779B97F4A7C15) % 2 ** 64


@dataclasses.dataclass(frozen=True)
class SamplingMode:
    """What one compiled program can do: every row it serves must be `covers`-ed (hashable, static).

    The default is the greedy argmax program. A server that wants no recompiles as requests come
    and go picks one generous mode up front (say `top_k=64`) instead of `SamplingMode.of` a batch.
    """

    sample: bool = False  # some row samples; else every row takes the argmax
    penalties: bool = False  # some row has a penalty (greedy rows too: penalties move the argmax)
    min_p: bool = False
    top_k: int = 0  # the largest top_k a row may ask for: `lax.top_k` finds that many candidates
    top_p: bool = False  # some row has top_p < 1: the program sorts the whole vocabulary
    logprobs: int | None = None  # alternatives computed per position (None: no logprobs at all)
    min_tokens: bool = False  # some row masks its stop ids until it has min_tokens tokens

    def __post_init__(self):
        if not (_is_int(self.top_k) and self.top_k >= 0):
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.logprobs is not None and not (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in 0..{MAX_LOGPROBS}, got {self.logprobs!r}")

    @classmethod
    def of(cls, samplings: Iterable[Sampling]) -> SamplingMode:
        """The smallest mode that covers every one of `samplings`."""
        samplings = list(samplings)
        sampled = [s for s in samplings if not s.greedy]
        asked = [s.logprobs for s in samplings if s.logprobs is not None]
        return cls(sample=bool(sampled), penalties=any(s.penalised for s in samplings),
                   min_p=any(s.min_p > 0 for s in sampled), top_k=max([s.top_k for s in sampled], default=0),
                   top_p=any(s.top_p < 1 for s in sampled), logprobs=max(asked) if asked else None,
                   min_tokens=any(s.min_tokens > 0 for s in samplings))

    @property
    def processes(self) -> bool:
        """Whether any processor changes the logits (else the argmax of the raw logits is the token)."""
        return self.sample or self.penalties or self.min_tokens

    def covers(self, sampling: Sampling) -> bool:
        """Whether a row with these settings gets exactly its distribution from this program."""
        if sampling.penalised and not self.penalties:
            return False
        if sampling.logprobs is not None and (self.logprobs is None or sampling.logprobs > self.logprobs):
            return False
        if sampling.min_tokens and not self.min_tokens:
            return False
        if sampling.greedy:
            return True
        return (self.sample and (sampling.min_p == 0 or self.min_p) and sampling.top_k <= self.top_k
                and (sampling.top_p == 1 or self.top_p))


@struct.dataclass
class SamplingParams:
    """Every row's settings as arrays, [B] each (seed [B, 2], stop_ids [B, S]); built by `stack`
    (numpy arrays, the arguments of a program) or `neutral` (jnp, inside one too).

    A greedy row stores top_k 0, top_p 1 and min_p 0 whatever it asked: its processed logits are
    then its penalised logits alone, in any batch (and its argmax is unchanged).
    """

    temperature: jax.Array  # [B] float32; 0: greedy row
    top_p: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32; 0: off
    min_p: jax.Array  # [B] float32
    repetition_penalty: jax.Array  # [B] float32
    presence_penalty: jax.Array  # [B] float32
    frequency_penalty: jax.Array  # [B] float32
    seed: jax.Array  # [B, 2] uint32: the seed's high and low 32 bits (of its value modulo 2^64)
    seeded: jax.Array  # [B] bool
    min_tokens: jax.Array  # [B] int32: the stop ids are masked while fewer tokens were emitted
    stop_ids: jax.Array  # [B, S] int32: ids that end the row (EOS unless ignored, stop_token_ids), -1-padded

    @classmethod
    def stack(cls, samplings: Iterable[Sampling], mode: SamplingMode | None = None, eos_ids: Iterable[int] = (),
              stop_width: int | None = None, seeds: Iterable[int | None] | None = None) -> SamplingParams:
        """The rows' settings, in order; with `mode`, a ValueError names any row it does not cover.

        Args:
            eos_ids: the model's EOS ids, which end every row that does not ignore EOS.
            stop_width: S, the stop ids' width (static in a compiled program); default the widest row's.
            seeds: each row's seed, in place of its `Sampling.seed` (`Sampling.sample_seed` for n > 1).
        """
        samplings = list(samplings)
        if not samplings:
            raise ValueError("SamplingParams.stack needs at least one row")
        if mode is not None:
            uncovered = [i for i, s in enumerate(samplings) if not mode.covers(s)]
            if uncovered:
                raise ValueError(f"rows {uncovered} ask for more than {mode}: first {samplings[uncovered[0]]}")
        eos_ids = tuple(eos_ids)
        stops = [s.stop_ids(eos_ids) for s in samplings]
        width = max(map(len, stops)) if stop_width is None else stop_width
        if any(len(ids) > width for ids in stops):
            raise ValueError(f"a row has {max(map(len, stops))} stop and EOS ids; at most {width} fit")
        # Host (numpy) arrays: a compiled program takes them in one transfer with its other
        # arguments, where a jnp array each would be a device transfer each (a refill's host time).
        column = lambda values, dtype: np.array(list(values), dtype)
        sampled = lambda name, off: (off if s.greedy else getattr(s, name) for s in samplings)
        row_seeds = [s.seed for s in samplings] if seeds is None else list(seeds)
        seeds = [(seed or 0) % 2 ** 64 for seed in row_seeds]
        stop_table = np.full((len(samplings), width), -1, np.int32)
        for row, ids in enumerate(stops):
            stop_table[row, :len(ids)] = ids
        return cls(
            temperature=column((s.temperature for s in samplings), np.float32),
            top_p=column(sampled("top_p", 1.0), np.float32),
            top_k=column(sampled("top_k", 0), np.int32),
            min_p=column(sampled("min_p", 0.0), np.float32),
            repetition_penalty=column((s.repetition_penalty for s in samplings), np.float32),
            presence_penalty=column((s.presence_penalty for s in samplings), np.float32),
            frequency_penalty=column((s.frequency_penalty for s in samplings), np.float32),
            seed=column(([seed >> 32, seed & 0xFFFFFFFF] for seed in seeds), np.uint32).reshape(-1, 2),
            seeded=column((seed is not None for seed in row_seeds), bool),
            min_tokens=column((s.min_tokens for s in samplings), np.int32),
            stop_ids=stop_table,
        )

    @classmethod
    def neutral(cls, batch: int, stop_width: int = 0) -> SamplingParams:
        """Greedy rows that change nothing and stop at no id, built with jnp (so inside a program too):
        idle decode slots hold these (zeros would divide by a repetition penalty of 0)."""
        zeros, ones = jnp.zeros((batch,), jnp.float32), jnp.ones((batch,), jnp.float32)
        return cls(temperature=zeros, top_p=ones, top_k=jnp.zeros((batch,), jnp.int32), min_p=zeros,
                   repetition_penalty=ones, presence_penalty=zeros, frequency_penalty=zeros,
                   seed=jnp.zeros((batch, 2), jnp.uint32), seeded=jnp.zeros((batch,), bool),
                   min_tokens=jnp.zeros((batch,), jnp.int32), stop_ids=jnp.full((batch, stop_width), -1, jnp.int32))

    @property
    def greedy(self) -> jax.Array:
        """[B] bool: rows that take the argmax."""
        return self.temperature == 0


def row_keys(params: SamplingParams, rng: jax.Array, counters: jax.Array) -> jax.Array:
    """One PRNG key per row, [B]: a seeded row's from its seed and `counters` alone, the others' from `rng`.

    Pass as `counters` the rows' generated-token counts: they grow every step, so a seeded row never
    reuses a key, and its keys (hence its tokens) do not depend on the other rows or on `rng`. Split
    a row's key for each use within a step (`jax.vmap(lambda key: jax.random.split(key, n))(keys)`).
    """
    batch = params.seeded.shape[0]
    shared = jax.random.split(rng, batch)
    base = jax.random.key(0, impl=jax.random.key_impl(rng))
    own = jax.vmap(lambda seed, counter: jax.random.fold_in(
        jax.random.fold_in(jax.random.fold_in(base, seed[0]), seed[1]), counter))(params.seed, counters)
    return jnp.where(params.seeded, own, shared)


def argmax(logits: jax.Array) -> jax.Array:
    """int32 argmax over the last axis (argmax would give int64 under x64; ids stay int32 everywhere)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _by_row(flags: jax.Array, ndim: int) -> jax.Array:
    return flags.reshape(flags.shape + (1,) * (ndim - flags.ndim))


def distribution(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """The law tokens are drawn from, [B, ..., V] float32: softmax of processed logits
    (`processors.process`), one-hot at the argmax for greedy rows."""
    logits = logits.astype(jnp.float32)
    one_hot = jax.nn.one_hot(argmax(logits), logits.shape[-1], dtype=jnp.float32)
    return jnp.where(_by_row(params.greedy, logits.ndim), one_hot, jax.nn.softmax(logits, axis=-1))


def sample(logits: jax.Array, params: SamplingParams, keys: jax.Array) -> jax.Array:
    """One int32 token per row and position of processed logits [B, ..., V]; greedy rows take the argmax.

    Args:
        keys: [B] PRNG keys, one per row (`row_keys`); a single key is split across the rows.
    """
    if keys.ndim == 0:
        keys = jax.random.split(keys, logits.shape[0])
    draws = jax.vmap(lambda key, row: jax.random.categorical(key, row, axis=-1))(keys, logits.astype(jnp.float32))
    return jnp.where(_by_row(params.greedy, logits.ndim - 1), argmax(logits), draws.astype(jnp.int32))


@struct.dataclass
class Logprobs:
    """Log-probabilities of chosen tokens and their best alternatives, fixed shapes."""

    token: jax.Array  # [B, T] float32 of each chosen token
    rank: jax.Array  # [B, T] int32: tokens at least as likely as the chosen one (1: the most likely), as vLLM counts
    top_ids: jax.Array  # [B, T, N] int32 the N most likely tokens, best first
    top: jax.Array  # [B, T, N] float32 their log-probabilities (-inf past the tokens the processors kept)


def logprobs(logits: jax.Array, tokens: jax.Array, num_top: int) -> Logprobs:
    """Log-probabilities of `tokens` [B, T] and the `num_top` (static) best alternatives under `logits` [B, T, V].

    Pass processed logits (`processors.process`: vLLM's "processed_logprobs", those the draws used;
    a greedy row's are its penalised logits at temperature 1), or raw ones for vLLM V1's default
    "raw_logprobs". Rows asking for fewer alternatives than `num_top` slice theirs on the host.
    A `processors.NO_TOKEN` entry of `tokens` (a verify position past the emitted ones,
    `processors.emitted_ids`) gets log-probability 0 and rank 0.
    """
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    emitted = tokens >= 0
    token = jnp.take_along_axis(log_probs, jnp.where(emitted, tokens, 0)[..., None], axis=-1)[..., 0]
    rank = jnp.where(emitted, jnp.sum(log_probs >= token[..., None], axis=-1), 0).astype(jnp.int32)
    token = jnp.where(emitted, token, 0.0)
    if num_top:
        top, top_ids = jax.lax.top_k(log_probs, num_top)
    else:
        top, top_ids = jnp.zeros(tokens.shape + (0,), jnp.float32), jnp.zeros(tokens.shape + (0,), jnp.int32)
    return Logprobs(token=token, rank=rank, top_ids=top_ids.astype(jnp.int32), top=top)


def probabilities(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """The distribution one static `Sampling` draws from: softmax(logits / T), then min-p, top-k and
    top-p (`processors`); one-hot at the argmax when greedy.

    Penalties need the rows' token counts, which this interface does not have: a `Sampling` with a
    penalty is refused here (use `processors.process`) rather than silently ignored.

    Args:
        logits: [..., V] float32.
    Returns:
        [..., V] float32 probabilities summing to 1.
    """
    if sampling.penalised:
        raise ValueError(f"penalties need the rows' token counts: use processors.process, not {sampling}")
    params, mode = SamplingParams.stack([sampling]), SamplingMode.of([sampling])  # [1] broadcasts over any rows
    return distribution(processors.process(logits, params, mode), params)


def sample_from(probs: jax.Array, rng: jax.Array) -> jax.Array:
    """Draws one int32 token per row from probabilities [..., V]."""
    return jax.random.categorical(rng, jnp.log(probs), axis=-1).astype(jnp.int32)


def select(logits: jax.Array, sampling: Sampling, rng: jax.Array) -> jax.Array:
    """Next token per row, int32, under one static `Sampling` for every row (no penalties: see
    `probabilities`)."""
    if sampling.penalised:
        raise ValueError(f"penalties need the rows' token counts: use processors.process, not {sampling}")
    if sampling.greedy:
        return argmax(logits)
    return sample_from(probabilities(logits, sampling), rng)
