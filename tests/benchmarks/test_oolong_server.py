"""The simulated sub-model, served for real on loopback."""

import threading
import time

import anyio
import httpx
import pytest

from agentrt.engine import OpenAIEngine
from agentrt.engine.base import complete
from benchmarks.oolong.generate import format_row, generate
from benchmarks.oolong.server import MODEL_NAME, LatencyModel, Oracle, SimulatedSubModel

ASK = "Give the category of each question below, one per line.\n"
FAST = LatencyModel(prefill_tokens_per_s=1e6, ttft_overhead_s=0.0, decode_tokens_per_s=5000.0)


@pytest.fixture(scope="module")
def task():
    return generate([2048], 1, seed=4)[0]


def chat(url: str, prompt: str, **extra) -> dict:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": prompt}], **extra}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)
    reply.raise_for_status()
    return reply.json()


def test_models_and_labels_from_rows(task):
    with SimulatedSubModel(Oracle.from_tasks([task]), FAST) as server:
        models = httpx.get(f"{server.url}/v1/models").json()
        assert [m["id"] for m in models["data"]] == [MODEL_NAME]
        rows = task.rows[:30]
        reply = chat(server.url, ASK + "\n".join(format_row(r) for r in rows))
        assert reply["choices"][0]["message"]["content"].split("\n") == [r[3] for r in rows]
        assert reply["usage"]["completion_tokens"] > 0


def test_count_prompt_and_no_rows(task):
    with SimulatedSubModel(Oracle.from_tasks([task]), FAST) as server:
        rows = task.rows[:40]
        text = "How many of these questions are about a 'location'?\n" + "\n".join(
            format_row(r) for r in rows)
        got = chat(server.url, text)["choices"][0]["message"]["content"]
        assert got == str(sum(r[3] == "location" for r in rows))
        assert "no questions" in chat(server.url, "hello")["choices"][0]["message"]["content"]
        bad = httpx.post(f"{server.url}/v1/chat/completions", json={"prompt": "x"})
        assert bad.status_code == 400


def test_error_rate_is_seeded_per_row(task):
    rows = task.rows[:80]
    prompt = ASK + "\n".join(format_row(r) for r in rows)
    with SimulatedSubModel(Oracle.from_tasks([task], error_rate=0.3, seed=1), FAST) as server:
        first = chat(server.url, prompt)["choices"][0]["message"]["content"].split("\n")
        again = chat(server.url, prompt)["choices"][0]["message"]["content"].split("\n")
        # the same rows in another chunking get the same labels
        half = chat(server.url, ASK + "\n".join(format_row(r) for r in rows[40:]))
    assert first == again
    assert half["choices"][0]["message"]["content"].split("\n") == first[40:]
    wrong = sum(a != r[3] for a, r in zip(first, rows))
    assert 8 <= wrong <= 40


def test_streaming_through_openai_engine(task):
    rows = task.rows[:20]
    prompt = ASK + "\n".join(format_row(r) for r in rows)
    with SimulatedSubModel(Oracle.from_tasks([task]), FAST) as server:
        engine = OpenAIEngine(base_url=f"{server.url}/v1", model=MODEL_NAME, server_metrics=False)

        async def go():
            try:
                return await complete(engine, [{"role": "user", "content": prompt}])
            finally:
                await engine.aclose()

        result = anyio.run(go)
        plain = chat(server.url, prompt)["choices"][0]["message"]["content"]
    assert result.text == plain == "\n".join(r[3] for r in rows)


def _timed(url: str, prompt: str, out: list, i: int) -> None:
    t0 = time.monotonic()
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=30, json={
            "model": MODEL_NAME, "stream": True,
            "messages": [{"role": "user", "content": prompt}]}) as reply:
        first = None
        for line in reply.iter_lines():
            if first is None and '"content": "' in line and '"content": ""' not in line:
                first = time.monotonic() - t0
    out[i] = (first, time.monotonic() - t0)


def test_ttft_grows_with_prompt_tokens(task):
    lat = LatencyModel(prefill_tokens_per_s=10_000, ttft_overhead_s=0.0, decode_tokens_per_s=2000)
    short = ASK + format_row(task.rows[0])
    long = ASK + "\n".join(format_row(r) for r in task.rows[:1]) + "\n" + "filler " * 4000
    with SimulatedSubModel(Oracle.from_tasks([task]), lat) as server:
        out: list = [None]
        _timed(server.url, short, out, 0)
        ttft_short = out[0][0]
        _timed(server.url, long, out, 0)
        ttft_long = out[0][0]
    assert ttft_long - ttft_short > 0.5 * (len(long) - len(short)) / 4 / 10_000


def test_concurrency_slows_streams_and_queues_beyond_the_cap(task):
    prompt = ASK + "\n".join(format_row(r) for r in task.rows[:25])  # ~75 output tokens
    lat = LatencyModel(prefill_tokens_per_s=1e6, ttft_overhead_s=0.0, decode_tokens_per_s=150,
                       slowdown_per_stream=0.25, max_concurrency=4)
    with SimulatedSubModel(Oracle.from_tasks([task]), lat) as server:
        out: list = [None]
        _timed(server.url, prompt, out, 0)
        alone = out[0][1]
        out = [None] * 8
        threads = [threading.Thread(target=_timed, args=(server.url, prompt, out, i))
                   for i in range(8)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
        peak = server.peak_decoding
    assert peak == 4                                    # the cap held
    # 4 streams at 1/(1 + 3 * 0.25) of the speed, then 4 more: ~3.5x one request alone
    assert 2.5 * alone < wall < 6.0 * alone
    assert min(o[1] for o in out) > 1.3 * alone          # a shared stream is slower
