"""Prompts and budgets checked before anything runs, and the fixed shapes they are padded to.

Every check raises `config.InputError` naming the first bad prompt, token id or budget, so the
CLI reports it as one line and nothing has streamed yet.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.serve import config as config_lib

MIN_BUCKET = 16


def as_token_ids(ids, vocab_size: int) -> np.ndarray:
    """Validates one prompt's token ids and returns them as int32.

    int64 ids (what `argmax` or a tokenizer returns) are range-checked, then cast: feeding
    them unchecked to an int32 program would wrap silently.
    """
    array = np.asarray(ids)
    if array.ndim != 1 or array.size == 0:
        raise config_lib.InputError(f"a prompt must be a non-empty 1-D sequence of token ids, got shape {array.shape}")
    if not np.issubdtype(array.dtype, np.integer):
        raise config_lib.InputError(f"token ids must be integers, got dtype {array.dtype}")
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise config_lib.InputError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return array.astype(np.int32)


def bucket_length(length: int, max_length: int) -> int:
    """Power-of-two width (>= MIN_BUCKET) for prefill and cache, capped at max_length."""
    return min(max(MIN_BUCKET, 1 << (length - 1).bit_length()), max_length)


def row_buckets(batch_size: int) -> tuple[int, ...]:
    """The row counts a continuous refill prefills: powers of 4 below `batch_size`, and
    `batch_size`: (1, 4, 16, 64) at 64 slots. A refill of n requests prefills the smallest that
    holds n, so one request arriving at 64 slots prefills one row, not 64, while the start-up
    compiles grow with the log of the slots."""
    return tuple(4 ** i for i in range(8) if 4 ** i < batch_size) + (batch_size,)


def smallest_bucket(size: int, buckets: Sequence[int]) -> int:
    """The smallest of `buckets` (ascending) that holds `size` (rows, or a prompt's tokens)."""
    return next(bucket for bucket in buckets if bucket >= size)


def fixed_max_length(longest_prompt: int, max_new_tokens: int, headroom: int, limit: int) -> int:
    """The smallest power-of-two `max_length` (capped at `limit`) whose fixed shapes take these prompts.

    Fixed shapes (`fixed_shapes=True` and the continuous scheduler) prefill max_length // 2
    tokens and keep a max_length cache for every prompt; attention reads the whole cache, so a
    cache sized to the request rather than to `limit` is cheaper at every step. `headroom` is
    the cache slots one step may write past the committed length (`EngineConfig.cache_headroom`:
    k + 1 for a chain of k drafts).
    """
    return bucket_length(max(longest_prompt + max_new_tokens + headroom, 2 * longest_prompt), limit)


def budgets(max_new_tokens: int | Sequence[int], num_prompts: int) -> list[int]:
    """One budget for every prompt, or one each, as a list of ints >= 1."""
    if isinstance(max_new_tokens, (int, np.integer)):
        values = [int(max_new_tokens)] * num_prompts
    else:
        values = [int(budget) for budget in max_new_tokens]
        if len(values) != num_prompts:
            raise config_lib.InputError(f"{len(values)} max_new_tokens values for {num_prompts} prompts")
    for budget in values:
        if budget < 1:
            raise config_lib.InputError(f"max_new_tokens must be >= 1, got {budget}")
    return values


def check_prompts(prompts: Sequence[Sequence[int]], row_budgets: Sequence[int], vocab_size: int, max_length: int,
                  config: config_lib.EngineConfig) -> list[np.ndarray]:
    """The prompts as int32 arrays, once each is checked to be in the vocabulary and to fit the cache.

    Args:
        row_budgets: each prompt's max_new_tokens (`budgets`).
        max_length: the engine's cache limit (`EngineConfig.max_length`, capped by the target).
    """
    arrays = [as_token_ids(prompt, vocab_size) for prompt in prompts]
    headroom = config.cache_headroom
    for index, (prompt, budget) in enumerate(zip(arrays, row_budgets)):
        needed = len(prompt) + budget + headroom
        if needed > max_length:
            drafting = f"k={config.k}" if config.tree is None else f"a {headroom}-slot tree step"
            raise config_lib.InputError(f"prompt {index} has {len(prompt)} tokens; with {budget} new tokens and "
                                        f"{drafting} it needs {needed} cache slots, more than max_length={max_length}")
        if config.scheduler == "continuous" and len(prompt) > max_length // 2:
            raise config_lib.InputError(f"prompt {index} has {len(prompt)} tokens; the continuous scheduler takes up "
                                        f"to max_length // 2 = {max_length // 2}")
    return arrays


def pad_rows(prompts: Sequence[np.ndarray], rows: Sequence[int], batch_size: int,
             width: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [batch_size, width] int32, lengths [batch_size] int32): prompt i right-padded in row
    rows[i]; the other rows hold one token (idle rows, which the caller marks done or skips)."""
    tokens = np.zeros((batch_size, width), np.int32)
    lengths = np.ones((batch_size,), np.int32)
    for prompt, row in zip(prompts, rows):
        tokens[row, :len(prompt)] = prompt
        lengths[row] = len(prompt)
    return tokens, lengths


def samplings(sampling, num_prompts: int, vocab_size: int, tokenizer=None) -> list[sampling_lib.Sampling]:
    """One `Sampling` for every prompt, or one each, checked against the vocabulary and the tokenizer.

    Raises:
        config.InputError: a count that does not match the prompts, something not a `Sampling`, a
            stop token id outside the vocabulary, or stop strings without a tokenizer to find them.
    """
    if isinstance(sampling, sampling_lib.Sampling):
        values = [sampling] * num_prompts
    else:
        values = list(sampling)
        if len(values) != num_prompts:
            raise config_lib.InputError(f"{len(values)} sampling settings for {num_prompts} prompts")
    for index, value in enumerate(values):
        if not isinstance(value, sampling_lib.Sampling):
            raise config_lib.InputError(f"sampling {index} must be a sampling.Sampling, got {value!r:.80}")
        bad = [i for i in value.stop_token_ids if i >= vocab_size]
        if bad:
            raise config_lib.InputError(f"sampling {index}: stop token id {bad[0]} is outside the vocabulary "
                                        f"[0, {vocab_size})")
        if value.stop and tokenizer is None:
            raise config_lib.InputError(f"sampling {index} has stop strings: pass the tokenizer that finds them")
    return values


def eos_ids(ids) -> tuple[int, ...]:
    """The EOS ids as a tuple, at most `sampling.MAX_EOS_IDS` (they share each row's stop-id array)."""
    ids = tuple(int(i) for i in ids)
    if len(ids) > sampling_lib.MAX_EOS_IDS:
        raise config_lib.InputError(f"at most {sampling_lib.MAX_EOS_IDS} EOS ids, got {len(ids)}")
    return ids
