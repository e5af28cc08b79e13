"""An OpenAI-compatible HTTP server on loopback, for tests and benchmarks.

`StubServer` speaks the wire format and answers every completion request with `respond`:

- ``POST /v1/chat/completions`` and ``POST /v1/completions`` (also without ``/v1``): JSON replies,
  or server-sent events in chunked encoding, in the chat or completions shape of the path;
- ``GET /v1/models`` (or ``/models``): the ids in ``models`` (404 when None), ``GET /health``:
  200, ``GET /metrics``: ``metrics_text`` (404 when None).

Every POST is recorded in ``requests``, every GET path in ``gets`` (unless ``record=False``: a
long-lived server).

A plain `StubServer` plays scripted actions, one per completion request (`push`):

- `Stream`: a 200 event stream of text pieces; it can pause between pieces or hang up after
  ``drop_after`` pieces;
- `Status`: an HTTP error with an OpenAI-style JSON error body;
- `Stall`: say nothing for a while (a slow server), then hang up;
- `Hangup`: close the connection without answering;
- `Raw`: a 200 event stream written exactly as scripted (malformed chunks, bare ``data`` lines),
  optionally one byte at a time, then ended, hung up, followed by keep-alive comments forever,
  or by its last item repeated forever.

Subclasses answer otherwise by overriding `respond` (the paced root and sub-model of
`benchmarks.scripted_server`, the simulated sub-model of `benchmarks.oolong.server`).
`chunk` builds one well-formed chat chunk event; `engine_for` makes an `OpenAIEngine` for a
server with quick retries.
"""

from __future__ import annotations

import itertools
import json
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

COMPLETION_PATHS = ("/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions")
MODEL_PATHS = ("/v1/models", "/models")


# ------------------------------------------------------------------------------- scripts

@dataclass
class Stream:
    pieces: list[str]
    finish_reason: str | None = "stop"
    usage: tuple[int, int] | None = (5, -1)
    """(prompt_tokens, completion_tokens); -1 means len(pieces). None sends no usage chunk."""
    delay_s: float = 0.0
    """Pause between two pieces (not before the first)."""
    drop_after: int | None = None
    """Hang up (no terminating chunk) after this many text pieces."""
    send_done: bool = True
    spec_summary: dict[str, Any] | None = None
    """vLLM's per-request ``metrics.speculative_decoding``, sent with the usage chunk."""
    metrics_after: str | None = None
    """When set, becomes the server's /metrics text once the stream is written (counters moved)."""


@dataclass
class Status:
    code: int
    message: str = "scripted failure"
    retry_after: float | None = None


@dataclass
class Stall:
    seconds: float


@dataclass
class Hangup:
    pass


@dataclass
class Raw:
    events: list[str]
    """Text written in order (each item as it is: SSE events end with a blank line)."""
    delay_s: float = 0.0
    """Pause before each item after the first (and between repeats or keep-alives)."""
    byte_delay_s: float | None = None
    """Write one byte at a time, this far apart (a server that trickles)."""
    then: Literal["end", "hang_up", "keep_alive", "repeat"] = "end"
    """After the items: end the response, hang up, send ``: keep-alive`` comments forever, or
    send the last item again forever."""


Action = Stream | Status | Stall | Hangup | Raw


def chunk(content: str | None = "", finish_reason: str | None = None, **fields: Any) -> str:
    """One chat chunk event (``data: {...}`` and a blank line); ``fields`` replace top-level keys
    (``choices=[None]``, ``usage={...}``)."""
    choice = {"index": 0, "delta": {"content": content}, "finish_reason": finish_reason}
    payload = {"id": "cmpl-fake", "object": "chat.completion.chunk", "model": "fake-model",
               "choices": [choice], **fields}
    return "data: " + json.dumps(payload) + "\n\n"


def engine_for(server: StubServer, **kwargs: Any):
    """An `OpenAIEngine` for ``server`` asking for its model (back-off 10 ms, read timeout 5 s
    unless given)."""
    from agentrt.engine.openai_engine import OpenAIEngine

    kwargs.setdefault("backoff", 0.01)
    kwargs.setdefault("timeout", 5.0)
    return OpenAIEngine(server.base_url, server.model or "fake-model", **kwargs)


# ------------------------------------------------------------------------ one request

class BadRequest(Exception):
    """Raised by a `respond` method: the request is answered 400 with this message."""


