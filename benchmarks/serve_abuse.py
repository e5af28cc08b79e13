"""What ``agentrt serve`` does under abuse, measured against the real server on loopback.

Starts the server (uvicorn with its guards, default `ServeLimits`) in a child process over a
`ReplayEngine` that echoes the last message at ``--tokens-per-second``, then runs each abuse
from this process with real clients (httpx and raw sockets) and prints what the server did:

- ``slowloris``: N connections that send a request line and then one header line every
  ``--trickle`` seconds, never finishing; when and how each is closed, and whether a normal
  client (one chat completion every 0.25 s, in a thread) is served meanwhile;
- ``body``: a body over the limit, announced by Content-Length (raw socket), sent chunked with
  no length (raw socket: how much the server read before refusing), and sent by httpx;
- ``deep``: JSON nested 100 000 and 1 000 000 levels deep; ``messages``: 5 000 messages;
- ``overload``: more concurrent streaming requests than ``max_requests``: how many 503s, with
  which ``Retry-After``;
- ``streams``: N concurrent streams: time to the first chunk and to the first token, p50 / p99.

Every loop is bounded by a count and a deadline; all traffic goes to 127.0.0.1.

    python -m benchmarks.serve_abuse [--slowloris 400] [--streams 60] [--only NAME ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

HOST = "127.0.0.1"
MODEL = "replay"


def echo(messages: Sequence[Any]) -> str:
    return f"You said: {messages[-1]['content']}"


def chat_body(content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank; nan when there are none."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


# -- the server under test ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_until_up(port: int, alive: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            httpx.get(f"http://{HOST}:{port}/health", timeout=2)
            return
        except httpx.TransportError:
            if not alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on port {port} did not start") from None
            time.sleep(0.1)


class ServerProcess:
    """``agentrt.serve.serve`` over an echoing `ReplayEngine`, in a child process on loopback."""

    def __init__(self, tokens_per_second: float, limits: dict[str, Any] | None = None) -> None:
        self.port = free_port()
        command = [sys.executable, "-m", "benchmarks.serve_abuse", "--serve", str(self.port),
                   "--tokens-per-second", str(tokens_per_second),
                   "--limits", json.dumps(limits or {})]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        try:
            wait_until_up(self.port, lambda: self.proc.poll() is None)
        except RuntimeError:
            self.close()
            raise

    def metrics(self) -> dict[str, Any]:
        return httpx.get(f"http://{HOST}:{self.port}/metrics", timeout=5).json()

    def close(self) -> str:
        self.proc.terminate()
        try:
            return self.proc.communicate(timeout=20)[1]
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.communicate()[1]


def _serve_here(port: int, tokens_per_second: float, limits: dict[str, Any]) -> None:
    from agentrt import ReplayEngine
    from agentrt.serve import serve
    from agentrt.serve_limits import ServeLimits

    serve(ReplayEngine(echo, tokens_per_second=tokens_per_second), model_name=MODEL, host=HOST,
          port=port, log_level="warning", limits=ServeLimits(**limits))


# -- raw HTTP --------------------------------------------------------------------------------------


@dataclass
class RawReply:
    """What came back on a raw socket: the status (None if nothing did), headers, body, and
    whether the server then closed the connection."""

    status: int | None
    headers: dict[str, str]
    body: bytes
    closed: bool
    seconds: float

    def error(self) -> str:
        try:
            return json.loads(self.body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return self.body[:120].decode("utf-8", "replace")


def read_reply(sock: socket.socket, started: float, timeout_s: float = 5.0) -> RawReply:
    """Read one HTTP response (Content-Length bodies only) and wait briefly for a close."""
    sock.settimeout(timeout_s)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            piece = sock.recv(65536)
            if not piece:
                return RawReply(None, {}, data, True, time.monotonic() - started)
            data += piece
    except (TimeoutError, ConnectionError):
        return RawReply(None, {}, data, False, time.monotonic() - started)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip()
               for k, _, v in (line.partition(":") for line in lines[1:])}
    want = int(headers.get("content-length", "0"))
    seconds = 0.0
    closed = False
    try:
        while len(body) < want:
            piece = sock.recv(65536)
            if not piece:
                closed = True
                break
            body += piece
        seconds = time.monotonic() - started
        if not closed:
            sock.settimeout(1.0)
            closed = sock.recv(1) == b""
    except TimeoutError:
        pass
    except ConnectionError:
        closed = True
    return RawReply(status, headers, body, closed, seconds or time.monotonic() - started)


def post_head(path: str, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\ncontent-type: application/json\r\n"
            f"{extra}\r\n").encode()


# -- the abuses ------------------------------------------------------------------------------------


@dataclass
class SlowlorisResult:
    connections: int
    opened_s: float
    close_times: list[float] = field(default_factory=list)
    """Seconds from each connection's start to the server closing it."""
    answered: dict[int, int] = field(default_factory=dict)
    """Status -> count of the connections that got a response before the close."""
    still_open: int = 0
    probe_latencies: list[float] = field(default_factory=list)
    probe_failures: list[str] = field(default_factory=list)

    def summary(self) -> str:
        answered = ", ".join(f"{n} got {s}" for s, n in sorted(self.answered.items())) or "none"
        probes = self.probe_latencies
        return (
            f"slowloris: {self.connections} connections opened in {self.opened_s:.2f} s; "
            f"{len(self.close_times)} closed by the server (time to close p50 "
            f"{percentile(self.close_times, 0.5):.2f} s, max {max(self.close_times, default=0):.2f} s;"
            f" answered before closing: {answered}), {self.still_open} still open at the end; "
            f"normal client meanwhile: {len(probes)} of {len(probes) + len(self.probe_failures)} "
            f"chat completions served, latency p50 {percentile(probes, 0.5) * 1000:.0f} ms, "
            f"max {max(probes, default=0) * 1000:.0f} ms"
            + (f", failures: {self.probe_failures[:3]}" if self.probe_failures else ""))


