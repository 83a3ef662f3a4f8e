"""Online serving: one device-loop thread owns the engine's decode slots; requests arrive at any time.

The HTTP handlers (`server`) run on an asyncio event loop; the device loop runs on its own
thread, because a device call blocks. They meet in two places:

* `submit` (event loop) appends a request to a bounded inbox; the device thread moves the inbox
  into the slot loop (`scheduler.SlotLoop`) at each device-call boundary, where free slots are
  prefilled, so a request waits at most one device call for its prefill.
* Each round's new token ids go to an output thread, which records their metrics and hands them
  to their requests' sinks, one hand-over per sink and round (`deliver`): an `AsyncioSink` puts
  them into each request's asyncio queue through one `call_soon_threadsafe` (`Handle.events()`
  reads them); the server's engine process sends them down its pipe (`engine_process`). The
  device thread goes straight on to its next round: on a GPU a run call holds its thread until
  its loop ends, with the GIL released, so a round's outputs are handed over while the next
  round runs rather than between rounds, where the device would wait for them (JetStream's
  detokenizing thread beside its generate thread).

Everything the server will run is compiled in `start`, before `/health` says ready: the slot
programs (every prefill width, the insert, the run loops) for the engine's fixed sampling mode,
each then run once on idle slots (`SlotPrograms.warm_up`), so no request ever waits on a
compilation or on a program's first execution. Each request brings its own `Sampling` (temperature,
top-p, top-k, min-p, penalties, seed, logprobs, stop token ids, ignore_eos, min_tokens), written
into its slot at its prefill: one set of programs serves any mix the mode covers, and a request
it does not cover is refused naming the field. EOS and stop token ids end a row on the device;
stop strings are found on the host (`text.TextStream`, in `server`). A request the host ends (a
stop string, a client gone) is cancelled in the slot loop, which frees its slot at the next
boundary.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import queue
import threading
import time
from typing import Sequence

import jax
import numpy as np

from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import metrics as metrics_lib
from eagle_jax.serve import request_rules as rules_lib
from eagle_jax.serve import scheduler as scheduler_lib

# The steps a run call may take while every slot is held and requests wait (`SlotLoop(full_steps)`):
# offline continuous batching's call length (`EngineConfig.steps_per_call`'s default), the figure
# the server's throughput is measured against.
FULL_STEPS = 64


class QueueFull(RuntimeError):
    """More requests are waiting than the server queues (an HTTP 429)."""


class Unavailable(RuntimeError):
    """The server is still compiling, or shutting down: it takes no new requests (an HTTP 503)."""


@dataclasses.dataclass(frozen=True)
class Chunk:
    """New token ids of one request, as one device call produced them, and (when it asked) their
    logprob entries: {"token", "logprob", "top": {token: logprob}} (`openai_api` shapes them)."""

    token_ids: list[int]
    logprobs: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class AsyncioSink:
    """Hands a round's items to their requests' asyncio queues on one event loop, with one wake-up
    (sinks of one loop are equal, so `deliver` groups them)."""

    loop: asyncio.AbstractEventLoop

    def put_all(self, items: list[tuple["Handle", Chunk | None]]) -> None:
        self.loop.call_soon_threadsafe(_put_all, [(handle.queue, item) for handle, item in items])


def _put_all(pairs: list[tuple[asyncio.Queue, Chunk | None]]) -> None:
    for queue, item in pairs:
        queue.put_nowait(item)


class Stream:
    """What an HTTP handler reads of one request: its chunks (`events`), its finish reason, its cancel."""

    def __init__(self, prompt_tokens: int):
        self.prompt_tokens = prompt_tokens
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finish_reason = "length"
        self.cancelled = False

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
            self._cancel(reason)

    def _cancel(self, reason: str) -> None:
        raise NotImplementedError


class Handle(Stream):
    """One request in flight in this process's engine: a `Stream`, and what the device thread needs.

    `sink` receives its chunks and its end (`deliver`); `tag` is what the sink knows it by. Times
    are `time.monotonic()`, one clock for every process on the machine: `arrived` may come from
    the HTTP process when the engine runs in a process of its own.
    """

    def __init__(self, owner: "OnlineEngine", prompt_ids: np.ndarray, budget: int, sink,
                 sampling: sampling_lib.Sampling = sampling_lib.Sampling(), sample: int = 0, tag=None,
                 arrived: float | None = None):
        super().__init__(len(prompt_ids))
        self.owner, self.prompt_ids, self.budget, self.sink, self.tag = owner, prompt_ids, budget, sink, tag
        self.sampling, self.sample = sampling, sample  # its settings; which of its request's n samples it is
        self.arrived = time.monotonic() if arrived is None else arrived
        self.last_token: float | None = None
        self.request_id: int | None = None  # the slot loop's, once the device thread has taken it
        self.ended = False  # its end handed over (output thread)

    def _cancel(self, reason: str) -> None:
        self.owner.cancel(self)


def deliver(items: list[tuple[Handle, Chunk | None]]) -> None:
    """Hands each (handle, chunk, or None for its end) to its handle's sink, in order: one hand-over
    to each sink for them all (from the output thread, once a round), not one a chunk, which with
    64 streams a round would be 64 thread-safe calls competing with the handlers."""
    by_sink: dict = collections.defaultdict(list)
    for handle, item in items:
        by_sink[handle.sink].append((handle, item))
    for sink, pairs in by_sink.items():
        sink.put_all(pairs)


class OnlineEngine:
    """The engine's slots, driven by one thread, fed by `submit` from any asyncio handler.

    Args:
        engine: an `Engine` whose config has `scheduler="continuous"`; its `sampling_mode` is what
            requests may ask for (None: what `defaults` needs alone).
        tokenizer: the target's tokenizer (prompts, chat template, EOS, detokenization).
        defaults: the temperature and top-p of a request that sends none (`--temperature`, `--top-p`).
        max_queue: requests waiting for a slot before `submit` raises `QueueFull`.
        seed: the key of the requests without a seed of their own.
    """

    def __init__(self, engine, tokenizer, model_name: str, defaults: sampling_lib.Sampling = sampling_lib.Sampling(),
                 max_queue: int = 1024, seed: int = 0):
        self.engine, self.tokenizer = engine, tokenizer
        self.mode = engine.config.mode_for([defaults])
        self.max_queue, self.seed = max_queue, seed
        self.eos_ids = tuple(engine.model_config.eos_token_ids)
        self.metrics = metrics_lib.Metrics(model_name, engine.config.k)
        self.max_model_len = engine.max_length
        self.rules = rules_lib.RequestRules(tokenizer, rules_lib.Limits(
            defaults, self.mode, engine.model_config.vocab_size, self.eos_ids, self.max_model_len))
        self.ready = False
        self._inbox: collections.deque[Handle] = collections.deque()
        self._cancelled: collections.deque[Handle] = collections.deque()
        self._wake = threading.Condition()
        self._draining = False
        self._thread: threading.Thread | None = None
        # What the output thread runs, in order: recording and handing over a round's events,
        # ending requests; None once the device thread has stopped.
        self._outputs: queue.SimpleQueue = queue.SimpleQueue()
        self._output_thread: threading.Thread | None = None
        self._programs = None
        self.error: BaseException | None = None  # why compiling at start failed
        self.warm_up_seconds = 0.0  # the start-up's running of each program once, after compiling
        self.start_seconds = 0.0  # `start`'s whole time: compiling (or loading) and warming up
        self.last_device_error: Exception | None = None

    # -- called from the event loop -------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], max_tokens: int | None, sampling: sampling_lib.Sampling,
               sample: int = 0, sink=None, tag=None, arrived: float | None = None) -> Handle:
        """Queues one request (sample `sample` of its n); `max_tokens` None takes what the context leaves.

        Its chunks go to `sink` (default: the calling event loop's `AsyncioSink`), which knows it by
        `tag`; `arrived` (`time.monotonic()`, default now) is where its latencies count from.
        """
        if self._draining:
            raise Unavailable("the server is shutting down")
        if self._programs is None:
            raise Unavailable("the server is still compiling; GET /health says when it is ready")
        self.rules.check_sampling(sampling)
        prompt = self.engine.check_prompts([prompt_ids], [1])[0]  # token ids in the vocabulary, shape
        room = self._programs.widths[-1] if self._programs else self.max_model_len // 2
        if len(prompt) > room:
            raise config_lib.InputError(f"the prompt has {len(prompt)} tokens; this server takes up to {room}")
        budget = max_tokens or self.max_model_len - len(prompt) - self.engine.headroom
        self.engine.check_prompts([prompt], [budget])
        sink = sink or AsyncioSink(asyncio.get_running_loop())
        handle = Handle(self, prompt, budget, sink, sampling, sample, tag, arrived)
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

    # What the HTTP handlers await: `engine_process.EngineProcess` answers the same, from its process.
    async def enqueue(self, prompt_ids: Sequence[int], max_tokens: int | None, sampling: sampling_lib.Sampling,
                      sample: int = 0) -> Handle:
        """`submit`, from the calling event loop."""
        return self.submit(prompt_ids, max_tokens, sampling, sample)

    async def metrics_text(self) -> tuple[bytes, str]:
        """The Prometheus exposition and its content type."""
        return self.metrics.exposition()

    async def profile(self, action: str, directory: str) -> None:
        """Starts ("start") or stops and writes ("stop") a `jax.profiler` trace of this process.

        Raises:
            RuntimeError: a trace already running, or none to stop.
        """
        if action == "start":
            await asyncio.to_thread(jax.profiler.start_trace, directory)
        else:  # writing a trace takes seconds: off the event loop
            await asyncio.to_thread(jax.profiler.stop_trace)

    # -- lifecycle ------------------------------------------------------------------------------
    def compile(self) -> None:
        """Compiles every program the server runs, and runs each once (an error is kept in
        `error`); requests may queue from now on."""
        try:
            programs = self.engine.slot_programs(self.mode)
            began = time.perf_counter()
            programs.warm_up(jax.random.key(self.seed))
            self.warm_up_seconds = time.perf_counter() - began
        except BaseException as error:
            self.error = error
            raise
        self._loop = self._new_loop(programs)
        self._handles: dict[int, Handle] = {}
        self._programs = programs

    def _new_loop(self, programs) -> scheduler_lib.SlotLoop:
        # EOS ends rows on the device (where min_tokens masks it), unless a request ignores it. A
        # new request's first token streams as soon as its prefill ends, not after the run call.
        # While every slot is held and requests wait, a call runs as long as offline's.
        return scheduler_lib.SlotLoop(programs, jax.random.key(self.seed), self.engine.config.resolved_refill_at,
                                      eos_ids=self.eos_ids, on_first_tokens=self._hand_over,
                                      full_steps=max(FULL_STEPS, programs.steps_per_call))

    def start(self) -> None:
        """Compiles, then starts the device thread: from then on `ready`."""
        began = time.perf_counter()
        if self._programs is None:
            self.compile()
        self.start_seconds = time.perf_counter() - began
        self._output_thread = threading.Thread(target=self._emit, name="eagle_jax-outputs", daemon=True)
        self._output_thread.start()
        self._thread = threading.Thread(target=self._run, name="eagle_jax-device-loop", daemon=True)
        self._thread.start()
        self.ready = True

    @property
    def ready_line(self) -> str:
        """The start-up's account, once `start` has returned: its compiling, cache and warm-up."""
        cache = self.engine.compile_cache
        return (f"eagle_jax: ready after {self.start_seconds:.1f} s: {cache.misses} programs compiled, "
                f"{cache.hits} loaded from the compilation cache in {self.compile_seconds:.1f} s "
                f"({self.engine.compiler.lowering_seconds:.1f} s of it lowering them on one thread), each run "
                f"once in {self.warm_up_seconds:.1f} s")

    def drain(self, timeout: float | None = None) -> None:
        """Stops taking requests, finishes those in flight, then stops the device thread."""
        self._draining = True
        self.ready = False
        with self._wake:
            self._wake.notify()
        began = time.monotonic()
        for thread in (self._thread, self._output_thread):  # the outputs end after the device loop
            if thread is not None:
                thread.join(None if timeout is None else max(0.0, timeout - (time.monotonic() - began)))

    @property
    def compile_seconds(self) -> float:
        """The start-up's compiling (or loading from the cache) of every program."""
        return self._programs.compile_seconds if self._programs is not None else 0.0

    @property
    def _waiting(self) -> int:
        return self._loop.num_waiting if self._programs else 0

    # -- the device thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._device_loop()
        finally:
            self._outputs.put(None)  # the output thread ends once it has handed over everything before

    def _device_loop(self) -> None:
        loop = self._loop
        while True:
            with self._wake:
                while not self._inbox and not self._cancelled and loop.idle and not self._draining:
                    self._wake.wait()
                arrivals, self._inbox = list(self._inbox), collections.deque()
                cancels, self._cancelled = list(self._cancelled), collections.deque()
            for handle in arrivals:
                handle.request_id = loop.add(handle.prompt_ids, handle.budget, handle.sampling, handle.sample)
                self._handles[handle.request_id] = handle
                self.metrics.prompt_tokens.inc(handle.prompt_tokens)
            gone = [handle for handle in cancels if self._handles.get(handle.request_id) is handle]
            for handle in gone:
                loop.cancel(handle.request_id)
                del self._handles[handle.request_id]
            if gone:
                self._outputs.put(functools.partial(self._end_all, gone))
            if loop.idle:
                # Cancels may have emptied the queue with no round to follow, which would leave the
                # gauges where the last round set them (counting a request that is gone).
                self._set_gauges()
                if self._draining and not self._inbox:
                    return
                continue
            before, began = dataclasses.replace(loop.calls), time.perf_counter()
            try:
                events = loop.step()
            except Exception as error:  # a device failure ends every request in flight, not the process
                self.last_device_error = error
                # Out of the table now: the new loop numbers its requests from 0 again.
                failed, self._handles = list(self._handles.values()), {}
                self._outputs.put(functools.partial(self._end_all, failed, "error"))
                loop = self._loop = self._new_loop(self._programs)
                continue
            self.metrics.device_round(before, loop.calls, time.perf_counter() - began)
            self._set_gauges()
            self._hand_over(events)

    def _hand_over(self, events: list[scheduler_lib.Event]) -> None:
        """Passes a round's events to the output thread, each with its request's handle (None: gone),
        looked up here: the table of requests in flight is the device thread's alone."""
        pairs = []
        for event in events:
            pairs.append((self._handles.get(event.request_id), event))
            if event.result is not None:
                self._handles.pop(event.request_id, None)
        self._outputs.put(functools.partial(self._record, pairs))

    # -- the output thread ----------------------------------------------------------------------
    def _emit(self) -> None:
        """Runs what the device thread passed over, in order, until it has stopped."""
        while (task := self._outputs.get()) is not None:
            try:
                task()
            except Exception:  # a fault in one round's hand-over must not strand every later request
                logging.getLogger(__name__).exception("handing over a round's outputs failed")

    def _end_all(self, handles: list[Handle], reason: str | None = None) -> None:
        """Ends each request (with `reason`, else its own finish reason: a cancel's)."""
        ended = []
        for handle in handles:
            self._end(handle, reason or handle.finish_reason, ended)
        deliver(ended)

    def _record(self, pairs: list[tuple[Handle | None, scheduler_lib.Event]]) -> None:
        """A round's metrics, and its chunks and ends handed to their handlers (output thread)."""
        now = time.monotonic()
        outbox = []
        for handle, event in pairs:
            if event.result is not None:  # cancelled ones too: their drafts were verified
                self.metrics.speculation(event.result.stats)
            if handle is None:
                continue
            if handle.cancelled:  # its chunks go nowhere; it ends here if it finished before its cancel came
                if event.result is not None:
                    self._end(handle, handle.finish_reason, outbox)
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
                outbox.append((handle, Chunk(event.token_ids, [self._logprob_entry(entry) for entry in event.logprobs])))
            if event.result is not None:
                self._end(handle, event.result.finish_reason, outbox)
        deliver(outbox)

    def _logprob_entry(self, entry: dict) -> dict:
        """A row's entry (`outputs.RowOutput`, token ids) with the token strings the APIs show."""
        token = lambda token_id: self.tokenizer.decode([token_id])
        return {"token": token(entry["token_id"]), "logprob": entry["logprob"],
                "top": {token(item["token_id"]): item["logprob"] for item in entry["top_logprobs"]}}

    def _set_gauges(self) -> None:
        self.metrics.running.set(self._loop.num_running)
        self.metrics.waiting.set(self._loop.num_waiting + len(self._inbox))

    def _end(self, handle: Handle, reason: str, outbox: list) -> None:
        """Ends a request once: its reason, its metrics, and its last item (None) into `outbox` (`deliver`)."""
        if handle.ended:
            return
        handle.ended = True
        if not handle.cancelled:
            handle.finish_reason = reason
        self.metrics.e2e_latency.observe(time.monotonic() - handle.arrived)
        self.metrics.finished(reason)
        outbox.append((handle, None))
