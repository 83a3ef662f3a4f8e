"""OpenAI-compatible request and response bodies, as the `openai` client sends and parses them.

Requests are pydantic models: a field the client may send but this server does not implement
is refused by name (extra="forbid" would refuse the client's own optional fields, so the known
unsupported ones are listed instead). vLLM's extra sampling fields (`top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`) are accepted too, as the
`openai` client passes them through `extra_body`; every field is served per request.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal, Union

import pydantic

MAX_TOP_LOGPROBS = 20  # OpenAI's own cap for chat; completions' `logprobs` is capped at 5 there, here at this too


class Unsupported(ValueError):
    """A request field this server does not implement (an HTTP 400)."""


class SamplingFields(pydantic.BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = pydantic.ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = pydantic.Field(default=None, ge=1)
    temperature: float | None = pydantic.Field(default=None, ge=0, le=2)
    top_p: float | None = pydantic.Field(default=None, gt=0, le=1)
    n: int = pydantic.Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: dict | None = None
    stop: Union[str, list[str], None] = pydantic.Field(default=None, validate_default=True)
    seed: int | None = pydantic.Field(default=None, ge=0, lt=2**63)
    presence_penalty: float = pydantic.Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = pydantic.Field(default=0.0, ge=-2, le=2)
    user: str | None = None
    # vLLM's extra parameters
    top_k: int = pydantic.Field(default=0, ge=0)
    min_p: float = pydantic.Field(default=0.0, ge=0, le=1)
    repetition_penalty: float = pydantic.Field(default=1.0, gt=0, le=10)
    ignore_eos: bool = False
    min_tokens: int = pydantic.Field(default=0, ge=0)
    stop_token_ids: list[int] = pydantic.Field(default_factory=list)

    @pydantic.field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop strings, got {len(stops)}")
        return stops

    def reject_unknown(self, supported_extras: tuple[str, ...] = ()) -> None:
        """Refuses fields the client sent that nothing here reads (a typo must not pass silently)."""
        unknown = sorted(set(self.model_extra or {}) - set(supported_extras))
        if unknown:
            raise Unsupported(f"unsupported request field(s): {', '.join(unknown)}")

    @property
    def include_usage_in_stream(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = pydantic.Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = pydantic.Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each a string or token ids (the API takes one or a list of either)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        if not prompt:
            raise ValueError("prompt must not be empty")
        return list(prompt)


class ContentPart(pydantic.BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(pydantic.BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[str, list[ContentPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = pydantic.Field(min_length=1)
    max_completion_tokens: int | None = pydantic.Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = pydantic.Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    """OpenAI's error object, which the `openai` client turns into its APIError subclasses."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def add_offsets(entries: list[dict], start: int) -> int:
    """Gives each entry its text offset (completions' `text_offset`), counted from `start`; returns the next."""
    for entry in entries:
        entry["offset"] = start
        start += len(entry["token"])
    return start


def completion_logprobs(entries: list[dict]) -> dict:
    """The completions API's `logprobs` object from per-token entries {token, logprob, top: {token: logprob}}."""
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [e["top"] for e in entries], "text_offset": [e["offset"] for e in entries]}


def chat_logprobs(entries: list[dict]) -> dict:
    """The chat API's `logprobs` object from the same entries."""
    def item(token, logprob):
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
    return {"content": [dict(item(e["token"], e["logprob"]),
                             top_logprobs=[item(t, lp) for t, lp in e["top"].items()]) for e in entries]}


def completion_response(request_id: str, model: str, choices: list[dict], usage_: dict | None,
                        created: int | None = None, chunk: bool = False) -> dict:
    """A completion, or one chunk of a streamed one (the same object there)."""
    return {"id": request_id, "object": "text_completion", "created": created or int(time.time()),
            "model": model, "choices": choices, "usage": usage_}


def chat_response(request_id: str, model: str, choices: list[dict], usage_: dict | None,
                  created: int | None = None, chunk: bool = False) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk" if chunk else "chat.completion",
            "created": created or int(time.time()), "model": model, "choices": choices,
            **({"usage": usage_} if usage_ is not None or not chunk else {})}
