"""`agentrt serve` under abuse: the real server (uvicorn with its guards, `uvicorn_config`) on a
loopback port, attacked with raw sockets and httpx. Each test is bounded in connections and
time; the figures for the full-size attacks come from ``python -m benchmarks.serve_abuse``."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest

pytest.importorskip("starlette", reason="agentrt serve needs starlette (pip install 'agentrt[serve]')")
pytest.importorskip("uvicorn", reason="agentrt serve needs uvicorn (pip install 'agentrt[serve]')")
openai = pytest.importorskip("openai", reason="the tests drive the server with the openai client")

import httpx  # noqa: E402
import uvicorn  # noqa: E402

from agentrt import ReplayEngine  # noqa: E402
from agentrt.serve import ChatServer, uvicorn_config  # noqa: E402
from agentrt.serve_auth import exposure_warning, is_loopback  # noqa: E402
from agentrt.serve_limits import ServeLimits, json_depth  # noqa: E402
from benchmarks.serve_abuse import (  # noqa: E402
    concurrent_streams, oversized_body, post_head, read_reply, slowloris)

MODEL = "replay"  # the name benchmarks.serve_abuse's clients ask for


def echo(messages) -> str:
    return f"You said: {messages[-1]['content']}"


class RecordingEngine(ReplayEngine):
    """A replay engine with a context (``max_seq_len``) that remembers each request's params."""

    def __init__(self, *args, max_seq_len: int = 64, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.max_seq_len = max_seq_len
        self.params: list = []

    def stream(self, messages, params=None):
        self.params.append(params)
        return super().stream(messages, params)


class GuardedServer:
    """A `ChatServer` under uvicorn as `serve` runs it (guarded protocol), in a thread."""

    def __init__(self, engine, limits: ServeLimits, api_key: str | None = None) -> None:
        self.chat = ChatServer(engine, MODEL, limits=limits, api_key=api_key)
        self.server = uvicorn.Server(uvicorn_config(self.chat, host="127.0.0.1", port=0,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def post(self, body, **kw) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(f"{self.url}/v1/chat/completions", content=content,
                          headers={"content-type": "application/json", **kw.pop("headers", {})},
                          timeout=10, **kw)

    def wait_for(self, predicate, what: str, timeout: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            metrics = httpx.get(f"{self.url}/metrics", timeout=5).json()
            if predicate(metrics):
                return metrics
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}: {metrics}")
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


LIMITS = ServeLimits(max_body_bytes=64 * 1024, max_messages=8, max_json_depth=16,
                     max_requests=8, max_connections=48, header_timeout_s=1.0,
                     body_timeout_s=1.0, write_timeout_s=1.0)


@pytest.fixture(scope="module")
def guarded():
    engine = RecordingEngine(echo, tokens_per_second=5000, max_seq_len=64)
    server = GuardedServer(engine, LIMITS)
    yield server
    server.close()


def chat(content: str = "hi", **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def error_of(reply: httpx.Response) -> dict:
    error = reply.json()["error"]
    assert set(error) >= {"message", "type", "param"}, error
    return error


# -- body size, nesting, message count, max_tokens ----------------------------------------------


def test_a_body_over_the_limit_is_413_before_it_is_read(guarded):
    result = oversized_body(guarded.port, LIMITS.max_body_bytes)
    assert result.declared.status == 413 and result.declared.closed
    assert result.declared.seconds < 1.0  # refused from the Content-Length, not after 64 MiB
    assert "at most 65536 bytes" in result.declared.error()
    assert json.loads(result.declared.body)["error"]["type"] == "invalid_request_error"
    assert result.chunked.status == 413 and result.chunked.closed  # no length: cut while reading
    assert result.httpx_status == 413
    # just under the limit (whitespace padding) is served
    padded = json.dumps(chat()).encode()
    padded = padded[:-1] + b" " * (LIMITS.max_body_bytes - len(padded)) + b"}"
    assert len(padded) == LIMITS.max_body_bytes
    assert guarded.post(padded).status_code == 200


def test_a_body_that_trickles_is_408(guarded):
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=5) as sock:
        began = time.monotonic()
        sock.sendall(post_head("/v1/chat/completions", "content-length: 100\r\n") + b'{"mo')
        reply = read_reply(sock, began, timeout_s=5)
    assert reply.status == 408 and reply.closed, reply
    assert LIMITS.body_timeout_s <= reply.seconds < LIMITS.body_timeout_s + 2
    assert "did not arrive within 1 s" in reply.error()


@pytest.mark.parametrize("depth", [LIMITS.max_json_depth - 1, LIMITS.max_json_depth + 1, 30_000])
def test_deep_json_is_a_400_never_a_500(guarded, depth):
    raw = json.dumps(chat())[:-1] + ', "pad": ' + "[" * depth + "]" * depth + "}"
    reply = guarded.post(raw.encode())
    if depth + 1 <= LIMITS.max_json_depth:  # the body object itself is one level
        assert reply.status_code == 200
        return
    assert reply.status_code == 400
    assert "nests JSON more than 16 levels deep" in error_of(reply)["message"]


def test_brackets_inside_strings_do_not_count_as_nesting(guarded):
    reply = guarded.post(chat('[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["{{{{{{{{{{{{{{{{{{{{{{{{{{'))
    assert reply.status_code == 200
    assert json_depth(b'{"a": "[[[\\"[[", "b": [[{}]]}') == 4


def test_too_many_messages_is_a_400(guarded):
    many = {"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 9}
    reply = guarded.post(many)
    assert reply.status_code == 400
    error = error_of(reply)
    assert error["param"] == "messages" and "9 messages; this server accepts at most 8" in error["message"]
    many["messages"] = many["messages"][:8]
    assert guarded.post(many).status_code == 200


def test_max_tokens_is_capped_by_the_context(guarded):
    engine = guarded.chat.engine
    for asked, given in ((10**12, 64), (None, 64), (5, 5)):
        extra = {} if asked is None else {"max_tokens": asked}
        reply = guarded.post(chat("one two three", **extra))
        assert reply.status_code == 200, reply.text
        assert engine.params[-1].max_tokens == given


def test_too_many_stop_strings_is_a_400(guarded):
    reply = guarded.post(chat(stop=[str(i) for i in range(17)]))
    assert reply.status_code == 400 and error_of(reply)["param"].startswith("stop")


# -- connections -------------------------------------------------------------------------------


def test_slowloris_connections_are_closed_and_normal_clients_are_served(guarded):
    before = guarded.chat.connections.header_timeouts, guarded.chat.connections.evicted
    result = slowloris(guarded.port, 120, trickle_s=0.2, duration_s=LIMITS.header_timeout_s + 3,
                       probe_every_s=0.2)
    assert result.still_open == 0, result.summary()
    assert len(result.close_times) == 120
    assert max(result.close_times) < LIMITS.header_timeout_s + 1.5, result.summary()
    assert not result.probe_failures and len(result.probe_latencies) >= 5, result.summary()
    assert max(result.probe_latencies) < 1.0, result.summary()
    counts = guarded.chat.connections
    assert counts.evicted > before[1]  # 120 > max_connections: the oldest waiting made room
    assert counts.header_timeouts > before[0]


def test_a_connection_that_sends_nothing_is_closed(guarded):
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=5) as sock:
        began = time.monotonic()
        assert sock.recv(1) == b""
    assert LIMITS.header_timeout_s - 0.1 < time.monotonic() - began < LIMITS.header_timeout_s + 1.5


def test_a_keep_alive_connection_gets_a_new_header_deadline(guarded):
    """After one reply, a second request that trickles its headers is cut like a first one."""
    with socket.create_connection(("127.0.0.1", guarded.port), timeout=5) as sock:
        body = json.dumps(chat()).encode()
        sock.sendall(post_head("/v1/chat/completions", f"content-length: {len(body)}\r\n") + body)
        assert read_reply(sock, time.monotonic(), timeout_s=5).status == 200
        began = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        sock.settimeout(0.2)
        closed = False
        while not closed and time.monotonic() - began < LIMITS.header_timeout_s + 2:
            try:
                sock.sendall(b"x-trickle: 1\r\n")
                closed = sock.recv(1) == b""
            except TimeoutError:
                continue
            except OSError:
                closed = True
    assert closed and time.monotonic() - began < LIMITS.header_timeout_s + 1.5


def test_a_client_that_does_not_read_its_reply_is_cut_off():
    engine = ReplayEngine(lambda messages: "ab " * 200_000, tokens_per_second=1e7)
    server = GuardedServer(engine, LIMITS)
    try:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        body = json.dumps(chat(stream=True, max_tokens=200_000)).encode()  # about 30 MB of events
        sock.sendall(post_head("/v1/chat/completions", f"content-length: {len(body)}\r\n") + body)
        metrics = server.wait_for(lambda m: m["connections"]["write_timeouts"] == 1
                                  and m["requests"]["cancelled"] == 1
                                  and m["requests"]["in_progress"] == 0,
                                  "the unread stream to be cut", timeout=20)
        assert metrics["requests"]["finished"] == 0
        sock.close()
    finally:
        server.close()


# -- overload and streams ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def slow():
    """An engine whose first token takes 1.5 s (a long prefill), at the default request bound."""
    engine = ReplayEngine(echo, tokens_per_second=2000, first_token_s=1.5)
    server = GuardedServer(engine, ServeLimits(header_timeout_s=2.0))
    yield server
    server.close()


def test_60_concurrent_streams_each_get_a_first_chunk_at_once(slow):
    stats = concurrent_streams(slow.port, 60, read_to_end=False, timeout_s=10)
    assert stats.statuses == [200] * 60 and not stats.errors
    assert len(stats.first_chunk) == 60
    assert max(stats.first_chunk) < 1.0  # before the engine's first token (1.5 s)
    slow.wait_for(lambda m: m["requests"]["in_progress"] == 0 and m["requests"]["running"] == 0,
                  "the closed streams to give their slots back")


def test_overload_is_a_503_with_retry_after(slow):
    limit = slow.chat.limits.max_requests
    before = slow.chat.counts.overloaded
    stats = concurrent_streams(slow.port, limit + 8, timeout_s=10)
    assert stats.count(200) == limit and stats.count(503) == 8, stats.summary("overload")
    assert stats.retry_after == ["1"] * 8
    assert stats.done == limit  # every accepted request was served to the end
    assert slow.chat.counts.overloaded == before + 8
    slow.wait_for(lambda m: m["requests"]["in_progress"] == 0, "the slots to be free")
    socks = []  # hold every slot with a body that never ends, then ask once more
    try:
        for _ in range(limit):
            sock = socket.create_connection(("127.0.0.1", slow.port), timeout=5)
            sock.sendall(post_head("/v1/chat/completions", "content-length: 10\r\n") + b"{")
            socks.append(sock)
        slow.wait_for(lambda m: m["requests"]["in_progress"] == limit, "the slots to fill")
        refused = httpx.post(f"{slow.url}/v1/chat/completions", json=chat(), timeout=5)
    finally:
        for sock in socks:
            sock.close()
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    error = error_of(refused)
    assert error["type"] == "server_error" and "retry in 1 s" in error["message"]


# -- who may use the server --------------------------------------------------------------------


def test_api_key_is_required_except_for_health():
    server = GuardedServer(ReplayEngine(echo, tokens_per_second=5000), LIMITS,
                           api_key="s3cret-key")
    try:
        assert httpx.get(f"{server.url}/health").status_code == 200
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret-key"},
                        {"authorization": "Basic s3cret-key"}):
            reply = server.post(chat(), headers=headers)
            assert reply.status_code == 401, headers
            assert error_of(reply)["code"] == "invalid_api_key"
            assert reply.headers["www-authenticate"] == "Bearer"
        assert httpx.get(f"{server.url}/metrics").status_code == 401
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret-key", max_retries=0)
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                       "content": "ok"}])
        assert reply.choices[0].message.content == "You said: ok"
        with pytest.raises(openai.AuthenticationError, match="API key"):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0
                          ).models.list()
        metrics = httpx.get(f"{server.url}/metrics",
                            headers={"authorization": "Bearer s3cret-key"}).json()
        assert metrics["requests"]["unauthorized"] == 7
    finally:
        server.close()


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("::1", True), ("localhost", True), ("127.0.0.2", True),
    ("0.0.0.0", False), ("::", False), ("192.168.1.7", False), ("example.com", False)])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_a_loud_warning_for_a_public_bind_without_a_key(capsys, caplog):
    with caplog.at_level(logging.WARNING, logger="agentrt.serve"):
        message = exposure_warning("0.0.0.0", None)
    assert message and "without an API key" in message and "--api-key" in message
    assert message in capsys.readouterr().err
    assert message in caplog.text
    assert exposure_warning("0.0.0.0", "key") is None
    assert exposure_warning("127.0.0.1", None) is None
    assert capsys.readouterr().err == ""


