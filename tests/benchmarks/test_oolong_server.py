"""The simulated sub-model, served for real on loopback."""

import threading
import time

import anyio
import httpx
import pytest

from agentrt.engine import OpenAIEngine
from agentrt.engine.base import complete
from benchmarks.oolong.generate import format_row, generate
from benchmarks.oolong.server import (MODEL_NAME, EngineSim, LatencyModel, Oracle,
                                      SimulatedSubModel, simulate)

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


# -- the latency model, on its own arithmetic (virtual time, no clock) --------------------------

PREFILL = LatencyModel(prefill_tokens_per_s=10_000, ttft_overhead_s=0.0, decode_tokens_per_s=100,
                       prefill_chunk_tokens=1000)


def test_ttft_grows_with_the_prefills_queued_ahead():
    """Six prompts of 3000 tokens at once: each first token waits for the prefills before it."""
    got = simulate(PREFILL, [(0.0, 3000, 10)] * 6)
    ttfts = [first for first, _ in got]
    assert ttfts == sorted(ttfts) and len(set(ttfts)) == 6
    # the k-th prompt's first token comes after k prefills of 0.3 s, plus a decode step of the
    # streams decoding beside them in each of the (at most 4) steps of every prefill, plus at
    # most one chunk of the next prompt sharing its last step
    for k, ttft in enumerate(ttfts, 1):
        assert k * 0.3 <= ttft <= k * 0.3 + k * 4 / PREFILL.stream_speed(6) + 0.1
    alone = simulate(PREFILL, [(0.0, 3000, 10)])[0][0]
    assert alone == pytest.approx(0.3)


def test_a_concurrent_prefill_slows_a_decoding_stream():
    """Stream A decodes 200 tokens; B's 20,000-token prompt arrives meanwhile. Each of the 20
    steps that carry a chunk of B's prompt also carries one of A's tokens, and lasts a decode
    step plus 999 prompt tokens: A ends later by about B's prefill time."""
    (_, a_alone), = simulate(PREFILL, [(0.0, 10, 200)])
    (_, a_shared), (b_ttft, _) = simulate(PREFILL, [(0.0, 10, 200), (0.5, 20_000, 5)])
    assert a_alone == pytest.approx(0.001 + 200 / 100, abs=0.02)
    slowed = a_shared - a_alone
    assert slowed == pytest.approx(20_000 / 10_000, rel=0.05)
    step = PREFILL.step_seconds(1, 999)
    assert step == pytest.approx(1 / PREFILL.stream_speed(1) + 999 / 10_000)
    assert b_ttft >= 20_000 / 10_000


def test_decode_curve_passes_through_the_cited_points():
    lat = LatencyModel()
    assert lat.stream_speed(1) == pytest.approx(172.5)                 # Luminal, one user
    assert lat.relative_speed(10) == pytest.approx(85.26 / 210.8, rel=1e-3)  # Millstone, 10
    assert lat.stream_speed(32) * 32 / (172.5 * 32) == pytest.approx(0.41)   # Luminal, 41%
    # piecewise linear between the points, not one slope
    assert lat.relative_speed(5) == pytest.approx(1 + (0.4045 - 1) * 4 / 9)
    assert lat.relative_speed(21) == pytest.approx(0.4045 + (0.41 - 0.4045) * 11 / 22)
    # past the last point the streams share its total throughput
    assert lat.stream_speed(64) * 64 == pytest.approx(lat.stream_speed(32) * 32)
    # the one-slope rule is still there when asked for
    assert LatencyModel(slowdown_per_stream=0.5).relative_speed(3) == pytest.approx(0.5)


def test_round_trip_and_overhead_add_to_every_request():
    base = simulate(PREFILL, [(0.0, 1000, 3), (0.0, 1000, 3)])
    lat = LatencyModel(**{**PREFILL.__dict__, "rtt_s": 0.08, "ttft_overhead_s": 0.05})
    more = simulate(lat, [(0.0, 1000, 3), (0.0, 1000, 3)])
    for (f0, e0), (f1, e1) in zip(base, more):
        assert f1 == pytest.approx(f0 + 0.13) and e1 == pytest.approx(e0 + 0.13)


