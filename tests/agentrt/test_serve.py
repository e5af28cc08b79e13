"""`agentrt serve`: the OpenAI-compatible server on a loopback port, driven by the `openai` client
(and raw HTTP where a client would hide what is tested), over a scripted engine for the HTTP
layer and over the real native engine for batching, cancellation and the KV cache."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("starlette", reason="agentrt serve needs starlette (pip install 'agentrt[serve]')")
pytest.importorskip("uvicorn", reason="agentrt serve needs uvicorn (pip install 'agentrt[serve]')")
openai = pytest.importorskip("openai", reason="the tests drive the server with the openai client")

import httpx  # noqa: E402
import uvicorn  # noqa: E402

from agentrt import ReplayEngine  # noqa: E402
from agentrt.serve import ChatServer  # noqa: E402


class LoopbackServer:
    """A `ChatServer` under uvicorn in a thread, on a free loopback port."""

    def __init__(self, engine, model_name: str) -> None:
        self.chat = ChatServer(engine, model_name)
        config = uvicorn.Config(self.chat.app, host="127.0.0.1", port=0, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0)

    def metrics(self) -> dict:
        return httpx.get(f"{self.url}/metrics").json()

    def wait_for(self, predicate, what: str, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            if predicate(metrics):
                return metrics
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}: {metrics}")
            time.sleep(0.05)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def echo(messages) -> str:
    return f"You said: {messages[-1]['content']}"


@pytest.fixture(scope="module")
def replay_server():
    server = LoopbackServer(ReplayEngine(echo, tokens_per_second=2000), "scripted")
    yield server
    server.close()


# -- the HTTP layer (scripted engine) ------------------------------------------------------


def test_models_and_a_plain_completion(replay_server):
    client = replay_server.client
    assert [m.id for m in client.models.list().data] == ["scripted"]
    reply = client.chat.completions.create(
        model="scripted", messages=[{"role": "system", "content": "be brief"},
                                    {"role": "user", "content": "hello there"}])
    assert reply.choices[0].message.content == "You said: hello there"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.object == "chat.completion" and reply.usage.completion_tokens > 0


def test_streaming_completion(replay_server):
    stream = replay_server.client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": [{"type": "text", "text": "a b"}]}],
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "You said: a b"
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    raw = httpx.post(f"{replay_server.url}/v1/chat/completions", json={
        "model": "scripted", "messages": [{"role": "user", "content": "x"}], "stream": True})
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("body, status, message", [
    ({"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404, "'other' does not exist"),
    ({"model": "scripted"}, 400, "messages: Field required"),
    ({"model": "scripted", "messages": []}, 400, "messages"),
    ({"model": "scripted", "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    ({"model": "scripted", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "content"),
    ({"model": "scripted", "messages": [{"role": "user", "content": "x"}], "n": 2}, 400, "n: not supported"),
    ({"model": "scripted", "messages": [{"role": "user", "content": "x"}], "temperature": 3}, 400, "temperature"),
    ({"model": "scripted", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "scripted", "messages": [{"role": "user", "content": "x"}],
      "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools: not supported"),
])
def test_bad_requests_get_4xx_with_a_message(replay_server, body, status, message):
    before = replay_server.metrics()["requests"]["rejected"]
    r = httpx.post(f"{replay_server.url}/v1/chat/completions", json=body)
    assert r.status_code == status
    error = r.json()["error"]
    assert message in error["message"], error
    assert error["type"] in ("invalid_request_error", "not_found_error")
    assert replay_server.metrics()["requests"]["rejected"] == before + 1


def test_the_openai_client_sees_the_error_message(replay_server):
    with pytest.raises(openai.NotFoundError, match="this server serves 'scripted'"):
        replay_server.client.chat.completions.create(
            model="gpt-x", messages=[{"role": "user", "content": "x"}])


def test_body_that_is_not_json(replay_server):
    r = httpx.post(f"{replay_server.url}/v1/chat/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{replay_server.url}/v1/chat/completions", json=[1, 2])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]


# -- the native engine ---------------------------------------------------------------------

PROMPTS = ["Name three colours.", "What is 2 + 2?", "Write a Python function that adds two numbers.",
           "Say hello in French."]
LONG = "Write a very long story about a dragon, at least 2000 words."


@pytest.fixture(scope="module")
def native_server():
    from agentrt.engine import NativeEngine

    engine = NativeEngine(seed=0)
    server = LoopbackServer(engine, "smollm2-135m")
    yield server
    server.close()
    engine.close()


def ask(server, prompt: str, **kw) -> str:
    reply = server.client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": prompt}], max_tokens=24,
        temperature=0, **kw)
    return reply.choices[0].message.content


def test_concurrent_requests_give_the_outputs_they_give_alone(native_server):
    solo = [ask(native_server, p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: ask(native_server, p), PROMPTS))
    assert together == solo
    assert all(solo)
    assert native_server.metrics()["batching"]["max_batch"] >= 2  # they did share steps
    streamed = native_server.client.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": PROMPTS[2]}], max_tokens=24,
        temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == solo[2]
    assert ask(native_server, PROMPTS[1], extra_body={"priority": 1}) == solo[1]


def test_prompt_longer_than_the_context_is_a_400(native_server):
    with pytest.raises(openai.BadRequestError, match="context is 4096 tokens"):
        ask(native_server, "word " * 5000)


def _idle(metrics: dict) -> bool:
    return metrics["requests"]["running"] == 0 and metrics["kv_cache"]["in_use"] == 0


def test_client_disconnect_cancels_a_stream_and_frees_its_blocks(native_server):
    server = native_server
    server.wait_for(_idle, "an idle engine")
    before = server.metrics()
    generated = before["speculation"]["generated_tokens"]
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": LONG}],
            "max_tokens": 3000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        pieces = 0
        for line in r.iter_lines():
            pieces += line.startswith("data: ") and '"content"' in line
            if pieces == 4:  # mid-stream: the request runs and holds blocks
                during = server.metrics()
                assert during["requests"]["running"] == 1 and during["kv_cache"]["in_use"] > 0
                break  # leaving the stream closes the connection
    after = server.wait_for(lambda m: m["requests"]["cancelled"] > before["requests"]["cancelled"]
                            and _idle(m), "the cancelled stream to free its blocks")
    assert after["requests"]["finished"] == before["requests"]["finished"]
    assert after["speculation"]["generated_tokens"] == generated  # it never ran to the end
    assert server.chat.engine.scheduler.in_flight() == 0


def test_client_disconnect_cancels_a_plain_request(native_server):
    server = native_server
    server.wait_for(_idle, "an idle engine")
    before = server.metrics()
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": LONG}],
            "max_tokens": 3000, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=3))
    after = server.wait_for(lambda m: m["requests"]["cancelled"] > before["requests"]["cancelled"]
                            and _idle(m), "the cancelled request to free its blocks")
    assert after["requests"]["finished"] == before["requests"]["finished"]
    assert after["speculation"]["generated_tokens"] == before["speculation"]["generated_tokens"]


def test_cli_serves_int8(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "agentrt.cli", "serve", "--port", str(port),
                             "--precision", "int8", "--served-model-name", "tiny"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.TransportError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    pytest.fail(f"agentrt serve did not start: {proc.stdout.read()[-2000:]}")
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8,
            temperature=0)
        assert reply.choices[0].message.content and reply.usage.completion_tokens <= 8
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert "precision int8" in out


def test_an_agent_runs_on_the_server_through_openai_engine():
    from agentrt import Agent
    from agentrt.engine import OpenAIEngine

    program = "```repl\nx = sum(context)\nFINAL(x * 2)\n```"
    server = LoopbackServer(ReplayEngine(lambda messages: program, tokens_per_second=2000), "coder")
    try:
        engine = OpenAIEngine(base_url=f"{server.url}/v1", model="coder")
        result = Agent(engine, builtin_tools=False).run_sync("double the sum", [1, 2, 3])
    finally:
        server.close()
    assert result.status == "final" and result.answer == 12
    assert result.turns[0].response == program