def slowloris(port: int, connections: int, *, trickle_s: float = 0.5, duration_s: float = 12.0,
              probe_every_s: float = 0.25) -> SlowlorisResult:
    """Open ``connections`` connections that trickle headers and never finish them; watch, for at
    most ``duration_s``, when the server closes each, while a thread makes normal requests."""
    sockets: dict[socket.socket, float] = {}
    started = time.monotonic()
    for _ in range(connections):
        sock = socket.create_connection((HOST, port), timeout=5)
        sock.sendall(post_head("/v1/chat/completions").removesuffix(b"\r\n"))  # headers open
        sock.setblocking(False)
        sockets[sock] = time.monotonic()
    result = SlowlorisResult(connections, time.monotonic() - started)
    stop = threading.Event()
    prober = threading.Thread(target=_probe, args=(port, probe_every_s, stop, result))
    prober.start()
    replies: dict[socket.socket, bytes] = {}
    selector = selectors.DefaultSelector()
    for sock in sockets:
        selector.register(sock, selectors.EVENT_READ)
    deadline = started + duration_s
    next_trickle = time.monotonic() + trickle_s
    try:
        while sockets and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.05):
                sock = key.fileobj  # type: ignore[assignment]
                try:
                    piece = sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    piece = b""
                if piece:
                    replies[sock] = replies.get(sock, b"") + piece
                    continue
                result.close_times.append(time.monotonic() - sockets.pop(sock))
                head = replies.pop(sock, b"")
                if head.startswith(b"HTTP/1.1 "):
                    status = int(head.split()[1])
                    result.answered[status] = result.answered.get(status, 0) + 1
                selector.unregister(sock)
                sock.close()
            if time.monotonic() >= next_trickle:
                next_trickle += trickle_s
                for sock in sockets:
                    try:
                        sock.send(b"x-trickle: 1\r\n")
                    except OSError:
                        pass  # closed by the server: the selector reports it
    finally:
        stop.set()
        prober.join()
        result.still_open = len(sockets)
        for sock in sockets:
            sock.close()
        selector.close()
    return result


def _probe(port: int, every_s: float, stop: threading.Event, result: SlowlorisResult) -> None:
    while not stop.is_set():
        began = time.monotonic()
        try:
            reply = httpx.post(f"http://{HOST}:{port}/v1/chat/completions", json=chat_body(),
                               timeout=5)
            if reply.status_code == 200:
                result.probe_latencies.append(time.monotonic() - began)
            else:
                result.probe_failures.append(f"HTTP {reply.status_code}")
        except httpx.HTTPError as exc:
            result.probe_failures.append(type(exc).__name__)
        stop.wait(max(0.0, every_s - (time.monotonic() - began)))