def test_concurrency_cap_queues_and_an_aborted_request_frees_its_place():
    lat = LatencyModel(**{**PREFILL.__dict__, "max_concurrency": 2})
    sim = EngineSim(lat)
    for rid in range(3):
        sim.submit(rid, 100, 50)
    sim.step()
    assert [r.rid for r in sim.running] == [0, 1] and len(sim.waiting) == 1
    sim.abort(0)
    step = sim.step()
    assert [r.rid for r in sim.running] == [1, 2] and 2 in step.tokens   # 2 prefilled at once


def test_latency_arguments_round_trip_and_reject_bad_values():
    import argparse

    from benchmarks.oolong.server import add_latency_arguments, latency_cli_args, latency_from_args

    p = argparse.ArgumentParser()
    add_latency_arguments(p)
    args = p.parse_args(["--sub-rtt-ms", "40", "--sub-decode-curve", "1:1,8:0.5",
                         "--sub-prefill-chunk", "2048"])
    lat = latency_from_args(args)
    assert (lat.rtt_s, lat.decode_curve, lat.prefill_chunk_tokens) == (0.04, ((1, 1.0), (8, 0.5)),
                                                                        2048)
    assert latency_from_args(p.parse_args(latency_cli_args(args))) == lat
    assert latency_from_args(p.parse_args(["--sub-slowdown", "None"])).slowdown_per_stream is None
    for bad in (["--sub-decode-curve", "2:1"], ["--sub-rtt-ms", "-1"],
                ["--sub-max-concurrency", "0"]):
        with pytest.raises(ValueError):
            latency_from_args(p.parse_args(bad))


# -- the real server: measured time is never below the model's arithmetic -------------------------

def test_server_follows_the_model_with_rtt(task):
    prompt = ASK + "\n".join(format_row(r) for r in task.rows[:10])
    lat = LatencyModel(prefill_tokens_per_s=1e6, ttft_overhead_s=0.0, decode_tokens_per_s=2000,
                       rtt_s=0.3)
    with SimulatedSubModel(Oracle.from_tasks([task]), lat) as server:
        out: list = [None]
        _timed(server.url, prompt, out, 0)
    assert out[0][0] >= 0.3 and out[0][1] < 0.3 + 5.0


def test_labels_come_from_the_tasks_label_set():
    (t,) = generate([1024], 1, seed=2, dataset="app_reviews")
    oracle = Oracle.from_tasks([t], error_rate=1.0, seed=3)    # every row wrong
    rows = t.rows[:20]
    reply = oracle.reply(ASK + "\n".join(format_row(r) for r in rows)).split("\n")
    assert reply == [{"negative": "positive", "positive": "negative"}[r[3]] for r in rows]
    exact = Oracle.from_tasks([t])
    ask = "How many of these reviews are positive?\n" + "\n".join(format_row(r) for r in rows)
    assert exact.reply(ask) == str(sum(r[3] == "positive" for r in rows))


def test_tasks_without_rows_are_refused(tmp_path, capsys):
    from benchmarks.oolong import server
    from benchmarks.oolong.tasks import Task, save_tasks

    blind = [Task(id=f"real-{i}", context="c", question="q", answer="3",
                  answer_type="OOLONG_REAL", labels=[]) for i in range(2)]
    with pytest.raises(ValueError) as info:
        server.check_simulatable([generate([1024], 1, seed=1)[0], *blind])
    message = str(info.value)
    assert "2 of 3 tasks have no 'rows'" in message and "real-0, real-1" in message
    assert "--sub-base-url URL" in message
    server.check_simulatable(generate([1024], 1, seed=1))       # rows: fine
    path = save_tasks(blind, tmp_path / "t.jsonl")
    assert server.main(["--tasks", str(path), "--port", "0"]) == 2
    assert "--sub-base-url" in capsys.readouterr().err
