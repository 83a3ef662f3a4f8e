"""`Result`: one prompt's generation, as every host loop returns it."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass
class Result:
    """One prompt's generation.

    `first_token_seconds` and `finish_seconds` count host wall-clock time from the start of the
    `generate` call (every prompt arriving then) to the host sync (after prefill or a device call)
    at which the loop first held the prompt's first token, and its last, compilation inside the
    call included: their resolution is one device call of steps_per_call steps.
    """

    token_ids: list[int]
    seconds: float  # static: its batch's wall time; continuous: from its prefill to its harvest
    compile_seconds: float  # compilation the call that produced it ran (0 when all were compiled before)
    stats: dict  # acceptance counters (`decode.state.stats`)
    first_token_seconds: float
    finish_seconds: float
    # What the host loop that produced it asked of the device (`scheduler.CallCounts.as_dict()`),
    # shared by the prompts of one continuous call or one static batch.
    calls: dict = dataclasses.field(default_factory=dict)
    # "stop": a stop id (EOS, a stop token id) or a stop string ended it; "length": its budget did
    # (vLLM's and OpenAI's finish_reason; "abort" for a request cancelled in flight).
    finish_reason: str = "length"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it; None for EOS
    # Per token, when its Sampling asked for logprobs: {"token_id", "logprob", "rank", "top_logprobs":
    # [{"token_id", "logprob"}, ...]}, plus "token" and "bytes" (OpenAI's fields) given a tokenizer.
    logprobs: list[dict] | None = None
    text: str | None = None  # the decoded output, cut before a stop string (given a tokenizer)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0


def pooled_stats(results: Sequence[Result], k: int) -> dict:
    """Acceptance over many results, pooled over all drafts (vLLM's convention, not a mean of means)."""
    drafts = sum(r.stats["num_drafts"] for r in results)
    accepted = sum(r.stats["num_accepted_tokens"] for r in results)
    per_position = np.zeros(k)
    for result in results:
        per_position += np.asarray(result.stats["acceptance_rate_per_position"][:k], float) * result.stats["num_drafts"]
    return dict(acceptance_length=1 + accepted / drafts if drafts else 1.0, num_drafts=drafts,
                num_draft_tokens=sum(r.stats.get("num_draft_tokens", 0) for r in results), num_accepted_tokens=accepted, acceptance_rate_per_position=(per_position / max(drafts, 1)).tolist())
