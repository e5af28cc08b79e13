"""The engine benchmark's command line, run for real against a scripted OpenAI-compatible server
on 127.0.0.1 (benchmarks/openai_stub.py), and its argument errors.

The vLLM runs of the benchmark are in tests/engine/test_vllm_engine.py (``bash .ci/test-vllm.sh -k bench``).
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from benchmarks.engine import cli
from benchmarks.engine.anchor import AnchorCheck
from benchmarks.engine.catalogue import DEFAULT_VLLM_SPEC, NATIVE_SYSTEMS
from benchmarks.engine.plan import drop_missing_llamacpp, make_plan
from benchmarks.engine.report import markdown
from benchmarks.engine.runs import Run, schedule
from benchmarks.engine.summary import summarise
from benchmarks.engine.systems import Row
from benchmarks.openai_stub import Status, Stream, StubServer

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
    with StubServer() as server:
        server.push(*[Stream(PIECES, delay_s=0.01) for _ in range(2)])  # warm-up, one prompt
        code = cli.main([
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
    with StubServer() as server:
        server.metrics_text = METRICS_BEFORE
        server.push(
            Stream(PIECES[:2], metrics_after=_metrics_after(2, 0, 0)),
            Stream(PIECES, delay_s=0.01, metrics_after=_metrics_after(2 + len(PIECES), 2, 3)),
        )
        code = cli.main([
            "--engine", "openai", "--base-url", server.url, "--served-model", "fake-model",
            "--limit", "1", "--sets", "copy_heavy", "--max-tokens", "8", "--out", str(tmp_path)])
    assert code == 0
    entry = _results(tmp_path)["summary"]["all"]["openai"]
    # 7 tokens, 3 of them accepted draft tokens: 4 verify steps, tau = 7 / 4.
    assert entry["tau"] == pytest.approx(7 / 4)
    assert entry["acceptance_rate"] == pytest.approx(3 / 8)


def test_without_served_model_an_unlisting_server_is_a_clear_error(tmp_path, capsys):
    with StubServer() as server:  # it has no GET /v1/models
        code = cli.main(["--engine", "openai", "--base-url", server.url,
                                  "--limit", "1", "--sets", "chat", "--out", str(tmp_path)])
    assert code == 2
    assert "/v1/models answered HTTP 404" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_a_failing_server_stops_the_run_with_its_error(tmp_path):
    from agentrt.engine import EngineError

    with StubServer() as server:
        server.push(Status(400, "no such model"))
        with pytest.raises(EngineError, match="no such model"):
            cli.main(["--engine", "openai", "--base-url", server.url, "--served-model",
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
        cli.main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_engine_picks_the_default_systems_and_drafter_config_is_parsed():
    def plan(*argv):
        args, parser = cli.parse_args(list(argv))
        return make_plan(args, parser)

    assert plan().systems == list(NATIVE_SYSTEMS)
    vllm = plan("--engine", "vllm")
    assert vllm.systems == ["plain", "vllm", "vllm-spec"]
    assert vllm.vllm_spec_config == vllm.drafter_config == DEFAULT_VLLM_SPEC
    custom = plan("--engine", "vllm", "--drafter-config", '{"method": "suffix"}', "--systems", "vllm-spec")
    assert custom.systems == ["vllm-spec"] and custom.vllm_spec_config == {"method": "suffix"}
    native = plan("--drafter-config", '{"draft_tokens": 6}')
    assert native.native_options == {"draft_tokens": 6}
    former = plan("--spec-config", '{"draft_tokens": 6}')  # the option's former name still works
    assert former.native_options == {"draft_tokens": 6}
    assert plan("--engine", "openai", "--base-url", "http://h:1/v1").systems == ["openai"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_engine_without_vllm_exits_2_with_the_install_hint(tmp_path, capsys):
    code = cli.main(["--engine", "vllm", "--limit", "1", "--sets", "chat",
                              "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "vllm-venv.sh" in err and "loaded" not in err
    assert not list(tmp_path.iterdir())


def test_llamacpp_without_llama_cpp_is_skipped_with_a_note(tmp_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` raises ImportError
    args, parser = cli.parse_args(["--systems", "plain,llamacpp"])
    plan = make_plan(args, parser)
    note = drop_missing_llamacpp(plan)
    assert plan.systems == ["plain"]
    assert note.startswith("llamacpp skipped") and "pip install llama-cpp-python" in note
    # with nothing else to run, the benchmark stops before loading anything
    code = cli.main(["--systems", "llamacpp", "--limit", "1", "--out", str(tmp_path)])
    assert code == 2
    err = capsys.readouterr().err
    assert "llamacpp skipped" in err and "no system left" in err and "loaded" not in err
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------- one process per system, anchor

def test_every_system_runs_alone_in_a_process_of_its_own(tmp_path, monkeypatch):
    # relative paths mean the same in every child as here: a config file named from this cwd
    monkeypatch.chdir(tmp_path)
    Path("native.json").write_text('{"draft_tokens": 3}')
    code = cli.main(["--systems", "plain,plain-int8", "--sets", "chat", "--limit", "1",
                              "--max-tokens", "4", "--repeats", "2", "--threads", "1",
                              "--drafter-config", "native.json", "--out", "out"])
    assert code == 0
    results = _results(tmp_path / "out")
    runs, rows = results["meta"]["runs"], results["rows"]
    # two passes, the second rotated; every run in its own fresh process, none in this one
    assert [r["system"] for r in runs] == ["plain", "plain-int8", "plain-int8", "plain"]
    pids = [r["pid"] for r in runs]
    assert len(set(pids)) == 4 and os.getpid() not in pids
    assert sorted((r["system"], r["pid"]) for r in rows) == sorted(
        (r["system"], r["pid"]) for r in runs)
    assert results["summary"]["all"]["plain"]["prompts"] == 2
    assert results["summary"]["all"]["plain"]["same_output_as_plain"] == "2/2"
    assert results["meta"]["anchor"] is None  # no llama.cpp: nothing to check


def test_schedule_brackets_every_pass_with_the_anchor_and_rotates_the_rest():
    assert schedule(["plain", "plain-int8", "llamacpp"], 2) == [
        "llamacpp", "plain", "plain-int8", "llamacpp", "plain-int8", "plain", "llamacpp"]
    assert schedule(["a", "b", "c"], 3) == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert schedule(["llamacpp"], 2) == ["llamacpp", "llamacpp"]
    with pytest.raises(ValueError, match="at least 1"):
        schedule(["plain"], 0)


def _run(system: str, index: int, decode_tok_s: float, prefill_s: float) -> Run:
    """A run of one prompt: 101 tokens, so 100 decode tokens at ``decode_tok_s``."""
    row = Row(system, "agent_code", "agent-0", 300, 101, prefill_s, 100 / decode_tok_s,
              prefill_s + 100 / decode_tok_s, pid=1000 + index, run=index)
    return Run(system, index, 1000 + index, 1.0, [row])


def _table_row(md: str, system: str) -> dict[str, str]:
    """The cells of ``system``'s row in the first table of ``md``, by column title."""
    lines = md.splitlines()
    header = next(line for line in lines if line.startswith("| system |"))
    row = next(line for line in lines if line.startswith(f"| {system} |"))
    return dict(zip(header.strip("| ").split(" | "), row.strip("| ").split(" | "), strict=True))


