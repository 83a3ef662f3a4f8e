"""What the HTTP side needs to read and check requests, with no engine at hand.

The server's handlers encode prompts, build each request's `Sampling` (the server's defaults
where a request sends none), refuse settings the compiled programs do not serve, and detokenize
outputs. `RequestRules` holds what that takes: the tokenizer and a few numbers of the engine. The
in-process `online.OnlineEngine` builds one from its engine; the HTTP process of a server whose
engine runs in a process of its own (`engine_process`) builds one from what that process reports.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.io import tokenization
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import text as text_lib


def refusal(mode: sampling_lib.SamplingMode, sampling: sampling_lib.Sampling) -> str:
    """Why a server's programs (`mode`: all processors, or --greedy-only's none) cannot serve these
    settings, naming the field and the server flag that decides it."""
    if sampling.logprobs is not None and mode.logprobs is not None and sampling.logprobs > mode.logprobs:
        return f"logprobs (top_logprobs) must be at most {mode.logprobs} here (--max-logprobs)"
    asked = ((not sampling.greedy, "temperature > 0"), (sampling.penalised, "repetition, presence and frequency penalties"),
             (sampling.min_tokens > 0, "min_tokens"), (sampling.logprobs is not None, "logprobs"))
    what = next((name for used, name in asked if used), "these settings")
    return f"{what}: not served by this server, which runs with --greedy-only"


@dataclasses.dataclass(frozen=True)
class Limits:
    """The engine's numbers the HTTP side checks requests against (picklable: the engine's process
    sends them to the HTTP process).

    Args:
        defaults: the temperature and top-p of a request that sends none (`--temperature`, `--top-p`).
        mode: what the compiled programs serve (`Engine.config.mode_for`).
        vocab_size, eos_ids: the target's.
        max_model_len: the context: prompt plus output tokens.
    """

    defaults: sampling_lib.Sampling
    mode: sampling_lib.SamplingMode
    vocab_size: int
    eos_ids: tuple[int, ...]
    max_model_len: int


class RequestRules:
    """`Limits` and the target's tokenizer: a request's prompt ids, settings and text stream."""

    def __init__(self, tokenizer, limits: Limits):
        self.tokenizer, self.limits = tokenizer, limits

    def sampling(self, temperature: float | None = None, top_p: float | None = None, **fields) -> sampling_lib.Sampling:
        """A request's `Sampling`: the server's defaults where it sends no temperature or top_p.

        Raises:
            ValueError: a value out of range, naming the field.
        """
        defaults = self.limits.defaults
        return sampling_lib.Sampling(temperature=defaults.temperature if temperature is None else temperature,
                                     top_p=defaults.top_p if top_p is None else top_p, **fields)

    def check_sampling(self, sampling: sampling_lib.Sampling) -> None:
        """Refuses settings the compiled programs cannot serve, or stop ids outside the vocabulary."""
        if not self.limits.mode.covers(sampling):
            raise config_lib.InputError(refusal(self.limits.mode, sampling))
        vocab = self.limits.vocab_size
        if any(i >= vocab for i in sampling.stop_token_ids):
            raise config_lib.InputError(f"stop_token_ids must be below the vocabulary size {vocab}")

    def text_stream(self, stop: Sequence[str], stop_token_ids: Sequence[int], ignore_eos: bool = False):
        """The detokenizer and stop matcher of one request (EOS is a stop token unless ignored)."""
        ids = tuple(stop_token_ids) + (() if ignore_eos else self.limits.eos_ids)
        return text_lib.TextStream(self.tokenizer, stop=stop, stop_token_ids=ids)

    def encode_text(self, text: str) -> list[int]:
        return tokenization.encode(self.tokenizer, text, chat=False)

    def encode_messages(self, messages: list[dict]) -> list[int]:
        return tokenization.encode_messages(self.tokenizer, messages)
