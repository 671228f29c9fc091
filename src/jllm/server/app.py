"""The OpenAI-compatible HTTP API over one engine: `create_app(engine, model_name, api_key)` -> a FastAPI app.

    POST /v1/chat/completions   messages -> a chat completion (or SSE chunks with stream=true)
    POST /v1/completions        prompt -> a text completion (or SSE chunks)
    GET  /v1/models             the one served model
    GET  /health                liveness and queue depth (never needs the API key)
    GET  /metrics               Prometheus text format

Requests are answered one at a time by the worker thread (worker.py), in arrival order; a handler waits for
its job's events on an asyncio queue, and a client that disconnects cancels its job (checked between
tokens). Every request renders its own messages: conversations share nothing but the engine's prefix reuse,
which is exact. `prompt_cache_key` names the conversation's entry in the persistent KV cache; a request may
send it as the header `X-Prompt-Cache-Key` instead (a proxy can route on a header, not on a JSON body's field),
and the body's field wins when both are there.

Responses follow OpenAI's shapes, with `usage.prompt_tokens_details.cached_tokens` (prompt tokens reused
from a KV cache) and two extra fields: `timings` (queue, prompt and decode times and speeds) and, when
speculative decoding ran, `spec` (drafted, accepted, acceptance rate ...). Errors are
`{"error": {"message", "type", "param", "code"}}` with a 4xx status, or 500 for a bug (logged as one line).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import time
from contextlib import asynccontextmanager
from typing import Iterable

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from jllm.cache.store import check_conversation_id
from jllm.errors import JllmError
from jllm.server.metrics import Metrics
from jllm.server.schemas import ChatRequest, CompletionRequest
from jllm.server.worker import ContextTooLong, Job, Worker

log = logging.getLogger("jllm.server")

CACHE_KEY_HEADER = "x-prompt-cache-key"   # prompt_cache_key as a header, for proxies that route by it
POLL_S = 0.25               # how often a waiting handler checks that its client is still there


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


def _from_engine(e: Exception, prompt_field: str) -> APIError:
    if isinstance(e, ContextTooLong):
        return APIError(400, str(e), param=prompt_field, code="context_length_exceeded")
    if isinstance(e, JllmError):
        return APIError(400, str(e))
    return APIError(500, f"internal error ({type(e).__name__}); see the server's log", "server_error")


class _ClientGone(Exception):
    pass


class _Guard:
    """Outermost ASGI layer: counts responses per path and status; turns an unexpected exception into a 500
    error JSON (never a traceback to the client) and one line in the server's log."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.response(scope["path"], message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except ClientDisconnect:
            pass
        except Exception as e:
            log.error("jllm serve: %s %s failed: %s: %s", scope["method"], scope["path"], type(e).__name__, e)
            if not started:
                await _from_engine(e, "").response()(scope, receive, counting_send)


class _Pending:
    """A submitted job as its handler sees it: events from the worker thread arrive on an asyncio queue."""

    def __init__(self, request: Request):
        self.request = request
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.job: Job | None = None
        self._checked = time.monotonic()

    def emit(self, event: tuple) -> None:           # on the worker thread
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:                        # the event loop is gone (shutdown): stop generating
            self.cancel()

    def cancel(self) -> None:
        if self.job is not None:
            self.job.cancelled.set()

    async def next(self) -> tuple:
        """The next event; raises _ClientGone (after cancelling the job) if the client disconnected."""
        while True:
            if time.monotonic() - self._checked >= POLL_S:
                self._checked = time.monotonic()
                if await self.request.is_disconnected():
                    self.cancel()
                    raise _ClientGone
            try:
                return await asyncio.wait_for(self.events.get(), POLL_S)
            except asyncio.TimeoutError:
                continue


