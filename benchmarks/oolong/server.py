"""A simulated sub-model: an OpenAI-compatible HTTP server on loopback that answers from `rows`.

It serves ``GET /v1/models``, ``GET /health`` and ``POST /v1/chat/completions`` (streaming and
not). The reply to a prompt is computed from the tasks' ground truth:

- a prompt holding context rows (``... Instance: <question>``) and asking *how many* of them fall
  in one named category gets that count;
- any other prompt holding rows gets one category per row, one per line, in the rows' order;
- a prompt without rows gets a short fixed reply.

With ``error_rate`` > 0 some rows get a wrong category; which rows is fixed by ``seed`` and the
row itself, so the same prompt always gets the same reply (runs stay comparable).

Latency follows a batched serving engine (`LatencyModel`): requests take one of
``max_concurrency`` slots (others wait in a FIFO queue); prefills run one at a time, so the time
to first token grows with the prompt's tokens and with the prefills queued before it; decoding
streams share the accelerator, so each stream's speed falls as more streams decode at once.
Defaults come from published serving measurements of a 30B-class MoE on one H100
(see ``docs/oolong.md``).

    python -m benchmarks.oolong.server --tasks tasks.jsonl [--port 8001] [--error-rate 0.05]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .tasks import Row, Task, load_tasks
from .words import LABELS

MODEL_NAME = "simulated-30b-moe"
_ROW = re.compile(r"^(?:Date: (?P<date>[^|]*?) \|\| User: (?P<user>[^|]*?) \|\| )?"
                  r"Instance: (?P<instance>.*?)\s*$", re.M)


@dataclass
class LatencyModel:
    """Timing of the simulated deployment (seconds, tokens at 4 characters each)."""

    prefill_tokens_per_s: float = 12_000.0
    """Prompt tokens processed per second by one prefill."""
    ttft_overhead_s: float = 0.03
    """Scheduling and first-step cost added to every request's first token."""
    decode_tokens_per_s: float = 172.5
    """One stream's decode speed when it decodes alone."""
    slowdown_per_stream: float = 0.0464
    """Per-stream speed is ``decode_tokens_per_s / (1 + slowdown_per_stream * (n - 1))`` with
    ``n`` streams decoding at once (41% scaling efficiency at 32 streams)."""
    max_concurrency: int = 32
    """Requests in service at once; more wait in a queue."""
    chars_per_token: float = 4.0

    def tokens(self, text: str) -> int:
        return max(1, round(len(text) / self.chars_per_token))

    def stream_speed(self, streams: int) -> float:
        return self.decode_tokens_per_s / (1.0 + self.slowdown_per_stream * max(0, streams - 1))


class _FifoSlots:
    """``n`` slots handed out in arrival order."""

    def __init__(self, n: int) -> None:
        self._free = n
        self._lock = threading.Lock()
        self._waiting: deque[threading.Event] = deque()

    def acquire(self) -> None:
        with self._lock:
            if self._free > 0 and not self._waiting:
                self._free -= 1
                return
            ticket = threading.Event()
            self._waiting.append(ticket)
        ticket.wait()

    def release(self) -> None:
        with self._lock:
            if self._waiting:
                self._waiting.popleft().set()
            else:
                self._free += 1


@dataclass
class Oracle:
    """Answers the agent's prompts from the rows' labels."""

    labels: dict[str, str] = field(default_factory=dict)
    error_rate: float = 0.0
    seed: int = 0

    @classmethod
    def from_tasks(cls, tasks: Iterable[Task], error_rate: float = 0.0, seed: int = 0) -> Oracle:
        labels: dict[str, str] = {}
        for t in tasks:
            for _date, _user, instance, label in t.rows:
                labels[instance.strip()] = label
        return cls(labels, error_rate, seed)

    def label(self, date: str, user: str, instance: str) -> str:
        truth = self.labels.get(instance.strip(), "unknown")
        if self.error_rate <= 0 or truth == "unknown":
            return truth
        digest = hashlib.sha256(f"{self.seed}|{date}|{user}|{instance.strip()}".encode()).digest()
        if int.from_bytes(digest[:4], "big") / 2**32 >= self.error_rate:
            return truth
        others = [lab for lab in LABELS if lab != truth]
        return others[digest[4] % len(others)]

    def reply(self, prompt: str) -> str:
        rows = [(m["date"] or "", m["user"] or "", m["instance"]) for m in _ROW.finditer(prompt)]
        if not rows:
            return "There are no questions in this message to classify."
        labels = [self.label(*r) for r in rows]
        instruction = _ROW.sub("", prompt).lower()
        named = [lab for lab in LABELS if lab in instruction]
        if "how many" in instruction and len(named) == 1:
            return str(sum(lab == named[0] for lab in labels))
        return "\n".join(labels)


