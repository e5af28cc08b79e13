"""A small scripted OpenAI-compatible HTTP server on 127.0.0.1 (error paths of `OpenAIEngine`).

Each POST to ``/v1/chat/completions`` or ``/v1/completions`` takes the next scripted action:

- `Stream`: a 200 SSE stream of text pieces (chunked encoding), in the chat or completions shape
  of the path asked for; it can pause between pieces or hang up after ``drop_after`` pieces;
- `Status`: an HTTP error with an OpenAI-style JSON error body;
- `Stall`: say nothing for a while (a slow server), then hang up;
- `Hangup`: close the connection without answering;
- `Raw`: a 200 SSE response written exactly as scripted (malformed chunks, bare ``data`` lines),
  optionally one byte at a time (a trickle), then ended, hung up, followed by keep-alive
  comments forever, or by its last event repeated forever.

`chunk` builds one well-formed chat chunk event; tests break it with ``**fields``. `engine_for`
makes an `OpenAIEngine` for a server with test-speed retry and timeout settings.

POSTs are recorded (`requests`) so tests can count attempts and read what was sent; GETs in `gets`.
``GET /metrics`` serves `metrics_text` (404 when None), ``GET /health`` answers 200.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal


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


@dataclass
class Recorded:
    path: str
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


def engine_for(server: FakeOpenAIServer, **kwargs: Any):
    """An `OpenAIEngine` for ``server`` (back-off 10 ms, read timeout 5 s unless given)."""
    from agentrt.engine.openai_engine import OpenAIEngine

    kwargs.setdefault("backoff", 0.01)
    kwargs.setdefault("timeout", 5.0)
    return OpenAIEngine(server.url + "/v1", "fake-model", **kwargs)


class FakeOpenAIServer:
    """Start with ``with FakeOpenAIServer() as server:``; ``server.url`` is its base URL."""

    def __init__(self, model: str = "fake-model") -> None:
        self.model = model
        self.script: list[Action] = []
        self.requests: list[Recorded] = []
        """The POSTs received, in order."""
        self.gets: list[str] = []
        """Paths of the GETs received (/metrics, /health)."""
        self.metrics_text: str | None = None
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._httpd is not None, "server not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def push(self, *actions: Action) -> None:
        """Queue actions for the next requests, in order."""
        with self._lock:
            self.script.extend(actions)

    def next_action(self) -> Action:
        with self._lock:
            if self.script:
                return self.script.pop(0)
        return Status(500, "the fake server has no scripted reply left")

    def record_get(self, path: str) -> None:
        with self._lock:
            self.gets.append(path)

    def record(self, item: Recorded) -> None:
        with self._lock:
            self.requests.append(item)

    def start(self) -> FakeOpenAIServer:
        handler = type("Handler", (_Handler,), {"fake": self})
        self._httpd = _QuietServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _QuietServer(ThreadingHTTPServer):
    """Clients hanging up mid-stream is part of the tests: no tracebacks for that."""

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    fake: FakeOpenAIServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # keep test output clean
        return None

    def do_GET(self) -> None:
        self.fake.record_get(self.path)
        if self.path == "/health":
            self._send_json(200, {})
        elif self.path == "/metrics" and self.fake.metrics_text is not None:
            data = self.fake.metrics_text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self._send_json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError:
            body = {"_raw": raw.decode(errors="replace")}
        self.fake.record(Recorded(self.path, body, dict(self.headers.items())))
        if self.path not in ("/v1/chat/completions", "/v1/completions"):
            self._send_json(404, {"error": {"message": f"no route {self.path}"}})
            return
        action = self.fake.next_action()
        if isinstance(action, Status):
            extra = {}
            if action.retry_after is not None:
                extra["Retry-After"] = f"{action.retry_after:g}"
            error = {"message": action.message, "type": "BadRequestError", "code": action.code}
            self._send_json(action.code, {"error": error}, extra)
        elif isinstance(action, Stall):
            self.fake._stopping.wait(action.seconds)
            self._hang_up()
        elif isinstance(action, Hangup):
            self._hang_up()
        elif isinstance(action, Raw):
            self._raw(action)
        else:
            self._stream(action, chat=self.path.endswith("chat/completions"))

    # ------------------------------------------------------------------ responses

    def _stream(self, action: Stream, chat: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        base = {"id": "cmpl-fake", "created": int(time.time()), "model": self.fake.model}
        kind = "chat.completion.chunk" if chat else "text_completion"
        if chat:
            self._event({**base, "object": kind, "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            ]})
        for i, piece in enumerate(action.pieces):
            if action.drop_after is not None and i >= action.drop_after:
                self._hang_up()
                return
            if action.delay_s and i > 0:
                time.sleep(action.delay_s)
            choice = {"index": 0, "finish_reason": None}
            choice.update({"delta": {"content": piece}} if chat else {"text": piece})
            self._event({**base, "object": kind, "choices": [choice]})
        if action.drop_after is not None:
            self._hang_up()
            return
        if action.finish_reason is not None:
            choice = {"index": 0, "finish_reason": action.finish_reason}
            choice.update({"delta": {}} if chat else {"text": ""})
            self._event({**base, "object": kind, "choices": [choice]})
        if action.usage is not None:
            prompt, completion = action.usage
            completion = len(action.pieces) if completion < 0 else completion
            usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                     "total_tokens": prompt + completion}
            chunk = {**base, "object": kind, "choices": [], "usage": usage}
            if action.spec_summary is not None:
                chunk["metrics"] = {"speculative_decoding": action.spec_summary}
            self._event(chunk)
        if action.metrics_after is not None:
            self.fake.metrics_text = action.metrics_after
        if action.send_done:
            self._write_chunk(b"data: [DONE]\n\n")
        self._write_chunk(b"")

    def _raw(self, action: Raw) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        stopping = self.fake._stopping
        try:
            for i, item in enumerate(action.events):
                if i and action.delay_s and stopping.wait(action.delay_s):
                    return
                if action.byte_delay_s is None:
                    self._write_chunk(item.encode())
                    continue
                for byte in item.encode():
                    self._write_chunk(bytes([byte]))
                    if stopping.wait(action.byte_delay_s):
                        return
            if action.then in ("keep_alive", "repeat"):
                item = ": keep-alive\n\n" if action.then == "keep_alive" else action.events[-1]
                while not stopping.wait(action.delay_s or 0.05):
                    self._write_chunk(item.encode())
            elif action.then == "hang_up":
                self._hang_up()
            else:
                self._write_chunk(b"")
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client gave up: that is what these tests want

    def _event(self, payload: dict[str, Any]) -> None:
        self._write_chunk(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _send_json(
        self, code: int, payload: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _hang_up(self) -> None:
        self.close_connection = True
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
