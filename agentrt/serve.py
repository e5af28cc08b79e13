"""``agentrt serve``: an OpenAI-compatible HTTP server over an agentrt engine (the native one by
default), so any OpenAI client, the RLM library or another harness can use it.

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions`` (streaming as server-sent events,
or not), ``GET /health`` and ``GET /metrics`` (requests in flight and done, speculative-decoding
and batching metrics, KV cache blocks). Every request is one stream of the engine, so the native
engine batches concurrent requests continuously, shares cached prompt prefixes, speculates
tokens, and serves lower ``priority`` values first (``priority`` and ``top_k`` are accepted as
extra body fields). A client that disconnects cancels its request, which gives its KV blocks
back. Bad requests get a 4xx with an OpenAI-style ``{"error": {"message", "type", "param"}}``.

Limits (`ServeLimits`, in `agentrt.serve_limits`): body size, message count and JSON depth
(4xx), requests in progress (a 503 with ``Retry-After`` beyond), and, under `serve`, the
connection guards of `agentrt.serve_guard` (header, body and write deadlines, a connection
cap). An API key (`agentrt.serve_auth`) makes every endpoint but ``/health`` need
``Authorization: Bearer KEY``.

Needs ``starlette`` and ``uvicorn`` (``pip install 'agentrt[serve]'``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Literal

import anyio
import anyio.lowlevel
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentrt.engine.base import Delta, Engine, EngineError, SamplingParams, Usage

from .serve_auth import ApiKeyGate, exposure_warning
from .serve_limits import (CLOSE, ConnectionCounts, RequestError, ServeLimits, check_json_depth,
                           read_body)

log = logging.getLogger("agentrt.serve")

DEFAULT_MAX_TOKENS = 4096
"""``max_tokens`` of a request that sets none, for an engine without ``max_seq_len``."""

MAX_STOP = 16
"""Most ``stop`` strings in one request (each is checked against every new token)."""


class _TextPart(BaseModel):
    type: Literal["text"]
    text: str


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[_TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatRequest(BaseModel):
    """The body of ``POST /v1/chat/completions`` (fields this server reads; others ignored)."""

    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[_Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    n: int = 1
    priority: int = 0
    tools: list[Any] | None = None
    logprobs: bool | None = None

    def sampling(self, context: int | None) -> SamplingParams:
        """The engine's parameters; ``max_tokens`` is capped by ``context`` (the engine's
        ``max_seq_len``), and is the whole context when the request sets none."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        wanted = self.max_completion_tokens or self.max_tokens
        if context is None:
            max_tokens = wanted or DEFAULT_MAX_TOKENS
        else:
            max_tokens = min(wanted or context, context)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed,
            stop=tuple(stop), priority=self.priority)


@dataclass
class RequestCounts:
    """What the server has done with its chat requests."""

    running: int = 0
    finished: int = 0
    cancelled: int = 0
    """Ended because the client went away before the reply was complete."""
    failed: int = 0
    rejected: int = 0
    """Refused with a 4xx before reaching the engine."""
    overloaded: int = 0
    """Refused with a 503: ``max_requests`` chat requests were in progress."""
    unauthorized: int = 0
    """Refused with a 401: no API key or a wrong one (any endpoint)."""


class _Slot:
    """One of the ``max_requests`` places for a chat request, given back exactly once."""

    def __init__(self, server: ChatServer) -> None:
        self.server = server
        server.in_progress += 1
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self.server.in_progress -= 1


