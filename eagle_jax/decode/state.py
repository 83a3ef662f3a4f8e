"""What the decode loop carries (`DecodeState`), what fixes its programs (`Options`), and the
acceptance counters the host reads from it (`stats`).

Positions. The target cache holds committed tokens t_0..t_{L-1}; `next_token` is t_L, already
emitted, not yet in the cache. Draft slot i holds the pair (t_{i+1}, f_i), f_i being the target
feature at position i, at rotary position i. Pairs whose feature is known but that the draft has
not consumed yet wait in `pending_*` (1 to k+1 of them); the step's first draft forward eats
them and so refreshes the draft cache with true features for every accepted token.

Sampling. Each row carries its own settings (`params`, `sampling.SamplingParams`) through one
compiled program; `Options.sampling_mode` (static) says which processors that program traces
(`processors`, whose "Integration" section is what `speculative`, `chain` and `tree_step` do).
"""

from __future__ import annotations

from typing import Any

import jax
from flax import struct

from eagle_jax.decode import processors
from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.decode import tree as tree_lib
from eagle_jax.kernels import decode_attention
from eagle_jax.model import kv_cache as kv_cache_lib
from eagle_jax.model import layers


@struct.dataclass
class DecodeState:
    """Everything the loop carries, per row. Donated to each call.

    `num_generated` is also the counter that seeded rows fold into their keys
    (`sampling.row_keys`): it grows at every step a row is active, so a seeded row never reuses a
    key, and its keys depend on its own seed and history alone, not on its neighbours.
    """

    cache: kv_cache_lib.KVCache
    next_token: jax.Array  # [B] int32
    output: jax.Array  # [B, max_new_tokens + k + 1] int32 generated tokens
    num_generated: jax.Array  # [B] int32
    done: jax.Array  # [B] bool
    rng: jax.Array  # the key unseeded rows split theirs from, advanced every step
    num_steps: jax.Array  # [B] int32 target forwards after prefill while active
    accepted_per_position: jax.Array  # [B, max(k, 1)] int32 drafts accepted and emitted at each depth
    max_new_tokens: jax.Array  # [B] int32 each row's budget, <= Options.max_new_tokens
    params: sampling_lib.SamplingParams  # each row's settings and stop ids, written at prefill / insert
    counts: processors.TokenCounts | None = None  # the penalties' token counts (sampling_mode.penalties)
    # Log-probabilities of each output token, aligned with `output` (sampling_mode.logprobs not None).
    logprobs: sampling_lib.Logprobs | None = None
    draft_cache: kv_cache_lib.KVCache | None = None
    pending_tokens: jax.Array | None = None  # [B, k+1] int32
    pending_features: jax.Array | None = None  # [B, k+1, D]
    pending_count: jax.Array | None = None  # [B] int32
    num_drafts: jax.Array | None = None  # [B] int32 steps that drafted while active (<= num_steps)
    num_draft_tokens: jax.Array | None = None  # [B] int32 drafts those steps verified (a step's k, or a tree's nodes)


@struct.dataclass
class Options:
    """Static settings of one compiled program (hashable; part of the jit cache key).

    With a tree, k is its depth (num_steps): the most drafts one step can accept.
    """

    k: int = struct.field(pytree_node=False, default=0)
    # Drafts a chain step of this program makes, at most k; None: k. The state's shapes follow k
    # (output headroom, pending pairs, per-position counters), so programs that share one state
    # may draft fewer: the continuous scheduler's row buckets each draft what suits their rows
    # (`EngineConfig.speculative_tokens_by_rows`).
    step_k: int | None = struct.field(pytree_node=False, default=None)
    tree: tree_lib.TreeOptions | None = struct.field(pytree_node=False, default=None)
    # What the program's rows may ask for (`sampling.SamplingMode`); the default, greedy without
    # processors, traces the plain argmax program. Every row's `params` must be covered by it.
    sampling_mode: sampling_lib.SamplingMode = struct.field(pytree_node=False, default=sampling_lib.SamplingMode())
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
        if self.step_k is not None and (self.tree is not None or not 0 <= self.step_k <= self.k):
            raise ValueError(f"step_k must be in 0..k={self.k} and without a tree, got {self.step_k}")
        if self.attend_length is not None and (self.tree is not None or not 0 < self.attend_length <= self.cache_length):
            raise ValueError(f"attend_length must be in 1..cache_length={self.cache_length} and without a tree, "
                             f"got {self.attend_length}")
        if not isinstance(self.sampling_mode, sampling_lib.SamplingMode):
            raise ValueError(f"sampling_mode must be a sampling.SamplingMode, got {self.sampling_mode!r}")

    @property
    def kernels(self) -> layers.Kernels:
        """What every forward of these programs runs its cached calls in."""
        return layers.Kernels(self.decode_kernels, self.attention_tiling)

    @property
    def num_draft_tokens(self) -> int:
        """Drafts verified per step."""
        if self.tree is not None:
            return self.tree.num_draft_tokens
        return self.k if self.step_k is None else self.step_k

    @property
    def cache_headroom(self) -> int:
        """Cache slots past a row's committed length that one step may write."""
        return self.tree.cache_headroom if self.tree is not None else self.k + 1


def stats(state: DecodeState, opts: Options) -> list[dict[str, Any]]:
    """Per-row acceptance counters (host numbers) in vLLM's conventions.

    `num_drafts` counts the steps that drafted while the row was active; a draft counts as
    accepted only if it was also emitted (EOS or the budget may cut a step's accepted drafts).
    So a row's tokens number 1 + num_drafts + num_accepted_tokens, plus one per step where
    speculation was disabled, or one fewer when its last step was cut before the correction or
    bonus token. `num_draft_tokens` counts what those steps drafted and verified: their k each
    (which may differ between programs sharing the state, `Options.step_k`), or a tree's nodes.
    """
    k = opts.k
    steps, draft_tokens = jax.device_get((state.num_drafts if k else state.num_steps,
                                          state.num_draft_tokens if k else state.num_steps))
    per_position = jax.device_get(state.accepted_per_position)[:, :k]
    rows = []
    for row_steps, row_draft_tokens, row_accepted in zip(steps, draft_tokens, per_position):
        drafts, accepted = int(row_steps), int(row_accepted.sum())
        rows.append(dict(
            num_drafts=drafts if k else 0,
            num_draft_tokens=int(row_draft_tokens) if k else 0,
            num_accepted_tokens=accepted,
            acceptance_length=1 + accepted / drafts if drafts and k else 1.0,
            acceptance_rate_per_position=[int(a) / drafts if drafts else 0.0 for a in row_accepted],
        ))
    return rows
