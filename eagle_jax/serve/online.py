"""Online serving: one device-loop thread owns the engine's decode slots; requests arrive at any time.

The HTTP handlers (`server`) run on an asyncio event loop; the device loop runs on its own
thread, because a device call blocks. They meet in two places:

* `submit` (event loop) appends a request to a bounded inbox; the device thread moves the inbox
  into the slot loop (`scheduler.SlotLoop`) at each device-call boundary, where free slots are
  prefilled, so a request waits at most one device call for its prefill.
* Each round's new token ids go back to their request's asyncio queue through
  `call_soon_threadsafe`; `Handle.events()` reads them.

Everything the server will run is compiled in `start`, before `/health` says ready: the slot
programs (every prefill width, the insert, the run loops) for the server's sampling settings,
so no request ever waits on a compilation. End of sequence is detected on the host (as a stop
token): the device programs carry no EOS, so one set of programs serves requests that stop at
EOS and requests that ignore it. A request the host ends (EOS, a stop string, a client gone) is
cancelled in the slot loop, which frees its slot at the next boundary.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time
from typing import Sequence

import jax
import numpy as np

from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.io import tokenization
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import metrics as metrics_lib
from eagle_jax.serve import scheduler as scheduler_lib
from eagle_jax.serve import text as text_lib


class QueueFull(RuntimeError):
    """More requests are waiting than the server queues (an HTTP 429)."""


class Unavailable(RuntimeError):
    """The server is still compiling, or shutting down: it takes no new requests (an HTTP 503)."""


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """A request's sampling settings, as the OpenAI and vLLM APIs name them."""

    temperature: float | None = None  # None: the server's own (its --temperature)
    top_p: float | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    min_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class Chunk:
    """New token ids of one request, as one device call produced them."""

    token_ids: list[int]
    logprobs: list = dataclasses.field(default_factory=list)