@dataclass
class BodyResult:
    declared: RawReply
    chunked: RawReply
    chunked_sent: int
    """Bytes of the chunked body this client had sent when the refusal came."""
    httpx_status: int | str
    limit: int

    def summary(self) -> str:
        return (
            f"body over {self.limit} bytes: Content-Length 64 MiB -> {self.declared.status} in "
            f"{self.declared.seconds * 1000:.0f} ms, closed {self.declared.closed}; chunked, no "
            f"length -> {self.chunked.status} after {self.chunked_sent / 2**20:.2f} MiB sent, "
            f"in {self.chunked.seconds * 1000:.0f} ms, closed {self.chunked.closed}; httpx "
            f"{(self.limit + 2**20) / 2**20:.0f} MiB body -> {self.httpx_status}")


def oversized_body(port: int, limit: int) -> BodyResult:
    """A body over ``limit``: announced, then chunked with no length, then from httpx."""
    with socket.create_connection((HOST, port), timeout=5) as sock:
        began = time.monotonic()
        sock.sendall(post_head("/v1/chat/completions", f"content-length: {64 * 2**20}\r\n"))
        sock.sendall(b"{" + b" " * 65535)
        declared = read_reply(sock, began)
    with socket.create_connection((HOST, port), timeout=5) as sock:
        began = time.monotonic()
        sock.sendall(post_head("/v1/chat/completions", "transfer-encoding: chunked\r\n"))
        sent, piece = 0, b" " * 65536
        while sent < limit + 16 * 2**20 and time.monotonic() - began < 10:
            if select.select([sock], [], [], 0)[0]:
                break  # the answer came
            try:
                sock.sendall(b"10000\r\n" + piece + b"\r\n")  # one 64 KiB chunk
            except OSError:
                break  # closed by the server
            sent += len(piece)
        chunked = read_reply(sock, began)
    try:
        status: int | str = httpx.post(
            f"http://{HOST}:{port}/v1/chat/completions", content=b" " * (limit + 2**20),
            headers={"content-type": "application/json"}, timeout=10).status_code
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    return BodyResult(declared, chunked, sent, status, limit)


@dataclass
class ParseResult:
    what: str
    status: int
    seconds: float
    message: str

    def summary(self) -> str:
        return (f"{self.what}: {self.status} in {self.seconds * 1000:.0f} ms "
                f"({self.message[:90]})")


def deep_json(port: int, depth: int) -> ParseResult:
    """A valid chat request with one extra field nested ``depth`` levels deep."""
    raw = (json.dumps(chat_body())[:-1] + ', "pad": ' + "[" * depth + "]" * depth + "}").encode()
    return _post_raw(port, raw, f"JSON nested {depth} deep ({len(raw) / 2**20:.1f} MiB)")


def many_messages(port: int, count: int) -> ParseResult:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}] * count}
    return _post_raw(port, json.dumps(body).encode(), f"{count} messages")


def _post_raw(port: int, raw: bytes, what: str) -> ParseResult:
    began = time.monotonic()
    reply = httpx.post(f"http://{HOST}:{port}/v1/chat/completions", content=raw,
                       headers={"content-type": "application/json"}, timeout=30)
    seconds = time.monotonic() - began
    try:
        message = reply.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = reply.text[:100]
    return ParseResult(what, reply.status_code, seconds, message)


@dataclass
class StreamStats:
    """Concurrent streaming requests: per request its status, ``Retry-After`` (on a 503), time
    to the first SSE chunk, time to the first content token, and whether it reached [DONE]."""

    statuses: list[int] = field(default_factory=list)
    retry_after: list[str] = field(default_factory=list)
    first_chunk: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)
    done: int = 0
    errors: list[str] = field(default_factory=list)

    def count(self, status: int) -> int:
        return self.statuses.count(status)

    def summary(self, what: str) -> str:
        ms = lambda values, q: percentile(values, q) * 1000  # noqa: E731
        refused = (f", {self.count(503)} x 503 (Retry-After {sorted(set(self.retry_after))})"
                   if self.count(503) else "")
        return (f"{what}: {self.count(200)} x 200{refused}, {self.done} reached [DONE]; first "
                f"chunk p50 {ms(self.first_chunk, 0.5):.0f} ms, p99 {ms(self.first_chunk, 0.99):.0f}"
                f" ms; first token p50 {ms(self.first_token, 0.5):.0f} ms, p99 "
                f"{ms(self.first_token, 0.99):.0f} ms"
                + (f"; errors {self.errors[:3]}" if self.errors else ""))