class ChatServer:
    """The OpenAI-compatible API over one engine, as an ASGI app (`app`).

    ``limits`` bounds what a request may ask for and how many run at once; ``api_key`` (when
    set) must come with every request but ``/health``. The connection guards need the server
    to run under `uvicorn_config` (as `serve` does).
    """

    def __init__(self, engine: Engine, model_name: str, *, limits: ServeLimits | None = None,
                 api_key: str | None = None) -> None:
        from starlette.applications import Starlette
        from starlette.routing import Route

        self.engine = engine
        self.model_name = model_name
        self.limits = limits or ServeLimits()
        self.counts = RequestCounts()
        self.connections = ConnectionCounts()
        self.in_progress = 0
        """Chat requests holding a slot: reading their body, queued in the engine or replying."""
        self.created = int(time.time())
        self.app: Any = Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ])
        if api_key:
            self.app = ApiKeyGate(self.app, api_key, on_refused=self._unauthorized)

    # -- endpoints ---------------------------------------------------------------------------

    async def models(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": self.created,
             "owned_by": "agentrt"}]})

    async def health(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ok"})

    async def metrics(self, request):
        """Request and connection counts, the engine's metrics and its KV cache blocks."""
        from starlette.responses import JSONResponse

        body: dict[str, Any] = {"requests": {**asdict(self.counts),
                                             "in_progress": self.in_progress},
                                "connections": asdict(self.connections)}
        spec = getattr(self.engine, "metrics", lambda: None)()
        if spec is not None:
            body["speculation"] = spec.to_dict()
        batch_metrics = getattr(self.engine, "batch_metrics", None)
        if batch_metrics is not None:
            batch = batch_metrics().to_dict()
            batch.pop("timeline", None)
            body["batching"] = batch
        pool = getattr(self.engine, "pool", None)
        if pool is not None:
            body["kv_cache"] = {"blocks": pool.num_blocks, "in_use": pool.in_use(),
                                "available": pool.available(), "block_size": pool.block_size}
        return JSONResponse(body)

    async def chat(self, request):
        from starlette.background import BackgroundTask
        from starlette.requests import ClientDisconnect
        from starlette.responses import JSONResponse, StreamingResponse

        if self.in_progress >= self.limits.max_requests:
            self.counts.overloaded += 1
            return _error_response(RequestError(
                503, f"the server is busy: {self.in_progress} requests are in progress (at most "
                     f"{self.limits.max_requests}); retry in {self.limits.retry_after_s} s",
                kind="server_error", code="overloaded",
                headers={"Retry-After": str(self.limits.retry_after_s), **CLOSE}))
        slot = _Slot(self)
        streaming = False  # a streaming reply gives its slot back when its events end
        try:
            try:
                chat = self._parse(await read_body(request, self.limits))
                messages = [{"role": "system" if m.role == "developer" else m.role,
                             "content": m.text()} for m in chat.messages]
                params = chat.sampling(getattr(self.engine, "max_seq_len", None))
                self._check_prompt(messages)
            except RequestError as exc:
                self.counts.rejected += 1
                return _error_response(exc)
            except ClientDisconnect:  # gone mid-body: nothing to answer
                return JSONResponse({}, status_code=499)
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            self.counts.running += 1
            stream = self.engine.stream(messages, params)
            if chat.stream:
                include_usage = bool(chat.stream_options and chat.stream_options.include_usage)
                events = _Events(self, rid, stream, include_usage, slot)
                streaming = True
                return StreamingResponse(events.body, media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache"},
                                         background=BackgroundTask(events.close))
            return await self._complete(request, rid, stream)
        finally:
            if not streaming:
                slot.release()

    # -- helpers -----------------------------------------------------------------------------

    async def _complete(self, request, rid: str, stream: AsyncIterator[Delta]):
        """The whole reply as one JSON response; the client going away cancels it."""
        from starlette.responses import JSONResponse

        outcome: list[Any] = []
        async with anyio.create_task_group() as group:
            group.start_soon(self._collect, stream, outcome, group.cancel_scope)
            group.start_soon(_cancel_on_disconnect, request, group.cancel_scope)
        if not outcome:  # the client went away: the request was cancelled
            return JSONResponse({}, status_code=499)
        if isinstance(outcome[0], Exception):
            error = RequestError(500, f"generation failed: {outcome[0]}", kind="server_error")
            return _error_response(error)
        text, finish, usage = outcome
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish, "logprobs": None}],
            "usage": _usage(usage),
        })

    def _parse(self, raw: bytes) -> ChatRequest:
        check_json_depth(raw, self.limits.max_json_depth)
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise RequestError(400, f"the body is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise RequestError(400, "the body must be a JSON object")
        messages = data.get("messages")
        if isinstance(messages, list) and len(messages) > self.limits.max_messages:
            raise RequestError(400, f"messages: {len(messages)} messages; this server accepts at "
                                    f"most {self.limits.max_messages}", param="messages")
        try:
            chat = ChatRequest.model_validate(data)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(str(p) for p in first["loc"])
            raise RequestError(400, f"{where}: {first['msg']}", param=where) from None
        if chat.model != self.model_name:
            raise RequestError(404, f"model {chat.model!r} does not exist; this server serves "
                                    f"{self.model_name!r}", param="model", kind="not_found_error")
        for name, bad in (("n", chat.n != 1), ("tools", bool(chat.tools)),
                          ("logprobs", bool(chat.logprobs))):
            if bad:
                raise RequestError(400, f"{name}: not supported by this server", param=name)
        try:
            chat.sampling(1)
        except ValueError as exc:
            raise RequestError(400, str(exc)) from None
        return chat

    def _check_prompt(self, messages: list[dict[str, str]]) -> None:
        """Refuse a prompt the engine could never fit (a 400 rather than a failed stream)."""
        tokenizer = getattr(self.engine, "tokenizer", None)
        limit = getattr(self.engine, "max_seq_len", None)
        if tokenizer is None or limit is None:
            return
        n = len(tokenizer.encode_chat(messages))
        if n + 1 > limit:
            raise RequestError(400, f"the prompt is {n} tokens; this model's context is "
                                    f"{limit} tokens", param="messages")

    def _done(self, how: str) -> None:
        self.counts.running -= 1
        setattr(self.counts, how, getattr(self.counts, how) + 1)

    def _unauthorized(self) -> None:
        self.counts.unauthorized += 1

    async def _collect(self, stream: AsyncIterator[Delta], outcome: list[Any],
                       scope: anyio.CancelScope) -> None:
        parts, finish, usage, how = [], None, None, "cancelled"
        try:
            async with contextlib.aclosing(stream):
                async for delta in stream:
                    await anyio.lowlevel.checkpoint()  # an engine that never waits: let the
                    parts.append(delta.text)           # disconnect watch and other clients run
                    finish = delta.finish_reason or finish
                    usage = delta.usage or usage
            if finish is None and not parts:
                raise EngineError("the engine ended the stream without a reply")
            outcome[:] = ["".join(parts), finish, usage]
            how = "finished"
        except Exception as exc:  # EngineError, or a bug in the engine: the client gets a 500
            if not isinstance(exc, EngineError):
                log.exception("the engine failed")
            outcome[:] = [exc]
            how = "failed"
        finally:
            self._done(how)
            scope.cancel()  # stop watching for a disconnect


class _Events:
    """The server-sent events of one streaming reply; closing them cancels the generation.

    The first event (the assistant role) goes out as soon as the request is accepted, before
    the engine has produced anything, so every accepted stream hears from the server at once;
    an engine failure after that is an error event in the stream.
    """

    def __init__(self, server: ChatServer, rid: str, stream: AsyncIterator[Delta],
                 include_usage: bool, slot: _Slot) -> None:
        self.server, self.rid, self.stream, self.slot = server, rid, stream, slot
        self.include_usage = include_usage
        self.created = int(time.time())
        self.started = False
        self.body = self._run()

    def _chunk(self, delta: dict[str, Any] | None, finish: str | None = None,
               usage: Any = None) -> str:
        body: dict[str, Any] = {"id": self.rid, "object": "chat.completion.chunk",
                                "created": self.created, "model": self.server.model_name,
                                "choices": []}
        if delta is not None:
            body["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish,
                                "logprobs": None}]
        if usage is not None:
            body["usage"] = _usage(usage)
        return f"data: {json.dumps(body)}\n\n"

    async def _run(self) -> AsyncIterator[str]:
        self.started = True
        how = "cancelled"
        try:
            yield self._chunk({"role": "assistant", "content": ""})
            usage, replied = None, False
            async with contextlib.aclosing(self.stream):
                async for delta in self.stream:
                    await anyio.lowlevel.checkpoint()  # as in ChatServer._collect
                    replied = True
                    if delta.text:
                        yield self._chunk({"content": delta.text})
                    usage = delta.usage or usage
                    if delta.finish_reason is not None:
                        yield self._chunk({}, delta.finish_reason)
            if not replied:
                raise EngineError("the engine ended the stream without a reply")
            if self.include_usage:
                yield self._chunk(None, usage=usage or Usage())
            yield "data: [DONE]\n\n"
            how = "finished"
        except Exception as exc:  # EngineError, or a bug in the engine: an error event
            if not isinstance(exc, EngineError):
                log.exception("the engine failed")
            how = "failed"
            error = RequestError(500, f"generation failed: {exc}", kind="server_error")
            yield f"data: {json.dumps(error.body())}\n\n"
        finally:
            self.server._done(how)
            self.slot.release()

    async def close(self) -> None:
        """After the response, however it ended: close the events (a client gone mid-stream
        leaves them suspended) and, if they never started, the engine stream they hold."""
        await self.body.aclose()  # type: ignore[attr-defined]
        if not self.started:
            await self.stream.aclose()  # type: ignore[attr-defined]
            self.server._done("cancelled")
            self.slot.release()