def _anchored(anchor_speeds: list[float]) -> tuple[dict, str]:
    runs = [_run("llamacpp", 0, anchor_speeds[0], 0.8), _run("plain-int8", 1, 80.0, 0.2),
            _run("plain", 2, 40.0, 0.4)]
    runs += [_run("llamacpp", 3 + i, s, 0.8) for i, s in enumerate(anchor_speeds[1:])]
    systems = ["plain", "plain-int8", "llamacpp"]
    check = AnchorCheck.of(runs, 0.10)
    rows = [row for run in runs for row in run.rows]
    summary = summarise(rows, systems, ["agent_code"], anchor=check)
    meta = {"time": "t", "model": "m", "dtype": "bf16", "device": "cpu", "cpu": "x", "threads": 2,
            "max_tokens": 128, "systems": systems, "reference": "plain",
            "descriptions": {s: s for s in systems}, "anchor": check.describe(),
            "anchor_ok": check.ok, "anchor_bounds": check.bounds(runs),
            "anchor_prefill_bounds": check.prefill_bounds(runs)}
    return summary, markdown(summary, meta)


def test_an_unsteady_anchor_withholds_every_ratio_against_llama_cpp():
    summary, md = _anchored([100.0, 70.0])  # llama.cpp alone: 100 tok/s, then 70 tok/s
    int8 = summary["all"]["plain-int8"]
    assert "speedup_vs_llamacpp" not in int8 and "prefill_speedup_vs_llamacpp" not in int8
    assert int8["speedup_vs_plain"] == pytest.approx(2.0)  # other ratios stay
    assert "spread 30.0% (tolerance 10%): UNSTEADY" in md
    assert "No ratio against llama.cpp" in md and "Against llama.cpp (" not in md
    cells = _table_row(md, "plain-int8")
    assert (cells["x llama.cpp"], cells["prefill s"], cells["prefill x llama.cpp"]) == ("-", "0.20", "-")
    # what holds whatever the drift: each system's runs against the fastest and slowest anchor
    assert "`plain-int8` 0.80x-1.14x; `plain` 0.40x-0.57x." in md
    assert "`plain-int8` 4.00x-4.00x faster; `plain` 2.00x-2.00x faster." in md
    runs = [_run("llamacpp", 0, 100.0, 0.8), _run("plain-int8", 1, 80.0, 0.2),
            _run("llamacpp", 2, 70.0, 0.6), _run("plain-int8", 3, 80.0, 0.25)]
    assert AnchorCheck.of(runs, 0.10).prefill_bounds(runs) == {
        "plain-int8": pytest.approx((0.6 / 0.25, 0.8 / 0.2))}


