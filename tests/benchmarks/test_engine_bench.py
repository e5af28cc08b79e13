"""The engine benchmark's command line, run for real against a scripted OpenAI-compatible server
on 127.0.0.1 (tests/fake_openai_server.py), and its argument errors.

The vLLM runs of the benchmark are in tests/engine/test_vllm_engine.py (``bash .ci/test-vllm.sh -k bench``).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from fake_openai_server import FakeOpenAIServer, Status, Stream

from benchmarks import engine_bench

PIECES = ["Paris", " is", " the", " capital", " of", " France", "."]
METRICS_BEFORE = """\
vllm:generation_tokens_total{model_name="fake-model"} 100
vllm:spec_decode_num_drafts_total{model_name="fake-model"} 10
vllm:spec_decode_num_draft_tokens_total{model_name="fake-model"} 40
vllm:spec_decode_num_accepted_tokens_total{model_name="fake-model"} 20
"""


def _metrics_after(generated: int, drafts: int, accepted: int) -> str:
    return (
        f'vllm:generation_tokens_total{{model_name="fake-model"}} {100 + generated}\n'
        f'vllm:spec_decode_num_drafts_total{{model_name="fake-model"}} {10 + drafts}\n'
        f'vllm:spec_decode_num_draft_tokens_total{{model_name="fake-model"}} {40 + 4 * drafts}\n'
        f'vllm:spec_decode_num_accepted_tokens_total{{model_name="fake-model"}} {20 + accepted}\n'
    )


def _results(out: Path) -> dict:
    (json_file,) = out.glob("engine-*.json")
    return json.loads(json_file.read_text())


def test_openai_engine_against_a_served_endpoint(tmp_path):
    with FakeOpenAIServer() as server:
        server.push(*[Stream(PIECES, delay_s=0.01) for _ in range(2)])  # warm-up, one prompt
        code = engine_bench.main([
            "--engine", "openai", "--base-url", server.url + "/v1", "--served-model", "fake-model",
            "--limit", "1", "--sets", "chat", "--max-tokens", "8", "--out", str(tmp_path)])
        requests = list(server.requests)
    assert code == 0
    assert len(requests) == 2
    assert all(r.body["model"] == "fake-model" and r.body["max_tokens"] == 8 for r in requests[1:])
    assert requests[1].body["messages"][-1]["content"].startswith("What is the capital of France")
    results = _results(tmp_path)
    meta, summary, rows = results["meta"], results["summary"], results["rows"]
    assert meta["engine"] == "openai" and meta["systems"] == ["openai"]
    assert meta["base_url"] == server.url + "/v1" and meta["served_model"] == "fake-model"
    assert meta["drafter_config"] is None and meta["reference"] is None
    entry = summary["all"]["openai"]
    assert entry["prompts"] == 1 and entry["new_tokens"] == len(PIECES)
    assert entry["decode_tok_s"] > 0 and entry["tau"] is None  # no /metrics on this server
    assert rows[0]["text"] == "".join(PIECES) and rows[0]["prompt_id"] == "chat-0"
    assert rows[0]["decode_s"] > 0 and rows[0]["prefill_s"] > 0
    md = next(tmp_path.glob("engine-*.md")).read_text()
    assert "| openai |" in md and f"at {server.url}/v1, model `fake-model`" in md


def test_vllm_counters_of_the_server_give_tau_and_acceptance(tmp_path):
    with FakeOpenAIServer() as server:
        server.metrics_text = METRICS_BEFORE
        server.push(
            Stream(PIECES[:2], metrics_after=_metrics_after(2, 0, 0)),
            Stream(PIECES, delay_s=0.01, metrics_after=_metrics_after(2 + len(PIECES), 2, 3)),
        )
        code = engine_bench.main([
            "--engine", "openai", "--base-url", server.url, "--served-model", "fake-model",
            "--limit", "1", "--sets", "copy_heavy", "--max-tokens", "8", "--out", str(tmp_path)])
    assert code == 0
    entry = _results(tmp_path)["summary"]["all"]["openai"]
    # 7 tokens, 3 of them accepted draft tokens: 4 verify steps, tau = 7 / 4.
    assert entry["tau"] == pytest.approx(7 / 4)
    assert entry["acceptance_rate"] == pytest.approx(3 / 8)


def test_without_served_model_an_unlisting_server_is_a_clear_error(tmp_path, capsys):
    with FakeOpenAIServer() as server:  # it has no GET /v1/models
        code = engine_bench.main(["--engine", "openai", "--base-url", server.url,
                                  "--limit", "1", "--sets", "chat", "--out", str(tmp_path)])
    assert code == 2
    assert "/v1/models answered HTTP 404" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_failing_server_stops_the_run_with_its_error(tmp_path):
    from agentrt.engine import EngineError

    with FakeOpenAIServer() as server:
        server.push(Status(400, "no such model"))
        with pytest.raises(EngineError, match="no such model"):
            engine_bench.main(["--engine", "openai", "--base-url", server.url, "--served-model",
                               "x", "--limit", "1", "--sets", "chat", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(("argv", "message"), [
    (["--engine", "openai"], "needs --base-url"),
    (["--engine", "openai", "--base-url", "http://127.0.0.1:9", "--drafter-config",
      '{"method": "ngram"}'], "server decides"),
    (["--systems", "plain,turbo"], "unknown systems ['turbo']"),
    (["--sets", "nope"], "unknown prompt sets ['nope']"),
    (["--engine", "vllm", "--drafter-config", '{"num_speculative_tokens": 4}'], "needs a 'method'"),
    (["--drafter-config", '{"method": "ngram"}'], "pick it with --systems"),
    (["--drafter-config", '{"speed": 11}'], "NativeEngine has no option ['speed']"),
    (["--drafter-config", "not json"], "neither JSON nor a JSON file"),
    (["--base-url", "http://127.0.0.1:9"], "are for the openai system"),
])
def test_argument_errors_exit_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        engine_bench.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_engine_picks_the_default_systems_and_drafter_config_is_parsed():
    def plan(*argv):
        args, parser = engine_bench.parse_args(list(argv))
        return engine_bench.make_plan(args, parser)

    assert plan().systems == list(engine_bench.NATIVE_SYSTEMS)
    vllm = plan("--engine", "vllm")
    assert vllm.systems == ["plain", "vllm", "vllm-spec"]
    assert vllm.vllm_spec_config == vllm.drafter_config == engine_bench.DEFAULT_VLLM_SPEC
    custom = plan("--engine", "vllm", "--drafter-config", '{"method": "suffix"}', "--systems", "vllm-spec")
    assert custom.systems == ["vllm-spec"] and custom.vllm_spec_config == {"method": "suffix"}
    native = plan("--drafter-config", '{"draft_tokens": 6}')
    assert native.native_options == {"draft_tokens": 6}
    former = plan("--spec-config", '{"draft_tokens": 6}')  # the option's former name still works
    assert former.native_options == {"draft_tokens": 6}
    assert plan("--engine", "openai", "--base-url", "http://h:1/v1").systems == ["openai"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_engine_without_vllm_exits_2_with_the_install_hint(tmp_path, capsys):
    code = engine_bench.main(["--engine", "vllm", "--limit", "1", "--sets", "chat",
                              "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "vllm-venv.sh" in err and "loaded" not in err
    assert not list(tmp_path.iterdir())


def test_llamacpp_without_llama_cpp_is_skipped_with_a_note(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    args, parser = engine_bench.parse_args(["--systems", "plain,llamacpp"])
    plan = engine_bench.make_plan(args, parser)
    note = engine_bench.drop_missing_llamacpp(plan)
    assert plan.systems == ["plain"]
    assert note.startswith("llamacpp skipped") and "pip install llama-cpp-python" in note
    # with nothing else to run, the benchmark stops before loading anything
    code = engine_bench.main(["--systems", "llamacpp", "--limit", "1", "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "llamacpp skipped" in err and "no system left" in err and "loaded" not in err
    assert not list(tmp_path.iterdir())