async def _cancel_on_disconnect(request, scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` when the client goes away (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


def _error_response(error: RequestError):
    from starlette.responses import JSONResponse

    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _usage(usage: Any) -> dict[str, int]:
    prompt = getattr(usage, "prompt_tokens", 0)
    completion = getattr(usage, "completion_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def uvicorn_config(server: ChatServer, *, host: str = "127.0.0.1", port: int = 8000,
                   log_level: str = "info") -> Any:
    """The ``uvicorn.Config`` that serves ``server`` with its limits: the guarded h11 protocol
    (header and write deadlines, connection cap), the keep-alive timeout and the header size
    limit; no websockets."""
    import uvicorn

    from .serve_guard import guarded_h11

    limits = server.limits
    return uvicorn.Config(
        server.app, host=host, port=port, log_level=log_level, ws="none",
        http=guarded_h11(limits, server.connections),
        timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type]  # a float works
        h11_max_incomplete_event_size=limits.max_header_bytes)


def serve(engine: Engine, *, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", limits: ServeLimits | None = None,
          api_key: str | None = None) -> None:
    """Serve ``engine`` as ``model_name`` on ``host:port`` until interrupted.

    Warns loudly (log and stderr) when ``host`` is not loopback and there is no ``api_key``.
    """
    import uvicorn

    exposure_warning(host, api_key)
    server = ChatServer(engine, model_name, limits=limits, api_key=api_key)
    uvicorn.Server(uvicorn_config(server, host=host, port=port, log_level=log_level)).run()


__all__ = ["ChatRequest", "ChatServer", "RequestCounts", "RequestError", "ServeLimits", "serve",
           "uvicorn_config"]