def concurrent_streams(port: int, count: int, content: str = "hi", *,
                       read_to_end: bool = True, timeout_s: float = 60.0) -> StreamStats:
    """``count`` streaming requests at once (one httpx connection each)."""
    return asyncio.run(_streams(port, count, content, read_to_end, timeout_s))


async def _streams(port: int, count: int, content: str, read_to_end: bool,
                   timeout_s: float) -> StreamStats:
    stats = StreamStats()
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:
        gate = asyncio.Event()

        async def one() -> None:
            await gate.wait()
            began = time.monotonic()
            try:
                async with client.stream("POST", f"http://{HOST}:{port}/v1/chat/completions",
                                         json=chat_body(content, stream=True)) as reply:
                    stats.statuses.append(reply.status_code)
                    if reply.status_code != 200:
                        stats.retry_after.append(reply.headers.get("retry-after", "-"))
                        await reply.aread()
                        return
                    first_chunk = first_token = False
                    async for line in reply.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        now = time.monotonic() - began
                        if not first_chunk:
                            first_chunk = True
                            stats.first_chunk.append(now)
                            if not read_to_end:
                                return
                        elif not first_token and '"content"' in line:
                            first_token = True
                            stats.first_token.append(now)
                        if line == "data: [DONE]":
                            stats.done += 1
            except httpx.HTTPError as exc:
                stats.errors.append(type(exc).__name__)

        tasks = [asyncio.create_task(one()) for _ in range(count)]
        await asyncio.sleep(0.05)  # every task is waiting at the gate
        gate.set()
        await asyncio.gather(*tasks)
    return stats


# -- the run ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slowloris", type=int, default=400, help="slowloris connections")
    parser.add_argument("--trickle", type=float, default=0.5,
                        help="seconds between a slowloris connection's header lines")
    parser.add_argument("--streams", type=int, default=60, help="concurrent streams")
    parser.add_argument("--tokens-per-second", type=float, default=50.0,
                        help="the replay engine's rate")
    parser.add_argument("--only", nargs="+",
                        choices=("slowloris", "body", "deep", "messages", "overload", "streams"))
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--limits", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        _serve_here(args.serve, args.tokens_per_second, json.loads(args.limits))
        return 0

    from agentrt.serve_limits import ServeLimits

    limits = ServeLimits()
    only = set(args.only or ("slowloris", "body", "deep", "messages", "overload", "streams"))
    print(f"agentrt serve, default limits ({limits}); replay engine at "
          f"{args.tokens_per_second:g} tokens/s; {os.cpu_count()} CPUs; client and server on "
          "this machine")
    server = ServerProcess(args.tokens_per_second)
    try:
        if "slowloris" in only:
            print(slowloris(server.port, args.slowloris, trickle_s=args.trickle,
                            duration_s=limits.header_timeout_s + 6).summary(), flush=True)
        if "body" in only:
            print(oversized_body(server.port, limits.max_body_bytes).summary(), flush=True)
        if "deep" in only:
            for depth in (100_000, 1_000_000):
                print(deep_json(server.port, depth).summary(), flush=True)
        if "messages" in only:
            print(many_messages(server.port, 5000).summary(), flush=True)
        if "overload" in only:
            n = limits.max_requests + 32
            # long replies (about 100 tokens each) keep every accepted request in progress
            stats = concurrent_streams(server.port, n, "word " * 100)
            print(stats.summary(f"overload: {n} streams at once, max_requests "
                                f"{limits.max_requests}"), flush=True)
        if "streams" in only:
            stats = concurrent_streams(server.port, args.streams, "hello there, how are you?")
            print(stats.summary(f"{args.streams} concurrent streams"), flush=True)
        print(f"server metrics: {json.dumps(server.metrics()['connections'])} "
              f"{json.dumps(server.metrics()['requests'])}")
    finally:
        errors = server.close()
    if "Traceback" in errors:
        print(f"the server logged an exception:\n{errors[-3000:]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
