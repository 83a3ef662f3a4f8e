"""The server's engine in a process of its own, as vLLM's engine core runs beside its API server.

In one process the device thread shares the interpreter with the HTTP handlers: every device
call releases it, and getting it back waits behind the handlers' JSON and detokenizing, up to a
switch interval a time, several times a round. Under load that was most of a round's host time
(docs/serving.md). Here the HTTP process keeps the handlers, the tokenizer and the text streams;
the engine process runs `online.OnlineEngine` (device thread, output thread, metrics) and meets
the HTTP process through one pipe:

* HTTP -> engine: ("submit", call, request, prompt ids, max_tokens, Sampling, sample, arrived),
  ("cancel", request, reason), ("metrics", call), ("profile", call, action, directory), ("drain",).
* engine -> HTTP: ("limits", Limits, tokenizer directory), ("ready", line), ("failed", text),
  ("reply", call, error kind or None, value), ("outputs", [(request, Chunk or (None, finish
  reason)), ...]) once a round, ("drained",).

A submit is a round trip, so that a bad request still gets its 400, 429 or 503 before its
response starts; its chunks then come with the round's one message. The engine process ignores
SIGINT and SIGTERM: the HTTP process drains it once uvicorn has finished the requests in
flight, and it drains itself if the pipe closes (the HTTP process gone).
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import signal
import sys
import threading
import time
import traceback
from typing import Sequence

from eagle_jax.cli import errors as script_errors
from eagle_jax.decode import sampling as sampling_lib
from eagle_jax.serve import config as config_lib
from eagle_jax.serve import online as online_lib
from eagle_jax.serve import request_rules as rules_lib

# A reply's error kind -> the exception the HTTP process raises (what its handlers turn into a
# status); the first that matches names it, "internal" (a 500) anything else.
ERRORS = {"queue_full": online_lib.QueueFull, "unavailable": online_lib.Unavailable,
          "input": config_lib.InputError, "value": ValueError, "runtime": RuntimeError, "internal": RuntimeError}


def _error_kind(error: Exception) -> str:
    return next((kind for kind, cls in ERRORS.items() if isinstance(error, cls)), "internal")


class EngineGone(online_lib.Unavailable):
    """The engine process exited (its log says why): a 503; requests in flight end with "error"."""


# ---- the engine process ----------------------------------------------------------------------

class _PipeSink:
    """Sends a round's chunks and ends down the pipe in one message (engine process, output thread)."""

    def __init__(self, send, handles: dict):
        self.send, self.handles = send, handles

    def put_all(self, items: list[tuple[online_lib.Handle, online_lib.Chunk | None]]) -> None:
        out = []
        for handle, item in items:
            if item is None:
                self.handles.pop(handle.tag, None)
                item = (None, handle.finish_reason)
            out.append((handle.tag, item))
        self.send(("outputs", out))