@dataclass
class Request:
    """One POST as received (``body``: its JSON, or ``{"_raw": text}`` when it was none)."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def chat(self) -> bool:
        return self.path.rstrip("/").endswith("/chat/completions")

    @property
    def model(self) -> str:
        return str(self.body.get("model", ""))

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def include_usage(self) -> bool:
        return bool((self.body.get("stream_options") or {}).get("include_usage"))

    def messages(self) -> list[dict[str, Any]]:
        """The chat messages; `BadRequest` when the body has no list of them."""
        messages = self.body.get("messages")
        if not isinstance(messages, list):
            raise BadRequest("the body needs a 'messages' list")
        return messages

    def prompt(self) -> str:
        """The messages' text contents joined by newlines (text parts of list contents)."""
        parts = []
        for m in self.messages():
            content = m.get("content", "")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(str(content))
        return "\n".join(parts)


class Response:
    """How `StubServer.respond` answers one request: a JSON body, an error, or an event stream
    (`open_stream`, then `piece`, `finish`, `usage` and `close_stream`, in the chat or
    completions shape of the request's path)."""

    def __init__(self, handler: _Handler, request: Request, model: str, completion_id: str):
        self._handler = handler
        self.chat = request.chat
        self.model = model
        self.id = completion_id

    # -- whole replies -----------------------------------------------------------------------

    def json(self, code: int, payload: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        self._handler.send_json(code, payload, headers)

    def error(self, code: int, message: str, headers: dict[str, str] | None = None) -> None:
        """An OpenAI-style error body."""
        self.json(code, {"error": {"message": message, "type": "BadRequestError", "code": code}},
                  headers)

    def complete(self, text: str, finish_reason: str, prompt_tokens: int,
                 completion_tokens: int) -> None:
        """A whole (non-streamed) completion."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        self.json(200, {**self._base(), "object": "chat.completion" if self.chat else
                        "text_completion", "choices": [choice],
                        "usage": _usage(prompt_tokens, completion_tokens)})

    # -- event streams ---------------------------------------------------------------------

    def open_stream(self, role: bool = True) -> None:
        """200 with event-stream headers, then (chat, ``role``) the assistant-role delta."""
        h = self._handler
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        if self.chat and role:
            self._choice({"delta": {"role": "assistant", "content": ""}, "finish_reason": None})

    def piece(self, text: str) -> None:
        """One text delta."""
        self._choice({"delta": {"content": text}} if self.chat else {"text": text},
                     finish_reason=None)

    def finish(self, reason: str) -> None:
        self._choice({"delta": {}} if self.chat else {"text": ""}, finish_reason=reason)

    def usage(self, prompt_tokens: int, completion_tokens: int, **fields: Any) -> None:
        """The usage chunk (no choices); ``fields`` are added to it."""
        self.event({**self._base(), "object": self._kind(), "choices": [],
                    "usage": _usage(prompt_tokens, completion_tokens), **fields})

    def close_stream(self, done: bool = True) -> None:
        """``data: [DONE]`` (when ``done``), then the end of the chunked body."""
        if done:
            self.write(b"data: [DONE]\n\n")
        self.write(b"")

    def event(self, payload: dict[str, Any]) -> None:
        self.write(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def write(self, data: bytes) -> None:
        """One chunk of the chunked body, as it is (``b""`` ends the body)."""
        self._handler.write_chunk(data)

    def hang_up(self) -> None:
        """Close the connection, whatever was sent."""
        self._handler.hang_up()

    def _choice(self, fields: dict[str, Any], finish_reason: str | None = None) -> None:
        choice = {"index": 0, **fields}
        choice.setdefault("finish_reason", finish_reason)
        self.event({**self._base(), "object": self._kind(), "choices": [choice]})

    def _kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def _base(self) -> dict[str, Any]:
        return {"id": self.id, "created": int(time.time()), "model": self.model}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# ---------------------------------------------------------------------------- the server

class StubServer:
    """``with StubServer() as server:``; ``server.url`` is ``http://127.0.0.1:<port>``,
    ``server.base_url`` the same with ``/v1``.

    ``model``: the model named in replies (None: the one each request asks for); ``models``: the
    ids ``GET /v1/models`` lists (None: no such route).
    """

    def __init__(self, model: str | None = "fake-model", models: Sequence[str] | None = None,
                 host: str = "127.0.0.1", port: int = 0, record: bool = True) -> None:
        self.model = model
        self.models = None if models is None else list(models)
        self.record = record
        self.script: list[Action] = []
        self.requests: list[Request] = []
        """The POSTs received, in order (when ``record``)."""
        self.gets: list[str] = []
        """Paths of the GETs received (when ``record``)."""
        self.metrics_text: str | None = None
        self.stopping = threading.Event()
        """Set by `stop`: stalled and endless responses end."""
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._httpd = _HTTPServer((host, port), type("Handler", (_Handler,), {"stub": self}))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def start(self) -> StubServer:
        """Serve on a daemon thread until `stop`."""
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve on the calling thread (until Ctrl-C); `stop` closes the socket afterwards."""
        self._httpd.serve_forever(poll_interval=0.1)

    def stop(self) -> None:
        self.stopping.set()
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> StubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the script ------------------------------------------------------------------------

    def push(self, *actions: Action) -> None:
        """Queue actions for the next requests, in order."""
        with self._lock:
            self.script.extend(actions)

    def next_action(self) -> Action:
        with self._lock:
            if self.script:
                return self.script.pop(0)
        return Status(500, "the stub server has no scripted reply left")

    def respond(self, request: Request, response: Response) -> None:
        """Answer one completion request: here, with the next scripted action."""
        action = self.next_action()
        if isinstance(action, Status):
            headers = {} if action.retry_after is None else {"Retry-After": f"{action.retry_after:g}"}
            response.error(action.code, action.message, headers)
        elif isinstance(action, Stall):
            self.stopping.wait(action.seconds)
            response.hang_up()
        elif isinstance(action, Hangup):
            response.hang_up()
        elif isinstance(action, Raw):
            self._play_raw(action, response)
        else:
            self._play_stream(action, response)

    def _play_stream(self, action: Stream, response: Response) -> None:
        response.open_stream()
        for i, piece in enumerate(action.pieces):
            if action.drop_after is not None and i >= action.drop_after:
                response.hang_up()
                return
            if action.delay_s and i > 0:
                time.sleep(action.delay_s)
            response.piece(piece)
        if action.drop_after is not None:
            response.hang_up()
            return
        if action.finish_reason is not None:
            response.finish(action.finish_reason)
        if action.usage is not None:
            prompt, completion = action.usage
            extra = ({} if action.spec_summary is None
                     else {"metrics": {"speculative_decoding": action.spec_summary}})
            response.usage(prompt, len(action.pieces) if completion < 0 else completion, **extra)
        if action.metrics_after is not None:
            self.metrics_text = action.metrics_after
        response.close_stream(done=action.send_done)

    def _play_raw(self, action: Raw, response: Response) -> None:
        response.open_stream(role=False)
        try:
            for i, item in enumerate(action.events):
                if i and action.delay_s and self.stopping.wait(action.delay_s):
                    return
                if action.byte_delay_s is None:
                    response.write(item.encode())
                    continue
                for byte in item.encode():
                    response.write(bytes([byte]))
                    if self.stopping.wait(action.byte_delay_s):
                        return
            if action.then in ("keep_alive", "repeat"):
                item = ": keep-alive\n\n" if action.then == "keep_alive" else action.events[-1]
                while not self.stopping.wait(action.delay_s or 0.05):
                    response.write(item.encode())
            elif action.then == "hang_up":
                response.hang_up()
            else:
                response.write(b"")
        except (BrokenPipeError, ConnectionResetError):
            response.hang_up()  # the client gave up: what the scripted stream is for

    # -- bookkeeping (the handler's threads) -----------------------------------------------

    def _received(self, request: Request | None, get: str | None = None) -> str:
        """Record a POST or a GET path; returns the next completion id."""
        with self._lock:
            if self.record and get is not None:
                self.gets.append(get)
            elif self.record and request is not None:
                self.requests.append(request)
            return f"cmpl-stub-{next(self._ids)}"


class _HTTPServer(ThreadingHTTPServer):
    """A thread per connection; clients hanging up mid-stream print no traceback."""

    request_queue_size = 256
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    stub: StubServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # no access log
        return None

    def do_GET(self) -> None:
        stub = self.stub
        stub._received(None, get=self.path)
        path = self.path.rstrip("/")
        if path in MODEL_PATHS and stub.models is not None:
            self.send_json(200, {"object": "list", "data": [
                {"id": m, "object": "model", "owned_by": "agentrt-stub"} for m in stub.models]})
        elif path == "/health":
            self.send_json(200, {})
        elif path == "/metrics" and stub.metrics_text is not None:
            data = stub.metrics_text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self.send_json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError:
            body = {"_raw": raw.decode(errors="replace")}
        if not isinstance(body, dict):
            body = {"_raw": raw.decode(errors="replace")}
        request = Request(self.path, body, dict(self.headers.items()))
        completion_id = self.stub._received(request)
        response = Response(self, request, self.stub.model or request.model, completion_id)
        if self.path.rstrip("/") not in COMPLETION_PATHS:
            response.error(404, f"no route {self.path}")
            return
        try:
            self.stub.respond(request, response)
        except BadRequest as exc:
            response.error(400, str(exc))

    def send_json(self, code: int, payload: dict[str, Any],
                  headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def hang_up(self) -> None:
        self.close_connection = True
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
