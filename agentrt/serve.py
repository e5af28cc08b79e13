"""``agentrt serve``: an OpenAI-compatible HTTP server over an agentrt engine (the native one by
default), so any OpenAI client, the RLM library or another harness can use it.

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions`` (streaming as server-sent events,
or not), ``GET /health`` and ``GET /metrics`` (requests in flight and done, speculative-decoding
and batching metrics, KV cache blocks). Every request is one stream of the engine, so the native
engine batches concurrent requests continuously, shares cached prompt prefixes, speculates
tokens, and serves lower ``priority`` values first (``priority`` and ``top_k`` are accepted as
extra body fields). A client that disconnects cancels its request, which gives its KV blocks
back. Bad requests get a 4xx with an OpenAI-style ``{"error": {"message", "type", "param"}}``.

Needs ``starlette`` and ``uvicorn`` (``pip install 'agentrt[serve]'``).
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from agentrt.engine.base import Delta, Engine, EngineError, SamplingParams, Usage

DEFAULT_MAX_TOKENS = 4096
"""``max_tokens`` of a request that sets none, for an engine without ``max_seq_len``."""


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
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    n: int = 1
    priority: int = 0
    tools: list[Any] | None = None
    logprobs: bool | None = None

    def sampling(self, default_max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=self.max_completion_tokens or self.max_tokens or default_max_tokens,
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed,
            stop=tuple(stop), priority=self.priority)


class RequestError(Exception):
    """A request this server refuses: becomes an HTTP error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": None}}


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


class ChatServer:
    """The OpenAI-compatible API over one engine, as an ASGI app (`app`)."""

    def __init__(self, engine: Engine, model_name: str) -> None:
        from starlette.applications import Starlette
        from starlette.routing import Route

        self.engine = engine
        self.model_name = model_name
        self.counts = RequestCounts()
        self.created = int(time.time())
        self.app = Starlette(routes=[
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ])

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
        """Request counts, the engine's metrics and its KV cache blocks (where it has them)."""
        from starlette.responses import JSONResponse

        body: dict[str, Any] = {"requests": asdict(self.counts)}
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
        from starlette.responses import JSONResponse, StreamingResponse

        try:
            chat = self._parse(await request.body())
            messages = [{"role": "system" if m.role == "developer" else m.role,
                         "content": m.text()} for m in chat.messages]
            params = chat.sampling(getattr(self.engine, "max_seq_len", DEFAULT_MAX_TOKENS))
            self._check_prompt(messages)
        except RequestError as exc:
            self.counts.rejected += 1
            return JSONResponse(exc.body(), status_code=exc.status)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        self.counts.running += 1
        stream = self.engine.stream(messages, params)
        try:
            first = await anext(stream)  # an engine error before any text is still an HTTP error
        except (EngineError, StopAsyncIteration) as exc:
            await stream.aclose()
            self._done("failed")
            error = RequestError(500, f"generation failed: {exc}", kind="server_error")
            return JSONResponse(error.body(), status_code=500)
        if chat.stream:
            from starlette.background import BackgroundTask

            include_usage = bool(chat.stream_options and chat.stream_options.include_usage)
            events = _Events(self, rid, first, stream, include_usage)
            return StreamingResponse(events.run(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(events.never_started))
        outcome: list[Any] = []
        async with anyio.create_task_group() as group:
            group.start_soon(self._collect, first, stream, outcome, group.cancel_scope)
            group.start_soon(_cancel_on_disconnect, request, group.cancel_scope)
        if not outcome:  # the client went away: the request was cancelled
            return JSONResponse({}, status_code=499)
        if isinstance(outcome[0], EngineError):
            error = RequestError(500, f"generation failed: {outcome[0]}", kind="server_error")
            return JSONResponse(error.body(), status_code=500)
        text, finish, usage = outcome
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": finish, "logprobs": None}],
            "usage": _usage(usage),
        })

    # -- helpers -----------------------------------------------------------------------------

    def _parse(self, raw: bytes) -> ChatRequest:
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise RequestError(400, f"the body is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise RequestError(400, "the body must be a JSON object")
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

    async def _collect(self, first: Delta, stream: AsyncIterator[Delta], outcome: list[Any],
                       scope: anyio.CancelScope) -> None:
        parts, finish, usage, how = [], None, None, "cancelled"
        try:
            async with contextlib.aclosing(stream):
                async for delta in _chain(first, stream):
                    parts.append(delta.text)
                    finish = delta.finish_reason or finish
                    usage = delta.usage or usage
            outcome[:] = ["".join(parts), finish, usage]
            how = "finished"
        except EngineError as exc:
            outcome[:] = [exc]
            how = "failed"
        finally:
            self._done(how)
            scope.cancel()  # stop watching for a disconnect


class _Events:
    """The server-sent events of one streaming reply; closing them cancels the generation."""

    def __init__(self, server: ChatServer, rid: str, first: Delta, stream: AsyncIterator[Delta],
                 include_usage: bool) -> None:
        self.server, self.rid, self.first, self.stream = server, rid, first, stream
        self.include_usage = include_usage
        self.created = int(time.time())
        self.started = False

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

    async def run(self) -> AsyncIterator[str]:
        self.started = True
        how = "cancelled"
        try:
            yield self._chunk({"role": "assistant", "content": ""})
            usage = None
            async with contextlib.aclosing(self.stream):
                async for delta in _chain(self.first, self.stream):
                    if delta.text:
                        yield self._chunk({"content": delta.text})
                    usage = delta.usage or usage
                    if delta.finish_reason is not None:
                        yield self._chunk({}, delta.finish_reason)
            if self.include_usage:
                yield self._chunk(None, usage=usage or Usage())
            yield "data: [DONE]\n\n"
            how = "finished"
        except EngineError as exc:
            how = "failed"
            error = RequestError(500, f"generation failed: {exc}", kind="server_error")
            yield f"data: {json.dumps(error.body())}\n\n"
        finally:
            self.server._done(how)

    async def never_started(self) -> None:
        """After the response: a client gone before the first event still cancels the request."""
        if not self.started:
            await self.stream.aclose()
            self.server._done("cancelled")


async def _chain(first: Delta, rest: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
    yield first
    if first.finish_reason is None:
        async for delta in rest:
            yield delta


async def _cancel_on_disconnect(request, scope: anyio.CancelScope) -> None:
    """Cancel ``scope`` when the client goes away (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            scope.cancel()
            return


def _usage(usage: Any) -> dict[str, int]:
    prompt = getattr(usage, "prompt_tokens", 0)
    completion = getattr(usage, "completion_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def serve(engine: Engine, *, model_name: str, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info") -> None:
    """Serve ``engine`` as ``model_name`` on ``host:port`` until interrupted."""
    import uvicorn

    uvicorn.run(ChatServer(engine, model_name).app, host=host, port=port, log_level=log_level)


__all__ = ["ChatRequest", "ChatServer", "RequestCounts", "RequestError", "serve"]
