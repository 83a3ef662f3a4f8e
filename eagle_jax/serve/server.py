"""The OpenAI-compatible HTTP server: FastAPI routes over one engine, an `online.OnlineEngine` in
this process or an `engine_process.EngineProcess` beside it (what `python -m eagle_jax.serve` runs).

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both streamed as server-sent events
ending `data: [DONE]` when asked), `GET /v1/models`, `GET /health` (503 until the engine has
compiled every program it will run), `GET /metrics` (Prometheus text), and with a profile
directory `POST /start_profile` and `/stop_profile`. Errors carry OpenAI's
error body: 400 for bad JSON, bad parameters, an unknown model or a prompt too long, 429 when
the queue is full, 503 while starting or draining.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
import time

import fastapi
from fastapi import responses

from eagle_jax.serve import online as online_lib
from eagle_jax.serve import openai_api


class RequestError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def create_app(backend, model_name: str, profile_dir: str | None = None) -> fastapi.FastAPI:
    """The app serving `backend` (an `OnlineEngine` or an `EngineProcess`: what the routes use of
    either is `rules`, `ready`, `error`, `ready_line`, `start`, `drain`, `enqueue`, `metrics_text`
    and `profile`) under the model id `model_name`.

    `profile_dir`: adds POST /start_profile and /stop_profile (as vLLM and SGLang name them), which
    record a `jax.profiler` trace of everything the engine's process runs in between (the device
    loop's calls and kernels; TensorBoard's profile plugin or Perfetto reads it) into that directory.
    """
    def start():
        backend.start()
        print(backend.ready_line, file=sys.stderr, flush=True)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        # Compile while already listening, so /health can say "starting" rather than refuse connections.
        threading.Thread(target=start, name="eagle_jax-compile", daemon=True).start()
        yield
        await asyncio.to_thread(backend.drain)  # after the server stopped taking requests and finished them

    app = fastapi.FastAPI(title="eagle_jax", docs_url=None, redoc_url=None, lifespan=lifespan)
    created = int(time.time())

    @app.exception_handler(RequestError)
    async def request_error(_, error: RequestError):
        return responses.JSONResponse(openai_api.error_body(error.message, error.kind, error.param), error.status)

    @app.exception_handler(fastapi.exceptions.RequestValidationError)
    async def validation_error(_, error):
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return responses.JSONResponse(openai_api.error_body(message, param=where or None), 400)

    @app.get("/health")
    async def health():
        if backend.error is not None:
            return responses.JSONResponse(openai_api.error_body(f"failed: {backend.error!r}", "server_error"), 500)
        if not backend.ready:
            return responses.JSONResponse(openai_api.error_body("starting: compiling", "unavailable"), 503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        body, content_type = await backend.metrics_text()
        return responses.Response(body, media_type=content_type)

    if profile_dir is not None:
        @app.post("/start_profile")
        async def start_profile():
            try:
                await backend.profile("start", profile_dir)
            except RuntimeError as error:  # one trace at a time
                raise RequestError(400, f"could not start a profile: {error}") from None
            return {"status": "profiling", "dir": profile_dir}

        @app.post("/stop_profile")
        async def stop_profile():  # writes the trace: seconds for a long one
            try:
                await backend.profile("stop", profile_dir)
            except RuntimeError as error:
                raise RequestError(400, f"could not stop a profile: {error}") from None
            return {"status": "written", "dir": profile_dir}

    @app.get("/v1/models")
    async def models():
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "eagle_jax",
                "max_model_len": backend.rules.limits.max_model_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: openai_api.CompletionRequest, request: fastapi.Request):
        check_request(body, model_name, backend)
        prompts = [backend.rules.encode_text(p) if isinstance(p, str) else p for p in body.prompts()]
        return await respond(request, body, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: openai_api.ChatCompletionRequest, request: fastapi.Request):
        check_request(body, model_name, backend)
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            prompt = backend.rules.encode_messages(messages)
        except ValueError as error:
            raise RequestError(400, str(error), param="messages") from None
        return await respond(request, body, [prompt], chat=True)

    async def respond(request, body, prompts, chat: bool):
        request_id = openai_api.new_id("chatcmpl" if chat else "cmpl")
        max_tokens = body.max_new_tokens if chat else body.max_tokens
        sampling = request_sampling(body, chat, backend)
        handles = []
        try:
            for prompt in prompts:
                for sample in range(body.n):  # n rows, each with its own key (seeded: Sampling.sample_seed)
                    handles.append(await backend.enqueue(prompt, max_tokens, sampling, sample=sample))
        except online_lib.QueueFull as error:
            for handle in handles:
                handle.cancel()
            raise RequestError(429, str(error), "rate_limit_exceeded") from None
        except online_lib.Unavailable as error:
            raise RequestError(503, str(error), "unavailable") from None
        except ValueError as error:  # too long a prompt, a bad token id
            raise RequestError(400, str(error), param="prompt" if not chat else "messages") from None
        if body.stream:
            return responses.StreamingResponse(stream(request, request_id, body, handles, chat),
                                               media_type="text/event-stream")
        try:
            outputs = await asyncio.gather(*(collect(handle, body) for handle in handles))
        except asyncio.CancelledError:
            for handle in handles:
                handle.cancel()
            raise
        choices = [choice(index, text, reason, chat, logprobs) for index, (text, reason, logprobs, _) in
                   enumerate(outputs)]
        usage = openai_api.usage(sum(len(p) for p in prompts) * body.n, sum(o[3] for o in outputs))
        build = openai_api.chat_response if chat else openai_api.completion_response
        return build(request_id, model_name, choices, usage)

    async def collect(handle, body):
        stream_ = backend.rules.text_stream(body.stop, body.stop_token_ids, body.ignore_eos)
        pieces, logprobs, offset = [], [], 0
        async for event in handle.events():
            pieces.append(stream_.push(event.token_ids))
            offset = openai_api.add_offsets(event.logprobs, offset)
            logprobs += event.logprobs
            if stream_.stopped:
                handle.cancel("stop")
                break
        pieces.append(stream_.finish())
        reason = "stop" if stream_.stopped else handle.finish_reason
        # The tokens of the text only: not a stop token, nor those after a stop string.
        return "".join(pieces), reason, logprobs[:len(stream_.ids)], len(stream_.ids)

    async def stream(request, request_id, body, handles, chat):
        queue: asyncio.Queue = asyncio.Queue()
        streams = [backend.rules.text_stream(body.stop, body.stop_token_ids, body.ignore_eos) for _ in handles]
        offsets = [0] * len(handles)

        async def pump(index, handle):
            async for event in handle.events():
                await queue.put((index, event))
            await queue.put((index, None))

        tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
        build = openai_api.chat_response if chat else openai_api.completion_response
        open_streams = set(range(len(handles)))
        completion_tokens = 0
        try:
            if chat:  # the role first, as OpenAI's stream does
                for index in range(len(handles)):
                    yield sse(build(request_id, model_name, [{"index": index, "delta": {"role": "assistant"},
                                                               "finish_reason": None}], None, chunk=True))
            while open_streams:
                index, event = await queue.get()
                if index not in open_streams:
                    continue
                text_stream, handle = streams[index], handles[index]
                if event is None or text_stream.stopped:
                    piece = text_stream.finish()
                    reason = "stop" if text_stream.stopped else handle.finish_reason
                    open_streams.discard(index)
                    completion_tokens += len(text_stream.ids)
                    yield sse(build(request_id, model_name, [delta(index, piece, reason, chat, [])], None, chunk=True))
                    continue
                piece = text_stream.push(event.token_ids)
                offsets[index] = openai_api.add_offsets(event.logprobs, offsets[index])
                if text_stream.stopped:
                    handle.cancel("stop")
                    await queue.put((index, None))
                if piece or event.logprobs:
                    yield sse(build(request_id, model_name, [delta(index, piece, None, chat, event.logprobs)], None,
                                    chunk=True))
            if body.include_usage_in_stream:
                prompt_tokens = sum(h.prompt_tokens for h in handles)
                yield sse(build(request_id, model_name, [], openai_api.usage(prompt_tokens, completion_tokens),
                                chunk=True))
            yield "data: [DONE]\n\n"
        finally:  # a client that went away: free its slots at the next device-call boundary
            for handle in handles:
                handle.cancel()
            for task in tasks:
                task.cancel()

    def choice(index, text, reason, chat, logprobs):
        if chat:
            return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": reason,
                    "logprobs": openai_api.chat_logprobs(logprobs) if logprobs else None}
        return {"index": index, "text": text, "finish_reason": reason,
                "logprobs": openai_api.completion_logprobs(logprobs) if logprobs else None}

    def delta(index, text, reason, chat, logprobs):
        if chat:
            return {"index": index, "delta": {"content": text} if text else {}, "finish_reason": reason,
                    "logprobs": openai_api.chat_logprobs(logprobs) if logprobs else None}
        return {"index": index, "text": text, "finish_reason": reason,
                "logprobs": openai_api.completion_logprobs(logprobs) if logprobs else None}

    return app


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def check_request(body: openai_api.SamplingFields, model_name: str, backend) -> None:
    try:
        body.reject_unknown()
    except openai_api.Unsupported as error:
        raise RequestError(400, str(error)) from None
    if getattr(body, "echo", False):
        raise RequestError(400, "echo is not supported", param="echo")
    if body.model != model_name:
        raise RequestError(400, f"model {body.model!r} is not served here; this server serves {model_name!r}",
                           "invalid_request_error", "model")


def request_sampling(body, chat: bool, backend):
    """One request's `Sampling` (its stop strings stay with the host's text stream; n with `respond`).

    Raises:
        RequestError: 400 for a value out of range, or settings the server's programs do not serve.
    """
    logprobs = (body.top_logprobs or 0) if chat and body.logprobs else (None if chat else body.logprobs)
    vocab = backend.rules.limits.vocab_size
    try:
        sampling = backend.rules.sampling(
            temperature=body.temperature, top_p=body.top_p, top_k=min(body.top_k, vocab),  # above V: every token
            min_p=body.min_p, repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, seed=body.seed, logprobs=logprobs,
            stop_token_ids=tuple(body.stop_token_ids), ignore_eos=body.ignore_eos, min_tokens=body.min_tokens)
        backend.rules.check_sampling(sampling)
    except ValueError as error:
        raise RequestError(400, str(error)) from None
    return sampling