def test_a_steady_anchor_gives_decode_and_prefill_ratios():
    summary, md = _anchored([100.0, 95.0, 98.0])
    int8, plain = summary["all"]["plain-int8"], summary["all"]["plain"]
    anchor_speed = 300 / (100 / 100 + 100 / 95 + 100 / 98)  # its tokens over its decode time
    assert int8["speedup_vs_llamacpp"] == pytest.approx(80 / anchor_speed)
    assert plain["speedup_vs_llamacpp"] == pytest.approx(40 / anchor_speed)
    assert int8["prefill_speedup_vs_llamacpp"] == pytest.approx(4.0)
    assert plain["prefill_speedup_vs_llamacpp"] == pytest.approx(2.0)
    assert "spread 5.0% (tolerance 10%): steady" in md
    cells = _table_row(md, "plain-int8")
    assert cells["x llama.cpp"] == f"{80 / anchor_speed:.2f}" and cells["prefill x llama.cpp"] == "4.00"
    assert f"`plain-int8` decode {80 / anchor_speed:.2f}x, prefill 4.00x faster" in md


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python is not installed")
def test_llama_cpp_anchor_runs_around_the_native_system_in_fresh_processes(tmp_path):
    code = cli.main(["--systems", "plain-int8,llamacpp", "--sets", "chat", "--limit", "1",
                              "--max-tokens", "4", "--repeats", "1", "--threads", "1",
                              "--anchor-tolerance", "0.99", "--out", str(tmp_path)])
    assert code == 0
    meta = _results(tmp_path)["meta"]
    assert [r["system"] for r in meta["runs"]] == ["llamacpp", "plain-int8", "llamacpp"]
    assert len({r["pid"] for r in meta["runs"]}) == 3
    assert meta["anchor_ok"] is True and "llama.cpp anchor runs" in meta["anchor"]