def serve_engine(build, args, conn) -> None:
    """The engine process's main: `build(args)` -> (OnlineEngine, tokenizer directory), then the
    pipe's messages until drained. Compiling runs on a thread, so that /metrics answers meanwhile."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the whole group:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the HTTP process decides when this one ends
    sys.setswitchinterval(args.gil_switch_interval)
    lock = threading.Lock()

    def send(message) -> None:
        with lock:
            try:
                conn.send(message)
            except OSError:  # the HTTP process is gone: the next read drains this one
                pass

    try:
        backend, tokenizer_dir = build(args)
    except script_errors.USER_ERRORS as error:  # bad flags or files: the HTTP process prints this and exits
        send(("failed", f"error: {error}"))
        return
    except BaseException:  # a bug: its traceback
        send(("failed", traceback.format_exc()))
        return
    send(("limits", backend.rules.limits, tokenizer_dir))

    def start() -> None:
        try:
            backend.start()
        except BaseException:
            send(("failed", traceback.format_exc()))
            return
        send(("ready", backend.ready_line))

    threading.Thread(target=start, name="eagle_jax-compile", daemon=True).start()
    handles: dict[int, online_lib.Handle] = {}
    sink = _PipeSink(send, handles)
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the HTTP process is gone: finish what is in flight, then exit
            message = ("drain",)
        kind = message[0]
        if kind == "submit":
            _, call, request, prompt, max_tokens, sampling, sample, arrived = message
            try:
                handle = handles[request] = backend.submit(prompt, max_tokens, sampling, sample, sink, request, arrived)
                if handle.ended:  # ended (and handed over) before it was listed: the sink found nothing to drop
                    handles.pop(request, None)
                send(("reply", call, None, None))
            except Exception as error:
                send(("reply", call, _error_kind(error), str(error)))
        elif kind == "cancel":
            handle = handles.get(message[1])
            if handle is not None:
                handle.cancel(message[2])
        elif kind == "metrics":
            send(("reply", message[1], None, backend.metrics.exposition()))
        elif kind == "profile":
            _, call, action, directory = message
            try:
                asyncio.run(backend.profile(action, directory))
                send(("reply", call, None, None))
            except RuntimeError as error:
                send(("reply", call, "runtime", str(error)))
        elif kind == "drain":
            backend.drain()
            send(("drained",))
            return


# ---- the HTTP process ------------------------------------------------------------------------

class RemoteHandle(online_lib.Stream):
    """One request in flight in the engine process, as the HTTP handlers read it."""

    def __init__(self, owner: "EngineProcess", request: int, prompt_tokens: int):
        super().__init__(prompt_tokens)
        self.owner, self.request = owner, request

    def _cancel(self, reason: str) -> None:  # its slot is freed at the engine's next device-call boundary
        self.owner._send(("cancel", self.request, reason))


class EngineProcess:
    """Starts the engine process (`build(args)` runs there) and answers the HTTP handlers as
    `online.OnlineEngine` does: `rules`, `ready`, `error`, `start`, `enqueue`, `metrics_text`,
    `profile`, `drain`.

    Raises:
        SystemExit: the engine process could not build the engine: its `error:` line (bad flags
            or files, status 2) or traceback is printed first.
    """

    def __init__(self, build, args):
        context = multiprocessing.get_context("spawn")  # no fork of a process that may hold a GPU
        self._conn, child = context.Pipe()
        self.process = context.Process(target=serve_engine, args=(build, args, child), name="eagle_jax-engine",
                                       daemon=True)
        self.process.start()
        child.close()
        message = self._recv()
        if message is None or message[0] == "failed":  # a user's error is one `error:` line (status 2)
            text = message[1] if message else "the engine process exited before it loaded the model"
            print(text, file=sys.stderr, flush=True)
            self.process.join()
            raise SystemExit(2 if text.startswith("error:") else 1)
        _, limits, tokenizer_dir = message
        from eagle_jax.io import tokenization

        self.rules = rules_lib.RequestRules(tokenization.load(tokenizer_dir), limits)
        self.ready = False
        self.error: BaseException | None = None
        self.ready_line = ""
        self._send_lock = threading.Lock()
        self._calls = itertools.count()
        self._requests = itertools.count()
        self._replies: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._closed = False  # the reader has ended: nothing more will come from the engine process
        self._table_lock = threading.Lock()  # the reader's end against a new call or request
        self._handles: dict[int, tuple[asyncio.AbstractEventLoop, RemoteHandle]] = {}
        self._started = threading.Event()
        self._drained = threading.Event()
        self._reader = threading.Thread(target=self._read, name="eagle_jax-engine-pipe", daemon=True)
        self._reader.start()

    def _recv(self):
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            return None

    def _send(self, message) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (BrokenPipeError, OSError):  # the engine process is gone: the reader ends what waits
                pass

    # -- lifecycle (threads) ----------------------------------------------------------------------
    def start(self) -> None:
        """Waits until the engine process has compiled every program (`ready`) or failed (`error`, raised)."""
        self._started.wait()
        if self.error is not None:
            raise self.error

    def drain(self, timeout: float | None = None) -> None:
        """The engine process finishes what is in flight, then exits."""
        self.ready = False
        self._send(("drain",))
        self._drained.wait(timeout)
        self.process.join(timeout)

    # -- what the handlers await ------------------------------------------------------------------
    async def _call(self, message: tuple):
        loop = asyncio.get_running_loop()
        call = next(self._calls)
        future = loop.create_future()
        with self._table_lock:
            if self._closed:
                raise EngineGone("the engine process has exited")
            self._replies[call] = (loop, future)
        self._send((message[0], call, *message[1:]))
        return await future

    async def enqueue(self, prompt_ids: Sequence[int], max_tokens: int | None, sampling: sampling_lib.Sampling,
                      sample: int = 0) -> RemoteHandle:
        """Queues one request in the engine process; its errors are raised here, as `OnlineEngine.submit`'s."""
        request = next(self._requests)
        handle = RemoteHandle(self, request, len(prompt_ids))
        with self._table_lock:
            self._handles[request] = (asyncio.get_running_loop(), handle)
        try:
            await self._call(("submit", request, list(prompt_ids), max_tokens, sampling, sample, time.monotonic()))
        except BaseException:
            self._handles.pop(request, None)
            raise
        return handle

    async def metrics_text(self) -> tuple[bytes, str]:
        return await self._call(("metrics",))

    async def profile(self, action: str, directory: str) -> None:
        """A `jax.profiler` trace of the engine process, where the device loop runs."""
        await self._call(("profile", action, directory))

    # -- the reader thread ------------------------------------------------------------------------
    def _read(self) -> None:
        while (message := self._recv()) is not None:
            kind = message[0]
            if kind == "outputs":
                self._deliver(message[1])
            elif kind == "reply":
                _, call, error, value = message
                loop, future = self._replies.pop(call)
                result = ERRORS[error](value) if error else value
                loop.call_soon_threadsafe(_settle, future, result, error is not None)
            elif kind == "ready":
                self.ready_line, self.ready = message[1], True
                self._started.set()
            elif kind == "failed":
                self.error = RuntimeError(f"the engine process failed:\n{message[1]}")
                self._started.set()
            elif kind == "drained":
                break
        else:  # the pipe closed with no "drained": the process died (killed, out of memory)
            if self.error is None:
                self.error = EngineGone(f"the engine process (pid {self.process.pid}) exited")
        self.ready = False
        self._drained.set()
        self._started.set()
        self._end_all()

    def _deliver(self, items: list) -> None:
        """A round's chunks and ends, one wake-up of each event loop (`online.deliver`'s rule)."""
        by_loop: dict = {}
        for request, item in items:
            entry = self._handles.get(request)
            if entry is None:
                continue
            loop, handle = entry
            if isinstance(item, tuple):  # (None, finish reason): its end
                self._handles.pop(request, None)
                if not handle.cancelled:
                    handle.finish_reason = item[1]
                item = None
            by_loop.setdefault(loop, []).append((handle, item))
        for loop, pairs in by_loop.items():
            online_lib.AsyncioSink(loop).put_all(pairs)

    def _end_all(self) -> None:
        """The engine process is gone: whatever waits on it ends ("error" for requests in flight)."""
        with self._table_lock:
            self._closed = True
            replies, self._replies = self._replies, {}
            ended = [(request, (None, "error")) for request in list(self._handles)]
        gone = EngineGone("the engine process has exited")
        for loop, future in replies.values():
            loop.call_soon_threadsafe(_settle, future, gone, True)
        self._deliver(ended)


def _settle(future: asyncio.Future, value, failed: bool) -> None:
    if future.done():
        return
    if failed:
        future.set_exception(value)
    else:
        future.set_result(value)
