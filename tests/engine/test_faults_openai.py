"""Faults of an OpenAI-compatible server, on a real HTTP server on 127.0.0.1
(benchmarks/openai_stub.py): chunks of the wrong shape, bare ``data`` lines, a trickle of
bytes, keep-alives forever, a stream that never ends, retries past the deadline. Each ends in an
`EngineStreamError` naming the URL (and the chunk), and the engine serves the next request."""

from __future__ import annotations

import time

import pytest

from agentrt.engine import EngineStreamError, complete
from agentrt.engine.openai_engine import OpenAIEngine

from benchmarks.openai_stub import Raw, Status, Stream, StubServer, chunk, engine_for

pytestmark = pytest.mark.anyio

CHAT = [{"role": "user", "content": "say hello"}]
DONE = "data: [DONE]\n\n"


@pytest.fixture
def server():
    with StubServer() as fake:
        yield fake



async def _still_serves(engine: OpenAIEngine, server: StubServer) -> None:
    server.push(Stream(["fine", " again"]))
    assert (await complete(engine, CHAT)).text == "fine again"


MALFORMED = [
    ({"choices": [None]}, "choices[0] must be an object, got null"),
    ({"choices": "oops"}, "'choices' must be a list, got str"),
    ({"choices": [{"index": 0, "delta": {"content": 123}}]},
     "choices[0].delta.content must be a string, got int"),
    ({"choices": [{"index": 0, "delta": "text"}]}, "choices[0].delta must be an object"),
    ({"choices": [{"index": 0, "text": ["a"]}]}, "choices[0].text must be a string"),
    ({"choices": [{"index": 0, "delta": {}, "finish_reason": 7}]},
     "choices[0].finish_reason must be a string"),
    ({"choices": [], "usage": {"prompt_tokens": "n/a", "completion_tokens": 3}},
     "usage.prompt_tokens must be a non-negative integer"),
    ({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": -1}},
     "usage.completion_tokens must be a non-negative integer"),
    ({"choices": [], "usage": "lots"}, "'usage' must be an object"),
    ({"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1},
      "metrics": {"speculative_decoding": {"acceptance_histogram": ["x"]}}},
     "metrics.speculative_decoding.acceptance_histogram"),
]


@pytest.mark.parametrize("fields, problem", MALFORMED)
async def test_a_malformed_first_chunk_is_a_stream_error_naming_url_and_chunk(server, fields,
                                                                             problem):
    server.push(Raw([chunk(**fields), DONE]))
    async with engine_for(server) as engine:
        with pytest.raises(EngineStreamError) as caught:
            await complete(engine, CHAT)
        message = str(caught.value)
        assert server.url in message and problem in message
        assert '"choices"' in message  # the chunk itself, truncated
        assert engine.attempts == 1  # a server bug: not retried
        await _still_serves(engine, server)


@pytest.mark.parametrize("fields, problem", MALFORMED[:4])
async def test_a_malformed_chunk_after_text_is_a_stream_error(server, fields, problem):
    server.push(Raw([chunk("Hel"), chunk(**fields), DONE]))
    async with engine_for(server) as engine:
        with pytest.raises(EngineStreamError, match="stream broke after 3 characters") as caught:
            await complete(engine, CHAT)
        assert server.url in str(caught.value) and problem in str(caught.value)
        await _still_serves(engine, server)


async def test_a_json_value_that_is_not_an_object_is_a_stream_error(server):
    server.push(Raw(["data: [1, 2]\n\n", DONE]))
    async with engine_for(server) as engine:
        with pytest.raises(EngineStreamError, match="must be a JSON object, got list"):
            await complete(engine, CHAT)
        await _still_serves(engine, server)


async def test_bare_data_lines_without_payload_are_skipped(server):
    server.push(Raw([chunk("Hel"), "data\n\n", "data:\n\n", "data: \n\n", chunk("lo"),
                     chunk(None, "stop"), DONE]))
    async with engine_for(server) as engine:
        done = await complete(engine, CHAT)
    assert done.text == "Hello" and done.finish_reason == "stop"


async def test_a_trickle_of_bytes_ends_at_the_progress_timeout(server):
    """One byte every 50 ms: the read timeout (5 s) never fires, but no event completes."""
    server.push(Raw([chunk("Hello"), chunk(None, "stop"), DONE], byte_delay_s=0.05))
    async with engine_for(server, progress_timeout=0.5) as engine:
        started = time.monotonic()
        with pytest.raises(EngineStreamError, match="progress_timeout") as caught:
            await complete(engine, CHAT)
        assert server.url in str(caught.value)
        assert time.monotonic() - started < 30  # the whole trickle would take 15 s
        await _still_serves(engine, server)


@pytest.mark.parametrize("before", [[], [chunk("Hi")]], ids=["before-text", "after-text"])
async def test_keep_alives_forever_end_at_the_progress_timeout(server, before):
    server.push(Raw(before, delay_s=0.05, then="keep_alive"))
    async with engine_for(server, progress_timeout=0.5) as engine:
        with pytest.raises(EngineStreamError, match="only keep-alives") as caught:
            await complete(engine, CHAT)
        assert server.url in str(caught.value)
        if before:
            assert "stream broke after 2 characters" in str(caught.value)
        await _still_serves(engine, server)


async def test_a_stream_that_never_ends_stops_at_the_total_timeout(server):
    server.push(Raw([chunk("a")], delay_s=0.05, then="repeat"))
    async with engine_for(server, progress_timeout=0.5, total_timeout=1.0) as engine:
        deltas = []
        with pytest.raises(EngineStreamError, match=r"did not finish within 1 s \(total_timeout\)"):
            async for delta in engine.stream(CHAT):
                deltas.append(delta)
        assert len(deltas) > 3  # it made progress, just never an end
        await _still_serves(engine, server)


async def test_the_total_timeout_also_bounds_retries(server):
    server.push(*[Status(503, "busy", retry_after=0.4)] * 10)
    async with engine_for(server, max_retries=10, total_timeout=1.0) as engine:
        with pytest.raises(Exception, match="gave up after") as caught:
            await complete(engine, CHAT)
        assert engine.attempts < 10 and "HTTP 503" in str(caught.value)
    server.script.clear()


def test_deadlines_are_checked():
    for bad in ({"progress_timeout": 0}, {"total_timeout": -1.0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            OpenAIEngine("http://127.0.0.1:9", "m", **bad)