def test_serve_warns_before_it_listens(monkeypatch, capsys):
    from agentrt import serve as serve_module

    ran = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self: ran.append(self.config))
    serve_module.serve(ReplayEngine(echo), model_name=MODEL, host="0.0.0.0", port=1)
    assert "not a loopback address" in capsys.readouterr().err
    assert ran and ran[0].host == "0.0.0.0"  # it did not bind: run() was replaced
    serve_module.serve(ReplayEngine(echo), model_name=MODEL, host="0.0.0.0", port=1,
                       api_key="k")
    assert capsys.readouterr().err == ""


def test_cli_passes_the_key_and_limits(monkeypatch):
    import agentrt.engine
    from agentrt import cli, serve as serve_module

    calls = []
    monkeypatch.setattr(agentrt.engine, "NativeEngine", lambda **kw: object())
    monkeypatch.setattr(serve_module, "serve", lambda engine, **kw: calls.append(kw))
    monkeypatch.setenv("AGENTRT_API_KEY", "from-env")
    assert cli.main(["serve", "--max-requests", "3", "--header-timeout", "2.5",
                     "--max-body-bytes", "1000"]) == 0
    assert calls[-1]["api_key"] == "from-env"
    limits = calls[-1]["limits"]
    assert (limits.max_requests, limits.header_timeout_s, limits.max_body_bytes) == (3, 2.5, 1000)
    assert cli.main(["serve", "--api-key", "from-flag"]) == 0
    assert calls[-1]["api_key"] == "from-flag"
    assert cli.main(["serve", "--max-requests", "0"]) == 2  # ServeLimits refuses it