class _Reply:
    """Shapes one request's output: a chat completion (chat=True) or a text completion."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str | None = None, finish: str | None = None, role: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {**self._head("chat.completion.chunk"), "choices": [choice]}
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, outcome) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage(outcome)}

    def full(self, text: str, outcome) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": outcome.finish_reason}
            body = {**self._head("chat.completion"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": outcome.finish_reason}
            body = {**self._head("text_completion"), "choices": [choice]}
        return {**body, **extras(outcome), "usage": usage(outcome)}


def usage(outcome) -> dict:
    return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens,
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": outcome.timings["cached_tokens"]}}


def extras(outcome) -> dict:
    out = {"timings": {k: round(v, 2) for k, v in outcome.timings.items() if k != "load_ms"}}
    if outcome.spec is not None:
        out["spec"] = outcome.spec
    return out


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _parse(request: Request, model: type[BaseModel]):
    try:
        data = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise APIError(400, "the request body is not valid JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        # a union's member names (str, list[int], function-after[...]) are pydantic's, not the request's
        param = ".".join(str(x) for x in err["loc"] if not (isinstance(x, str) and (
            x in ("str", "int", "float", "bool", "list", "dict", "none") or "[" in x))) or None
        msg = err["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{param}: {msg}" if param else msg, param=param) from None


def create_app(engine, model_name: str, api_key: str | None = None, aliases: Iterable[str] = (),
               strict_model: bool = False) -> FastAPI:
    """The app serving `engine` as `model_name`. A request's `model` may be any name, as with llama-server (a
    client written for another API sends its own, "gpt-4o" say); replies carry the served name. With
    strict_model, only `model_name`, an alias or "default" is taken, others get a 404. With api_key, /v1/*
    and /metrics need `Authorization: Bearer <api_key>`."""
    metrics = Metrics()
    worker = Worker(engine, metrics)
    names = {model_name, "default", *aliases}

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        yield
        worker.stop()
        engine.wait_saves()

    app = FastAPI(title="jllm", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.worker, app.state.metrics = worker, metrics
    app.add_middleware(_Guard, metrics=metrics)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        log.info("jllm serve: %s %s -> %d: %s", request.method, request.url.path, e.status, e.message)
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}").response()

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "missing or incorrect API key: send the header `Authorization: Bearer <key>`",
                           code="invalid_api_key")

    auth = [Depends(authorize)]

    def check_model(name: str | None, strict: bool = strict_model) -> None:
        if strict and name is not None and name not in names:
            raise APIError(404, f"model {name!r} is not served here; this server serves {model_name!r}",
                           param="model", code="model_not_found")

    def conversation(key: str | None, request: Request) -> str | None:
        if key is None:
            key = request.headers.get(CACHE_KEY_HEADER)
        if key is None:
            return None
        try:
            return check_conversation_id(key)
        except JllmError as e:
            raise APIError(400, f"prompt_cache_key: {e}", param="prompt_cache_key") from None

    async def run(request: Request, req, make_ids, chat: bool):
        check_model(req.model)
        try:
            params = req.sampling(default_max_tokens=engine.ctx_size)
        except JllmError as e:
            raise APIError(400, str(e)) from None
        pending = _Pending(request)
        pending.job = Job(make_ids, params, conversation(req.prompt_cache_key, request), pending.emit)
        worker.submit(pending.job)
        reply = _Reply(chat, model_name)
        prompt_field = "messages" if chat else "prompt"
        try:
            first = await pending.next()
        except _ClientGone:
            return Response(status_code=499)        # nobody reads it
        except asyncio.CancelledError:
            pending.cancel()
            raise
        if first[0] == "error":
            raise _from_engine(first[1], prompt_field)
        if req.stream:
            return StreamingResponse(_stream(pending, first, reply, req.include_usage, prompt_field),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        parts, event = [], first
        try:
            while event[0] == "piece":
                parts.append(event[1].text)
                event = await pending.next()
        except _ClientGone:
            return Response(status_code=499)
        except asyncio.CancelledError:
            pending.cancel()
            raise
        if event[0] == "error":
            raise _from_engine(event[1], prompt_field)
        return JSONResponse(reply.full("".join(parts), event[1]))

    async def _stream(pending: _Pending, event: tuple, reply: _Reply, include_usage: bool, prompt_field: str):
        try:
            if reply.chat:
                yield _sse(reply.chunk(role=True))
            while event[0] == "piece":
                if event[1].text:
                    yield _sse(reply.chunk(text=event[1].text))
                event = await pending.next()
            if event[0] == "error":             # the status line is sent: report it in the stream
                e = _from_engine(event[1], prompt_field)
                yield _sse({"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}})
            else:
                outcome = event[1]
                yield _sse({**reply.chunk(finish=outcome.finish_reason), **extras(outcome)})
                if include_usage:
                    yield _sse(reply.usage_chunk(outcome))
            yield "data: [DONE]\n\n"
        except _ClientGone:
            pass
        finally:                                # closed early (disconnect, cancellation): stop generating
            pending.cancel()

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request):
        req = await _parse(request, ChatRequest)
        messages = [m.for_template() for m in req.messages]
        return await run(request, req, lambda: engine.chat_ids(messages), chat=True)

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request):
        req = await _parse(request, CompletionRequest)
        prompt = req.prompt
        if isinstance(prompt, list):
            vocab = min(engine.model.cfg.vocab_size, engine.tokenizer.vocab_size)
            bad = [i for i in prompt if not 0 <= i < vocab]
            if bad:
                raise APIError(400, f"prompt: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                               param="prompt")
        return await run(request, req, lambda: engine.encode(prompt) if isinstance(prompt, str) else list(prompt),
                         chat=False)

    def model_card() -> dict:
        try:
            created = int(engine.gguf.path.stat().st_mtime)
        except OSError:
            created = 0
        return {"id": model_name, "object": "model", "created": created, "owned_by": "jllm"}

    @app.get("/v1/models", dependencies=auth)
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}", dependencies=auth)
    async def model(name: str):
        check_model(name, strict=True)                # a lookup by name answers for the served names only
        return model_card()

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "queue_depth": worker.depth, "running": worker.running}

    @app.get("/metrics", dependencies=auth)
    def prometheus():                           # sync: FastAPI runs it on a thread (the store scans a directory)
        stats = engine.kv_store.stats() if engine.kv_store is not None else None
        return PlainTextResponse(metrics.render(worker.depth, worker.running, stats),
                                 media_type="text/plain; version=0.0.4")

    return app