class SimulatedSubModel:
    """The server object: ``with SimulatedSubModel(oracle) as s: s.url`` (``http://127.0.0.1:port``)."""

    def __init__(self, oracle: Oracle, latency: LatencyModel | None = None,
                 host: str = "127.0.0.1", port: int = 0) -> None:
        self.oracle = oracle
        self.latency = latency or LatencyModel()
        self._slots = _FifoSlots(self.latency.max_concurrency)
        self._prefill = threading.Lock()
        self._count_lock = threading.Lock()
        self.decoding = 0
        """Streams decoding right now."""
        self.requests = 0
        self.peak_decoding = 0
        handler = type("Handler", (_Handler,), {"server_model": self})
        self._httpd = _Server((host, port), handler)
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> SimulatedSubModel:
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> SimulatedSubModel:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- serving one request -------------------------------------------------------------------

    def serve(self, prompt: str, max_tokens: int | None, emit) -> tuple[int, int, str]:
        """Wait for a slot and the prefill, then call ``emit(piece)`` at the decode pace.

        Returns (prompt_tokens, completion_tokens, finish_reason).
        """
        lat = self.latency
        text = self.oracle.reply(prompt)
        pieces = [text[i:i + int(lat.chars_per_token)]
                  for i in range(0, len(text), int(lat.chars_per_token))]
        finish = "stop"
        if max_tokens is not None and len(pieces) > max_tokens:
            pieces, finish = pieces[:max_tokens], "length"
        prompt_tokens = lat.tokens(prompt)
        with self._count_lock:
            self.requests += 1
        self._slots.acquire()
        try:
            with self._prefill:
                time.sleep(lat.ttft_overhead_s + prompt_tokens / lat.prefill_tokens_per_s)
            with self._count_lock:
                self.decoding += 1
                self.peak_decoding = max(self.peak_decoding, self.decoding)
            try:
                due = time.monotonic()
                for i, piece in enumerate(pieces):
                    if i:
                        with self._count_lock:
                            streams = self.decoding
                        due += 1.0 / lat.stream_speed(streams)
                        delay = due - time.monotonic()
                        if delay > 0:
                            time.sleep(delay)
                    emit(piece)
            finally:
                with self._count_lock:
                    self.decoding -= 1
        finally:
            self._slots.release()
        return prompt_tokens, len(pieces), finish


class _Server(ThreadingHTTPServer):
    request_queue_size = 256

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


def _prompt_of(messages: Sequence[dict]) -> str:
    parts = []
    for m in messages:
        content = m.get("content", "")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(str(content))
    return "\n".join(parts)


class _Handler(BaseHTTPRequestHandler):
    server_model: SimulatedSubModel
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        return None

    def do_GET(self) -> None:
        if self.path in ("/v1/models", "/models"):
            self._json(200, {"object": "list", "data": [
                {"id": MODEL_NAME, "object": "model", "owned_by": "agentrt-simulation"}]})
        elif self.path == "/health":
            self._json(200, {})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path not in ("/v1/chat/completions", "/chat/completions"):
            self._json(404, {"error": {"message": f"no route {self.path}"}})
            return
        try:
            body = json.loads(raw or b"{}")
            messages = body["messages"]
            if not isinstance(messages, list):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError):
            self._json(400, {"error": {"message": "the body needs a 'messages' list",
                                       "type": "BadRequestError", "code": 400}})
            return
        prompt = _prompt_of(messages)
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        base = {"id": f"cmpl-sim-{id(self)}", "created": int(time.time()), "model": MODEL_NAME}
        if body.get("stream"):
            self._stream(base, prompt, max_tokens)
        else:
            parts: list[str] = []
            p, c, finish = self.server_model.serve(prompt, max_tokens, parts.append)
            self._json(200, {**base, "object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "".join(parts)},
                 "finish_reason": finish}],
                "usage": {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}})

    def _stream(self, base: dict, prompt: str, max_tokens: int | None) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        kind = "chat.completion.chunk"

        def emit(piece: str) -> None:
            self._event({**base, "object": kind, "choices": [
                {"index": 0, "delta": {"content": piece}, "finish_reason": None}]})

        self._event({**base, "object": kind, "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        p, c, finish = self.server_model.serve(prompt, max_tokens, emit)
        self._event({**base, "object": kind, "choices": [
            {"index": 0, "delta": {}, "finish_reason": finish}]})
        self._event({**base, "object": kind, "choices": [], "usage": {
            "prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}})
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _event(self, payload: dict) -> None:
        self._chunk(b"data: " + json.dumps(payload).encode() + b"\n\n")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _json(self, code: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def add_latency_arguments(p: argparse.ArgumentParser) -> None:
    d = LatencyModel()
    p.add_argument("--sub-prefill-tps", type=float, default=d.prefill_tokens_per_s)
    p.add_argument("--sub-decode-tps", type=float, default=d.decode_tokens_per_s)
    p.add_argument("--sub-slowdown", type=float, default=d.slowdown_per_stream,
                   help="per-stream decode slowdown per extra concurrent stream")
    p.add_argument("--sub-max-concurrency", type=int, default=d.max_concurrency)


def latency_from_args(args: argparse.Namespace) -> LatencyModel:
    if args.sub_max_concurrency < 1:
        raise ValueError("--sub-max-concurrency must be >= 1")
    if args.sub_prefill_tps <= 0 or args.sub_decode_tps <= 0 or args.sub_slowdown < 0:
        raise ValueError("sub-model speeds must be > 0 and the slowdown >= 0")
    return LatencyModel(prefill_tokens_per_s=args.sub_prefill_tps,
                        decode_tokens_per_s=args.sub_decode_tps,
                        slowdown_per_stream=args.sub_slowdown,
                        max_concurrency=args.sub_max_concurrency)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.oolong.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", required=True, help="JSONL task file whose rows hold the labels")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8001, help="0 picks a free port")
    p.add_argument("--error-rate", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    add_latency_arguments(p)
    args = p.parse_args(argv)
    try:
        if not 0.0 <= args.error_rate <= 1.0:
            raise ValueError("--error-rate must be within [0, 1]")
        oracle = Oracle.from_tasks(load_tasks(args.tasks), args.error_rate, args.seed)
        latency = latency_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    server = SimulatedSubModel(oracle, latency, args.host, args.port)
    print(f"listening on {server.url}", flush=True)
    try:
        server._httpd.serve_forever(poll_interval=0.1)
    except KeyboardInterrupt:
        pass
    finally:
        server._httpd.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