class Handle:
    """One request in flight: its events for the HTTP handler, and its cancellation."""

    def __init__(self, owner: "OnlineEngine", prompt_ids: np.ndarray, budget: int, loop: asyncio.AbstractEventLoop):
        self.owner, self.prompt_ids, self.budget, self.loop = owner, prompt_ids, budget, loop
        self.prompt_tokens = len(prompt_ids)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finish_reason = "length"
        self.cancelled = False
        self.arrived = time.perf_counter()
        self.last_token: float | None = None
        self.request_id: int | None = None  # the slot loop's, once the device thread has taken it

    async def events(self):
        """Chunks until the request ends (its budget, or `cancel`)."""
        while True:
            chunk = await self.queue.get()
            if chunk is None:
                return
            yield chunk

    def cancel(self, reason: str = "abort") -> None:
        """Ends the request ("stop": a stop string or token ended it; "abort": the client went away);
        its slot is freed at the next device-call boundary. Idempotent."""
        if not self.cancelled:
            self.cancelled, self.finish_reason = True, reason
            self.owner.cancel(self)

    def _send(self, item) -> None:  # from the device thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class OnlineEngine:
    """The engine's slots, driven by one thread, fed by `submit` from any asyncio handler.

    Args:
        engine: an `Engine` whose config has `scheduler="continuous"`.
        tokenizer: the target's tokenizer (prompts, chat template, EOS, detokenization).
        sampling: what the compiled programs sample with; requests must ask for the same.
        max_queue: requests waiting for a slot before `submit` raises `QueueFull`.
    """

    def __init__(self, engine, tokenizer, model_name: str, sampling: sampling_lib.Sampling = sampling_lib.Sampling(),
                 max_queue: int = 1024, seed: int = 0):
        self.engine, self.tokenizer, self.sampling = engine, tokenizer, sampling
        self.max_queue, self.seed = max_queue, seed
        self.eos_ids = tuple(engine.model_config.eos_token_ids)
        self.metrics = metrics_lib.Metrics(model_name, engine.config.k)
        self.max_model_len = engine.max_length
        self.ready = False
        self._inbox: collections.deque[Handle] = collections.deque()
        self._cancelled: collections.deque[Handle] = collections.deque()
        self._wake = threading.Condition()
        self._draining = False
        self._thread: threading.Thread | None = None
        self._programs = None
        self.error: BaseException | None = None  # why compiling at start failed
        self.last_device_error: Exception | None = None

    # -- called from the event loop -------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], max_tokens: int | None, params: RequestParams, sample: int = 0) -> Handle:
        """Queues one request; `max_tokens` None takes what the context leaves."""
        if self._draining:
            raise Unavailable("the server is shutting down")
        if self._programs is None:
            raise Unavailable("the server is still compiling; GET /health says when it is ready")
        self.check_params(params)
        prompt = self.engine.check_prompts([prompt_ids], [1])[0]  # token ids in the vocabulary, shape
        room = self._programs.widths[-1] if self._programs else self.max_model_len // 2
        if len(prompt) > room:
            raise config_lib.InputError(f"the prompt has {len(prompt)} tokens; this server takes up to {room}")
        budget = max_tokens or self.max_model_len - len(prompt) - self.engine.headroom
        self.engine.check_prompts([prompt], [budget])
        handle = Handle(self, prompt, budget, asyncio.get_running_loop())
        with self._wake:
            if len(self._inbox) + self._waiting >= self.max_queue:
                raise QueueFull(f"{self.max_queue} requests are already waiting; retry later")
            self._inbox.append(handle)
            self._wake.notify()
        return handle

    def cancel(self, handle: Handle) -> None:
        with self._wake:
            self._cancelled.append(handle)
            self._wake.notify()

    def check_params(self, params: RequestParams) -> None:
        """Refuses settings the compiled programs do not sample with, naming the field."""
        compiled = self.sampling
        temperature = compiled.temperature if params.temperature is None else params.temperature
        top_p = compiled.top_p if params.top_p is None else params.top_p
        greedy = temperature == 0
        if greedy != compiled.greedy or (not greedy and (temperature, top_p) != (compiled.temperature, compiled.top_p)):
            raise config_lib.InputError(
                f"this server samples with temperature={compiled.temperature}, top_p={compiled.top_p} (its "
                f"--temperature and --top-p); a request asked for temperature={params.temperature}, "
                f"top_p={params.top_p}")
        defaults = RequestParams()
        for name in ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs",
                     "min_tokens"):
            if getattr(params, name) != getattr(defaults, name):
                raise config_lib.InputError(f"{name} is not supported by this server yet")
        if params.seed is not None and not compiled.greedy:
            raise config_lib.InputError("per-request seeds are not supported yet (the server's --seed applies)")

    def text_stream(self, stop: Sequence[str], stop_token_ids: Sequence[int], ignore_eos: bool = False):
        """The detokenizer and stop matcher of one request (EOS is a stop token unless ignored)."""
        ids = tuple(stop_token_ids) + (() if ignore_eos else self.eos_ids)
        return text_lib.TextStream(self.tokenizer, stop=stop, stop_token_ids=ids)

    def encode_text(self, text: str) -> list[int]:
        return tokenization.encode(self.tokenizer, text, chat=False)

    def encode_messages(self, messages: list[dict]) -> list[int]:
        return tokenization.encode_messages(self.tokenizer, messages)

    # -- lifecycle ------------------------------------------------------------------------------
    def compile(self) -> None:
        """Compiles every program the server runs (an error is kept in `error`); requests may queue from now on."""
        try:
            programs = self.engine.slot_programs(sampling_lib.SamplingMode.of([self.sampling]))
        except BaseException as error:
            self.error = error
            raise
        self._loop = scheduler_lib.SlotLoop(programs, jax.random.key(self.seed), self.engine.config.resolved_refill_at)
        self._handles: dict[int, Handle] = {}
        self._programs = programs

    def start(self) -> None:
        """Compiles, then starts the device thread: from then on `ready`."""
        if self._programs is None:
            self.compile()
        self._thread = threading.Thread(target=self._run, name="eagle_jax-device-loop", daemon=True)
        self._thread.start()
        self.ready = True

    def drain(self, timeout: float | None = None) -> None:
        """Stops taking requests, finishes those in flight, then stops the device thread."""
        self._draining = True
        self.ready = False
        with self._wake:
            self._wake.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def _waiting(self) -> int:
        return self._loop.num_waiting if self._programs else 0

    # -- the device thread ----------------------------------------------------------------------
    def _run(self) -> None:
        loop = self._loop
        while True:
            with self._wake:
                while not self._inbox and not self._cancelled and loop.idle and not self._draining:
                    self._wake.wait()
                arrivals, self._inbox = list(self._inbox), collections.deque()
                cancels, self._cancelled = list(self._cancelled), collections.deque()
            for handle in arrivals:
                handle.request_id = loop.add(handle.prompt_ids, handle.budget, self.sampling)
                self._handles[handle.request_id] = handle
                self.metrics.prompt_tokens.inc(handle.prompt_tokens)
            for handle in cancels:
                if handle.request_id in self._handles:
                    loop.cancel(handle.request_id)
                    self._end(handle, handle.finish_reason)
            if loop.idle:
                # Cancels may have emptied the queue with no round to follow, which would leave the
                # gauges where the last round set them (counting a request that is gone).
                self._set_gauges()
                if self._draining and not self._inbox:
                    return
                continue
            try:
                events = loop.step()
            except Exception as error:  # a device failure ends every request in flight, not the process
                self.last_device_error = error
                for handle in list(self._handles.values()):
                    self._end(handle, "error")
                loop = self._loop = scheduler_lib.SlotLoop(self._programs, jax.random.key(self.seed),
                                                           self.engine.config.resolved_refill_at)
                continue
            self._record(events)

    def _record(self, events: list[scheduler_lib.Event]) -> None:
        now = time.perf_counter()
        self._set_gauges()
        for event in events:
            if event.result is not None:  # cancelled ones too: their drafts were verified
                self.metrics.speculation(event.result.stats)
            handle = self._handles.get(event.request_id)
            if handle is None or handle.cancelled:
                continue
            if event.token_ids:
                if handle.last_token is None:
                    self.metrics.time_to_first_token.observe(now - handle.arrived)
                else:
                    per_token = (now - handle.last_token) / len(event.token_ids)
                    for _ in event.token_ids:
                        self.metrics.inter_token_latency.observe(per_token)
                handle.last_token = now
                self.metrics.generation_tokens.inc(len(event.token_ids))
                handle._send(Chunk(event.token_ids))
            if event.result is not None:
                self._end(handle, "length")

    def _set_gauges(self) -> None:
        self.metrics.running.set(self._loop.num_running)
        self.metrics.waiting.set(self._loop.num_waiting + len(self._inbox))

    def _end(self, handle: Handle, reason: str) -> None:
        if self._handles.pop(handle.request_id, None) is None:
            return
        if not handle.cancelled:
            handle.finish_reason = reason
        self.metrics.e2e_latency.observe(time.perf_counter() - handle.arrived)
        self.metrics.finished(reason)
        handle._send(None)
