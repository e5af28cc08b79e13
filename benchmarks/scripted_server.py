"""A scripted OpenAI-compatible server on loopback: a root model and a sub-model, both paced.

``POST /v1/chat/completions`` (streaming and not) and ``GET /v1/models``:

* model ``root_model``: the reply is ``root(messages)`` -- by default the scripted response whose
  index is the number of assistant messages in the request (so an agent loop gets response 0,
  then 1, ... and every run of the same script gets the same replies). Its tokens
  (`agentrt.engine.replay.split_tokens`) come at ``tokens_per_second``; a non-streamed reply
  arrives whole after the same time, so streamed and whole replies take equally long. A response
  may be a list of text parts and `WaitForSubCalls` marks: a stream stops there until the
  sub-model has received that many requests since the root request started (early calls made
  while the root streams), or ``timeout_s`` passes; the wait is recorded in ``waits``;
* any other model: the sub-model, ``sub(prompt)`` after ``sub_latency_s`` (the prompt is the
  request's message contents joined by newlines).

Usage is reported (chunk with ``stream_options.include_usage``, or the ``usage`` field).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentrt.engine.replay import split_tokens

from .oolong.server import _Handler as _OpenAIHandler
from .oolong.server import _Server

ROOT_MODEL = "scripted-root"
SUB_MODEL = "scripted-sub"


@dataclass(frozen=True)
class WaitForSubCalls:
    """In a streamed root response: pause until ``count`` sub-model requests have arrived since
    the root request started (at most ``timeout_s``)."""

    count: int = 1
    timeout_s: float = 30.0


Part = str | WaitForSubCalls
Script = str | Sequence[Part]


@dataclass
class Wait:
    """What happened at one `WaitForSubCalls` mark."""

    wanted: int
    arrived: int
    waited_s: float

    @property
    def satisfied(self) -> bool:
        return self.arrived >= self.wanted


def _echo(prompt: str) -> str:
    return f"reply to: {prompt[:60]}"


@dataclass
class ScriptedServer:
    """``with ScriptedServer(responses) as server:`` -- ``server.url`` is the ``/v1`` base URL."""

    responses: Sequence[Script] = ()
    sub: Callable[[str], str] = _echo
    tokens_per_second: float = 200.0
    sub_latency_s: float = 0.2
    root: Callable[[list[dict[str, Any]]], Script] | None = None
    root_model: str = ROOT_MODEL
    waits: list[Wait] = field(default_factory=list)
    sub_prompts: list[str] = field(default_factory=list)
    root_requests: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Condition()
        self._httpd = _Server(("127.0.0.1", 0), type("Handler", (_Handler,), {"owner": self}))

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> ScriptedServer:
        self._httpd.serve_in_background()
        return self

    def stop(self) -> None:
        self._httpd.stop_serving()

    def __enter__(self) -> ScriptedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- replies -------------------------------------------------------------------------------

    def script_for(self, messages: list[dict[str, Any]]) -> list[Part]:
        """The root's reply to ``messages`` as parts."""
        if self.root is not None:
            script = self.root(messages)
        else:
            turn = sum(1 for m in messages if m.get("role") == "assistant")
            if turn >= len(self.responses):
                raise LookupError(f"the script has {len(self.responses)} responses; "
                                  f"turn {turn} has none")
            script = self.responses[turn]
        return [script] if isinstance(script, str) else list(script)

    def sub_reply(self, prompt: str) -> str:
        with self._lock:
            self.sub_prompts.append(prompt)
            self._lock.notify_all()
        time.sleep(self.sub_latency_s)
        return self.sub(prompt)

    def play_root(self, parts: list[Part], emit: Callable[[str], None] | None) -> tuple[str, int]:
        """Pace the root's reply: ``emit`` each token (None: whole, after the same time)."""
        with self._lock:
            self.root_requests += 1
            subs_before = len(self.sub_prompts)
        start, released, text = time.monotonic(), 0, []
        for part in parts:
            if isinstance(part, WaitForSubCalls):
                if emit is not None:
                    waited = self._wait_for_subs(subs_before + part.count, part.timeout_s)
                    start += waited  # the pause does not count against the token schedule
                continue
            for piece in split_tokens(part):
                due = start + released / self.tokens_per_second
                released += 1
                if emit is not None:
                    time.sleep(max(0.0, due - time.monotonic()))
                    emit(piece)
                text.append(piece)
        if emit is None:
            time.sleep(max(0.0, start + released / self.tokens_per_second - time.monotonic()))
        return "".join(text), released

    def _wait_for_subs(self, wanted: int, timeout_s: float) -> float:
        started = time.monotonic()
        with self._lock:
            self._lock.wait_for(lambda: len(self.sub_prompts) >= wanted, timeout_s)
            arrived = len(self.sub_prompts)
        waited = time.monotonic() - started
        self.waits.append(Wait(wanted, arrived, waited))
        return waited


def _prompt_of(messages: list[dict[str, Any]]) -> str:
    return "\n".join(str(m.get("content", "")) for m in messages)


class _Handler(_OpenAIHandler):
    """The simulated sub-model's HTTP plumbing (SSE chunks, JSON replies), scripted replies."""

    owner: ScriptedServer

    def do_GET(self) -> None:
        if self.path.rstrip("/").endswith("/models"):
            models = [self.owner.root_model, SUB_MODEL]
            self._json(200, {"object": "list", "data": [
                {"id": m, "object": "model", "owned_by": "agentrt-scripted"} for m in models]})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if not self.path.rstrip("/").endswith("/chat/completions"):
            self._json(404, {"error": {"message": f"no route {self.path}"}})
            return
        try:
            body = json.loads(raw or b"{}")
            messages = body["messages"]
            if not isinstance(messages, list):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            self._json(400, {"error": {"message": "the body needs a 'messages' list"}})
            return
        model = str(body.get("model", ""))
        base = {"id": f"cmpl-{id(self)}", "created": int(time.time()), "model": model}
        prompt_tokens = len(split_tokens(_prompt_of(messages)))
        is_root = model == self.owner.root_model
        if is_root:
            try:
                parts = self.owner.script_for(messages)
            except LookupError as exc:
                self._json(400, {"error": {"message": str(exc)}})
                return
        if body.get("stream"):
            self._stream_headers()
            self._event({**base, "object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""},
                 "finish_reason": None}]})
            emit = self._emitter(base)
            if is_root:
                _, tokens = self.owner.play_root(parts, emit)
            else:
                text = self.owner.sub_reply(_prompt_of(messages))
                emit(text)
                tokens = len(split_tokens(text))
            self._event({**base, "object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {}, "finish_reason": "stop"}]})
            if (body.get("stream_options") or {}).get("include_usage"):
                self._event({**base, "object": "chat.completion.chunk", "choices": [],
                             "usage": _usage(prompt_tokens, tokens)})
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")
            return
        if is_root:
            text, tokens = self.owner.play_root(parts, None)
        else:
            text = self.owner.sub_reply(_prompt_of(messages))
            tokens = len(split_tokens(text))
        self._json(200, {**base, "object": "chat.completion", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": text},
             "finish_reason": "stop"}], "usage": _usage(prompt_tokens, tokens)})

    def _emitter(self, base: dict[str, Any]) -> Callable[[str], None]:
        def emit(piece: str) -> None:
            self._event({**base, "object": "chat.completion.chunk", "choices": [
                {"index": 0, "delta": {"content": piece}, "finish_reason": None}]})
        return emit

    def _stream_headers(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
