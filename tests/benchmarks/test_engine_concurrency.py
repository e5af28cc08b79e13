"""`benchmarks.engine.concurrency`: the concurrency suite's system list and its per-process runs.

The vLLM runs themselves are in tests/engine/test_vllm_engine.py (vllm-marked)."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest

from benchmarks.engine import concurrency


def _args(tmp_path, **over) -> argparse.Namespace:
    values = dict(engine="vllm", model="smollm2-135m", dtype="bf16", device="cpu", max_tokens=12,
                  limit=1, sets="agent_code", systems=None, drafter_config=None, base_url=None,
                  served_model=None, k="auto", threads=1, gguf=None, out=str(tmp_path),
                  synthetic=False, concurrency="1,2", step_token_budget=None)
    return argparse.Namespace(**(values | over))


def _results(out) -> dict:
    (json_file,) = out.glob("engine-*.json")
    return json.loads(json_file.read_text())


def test_a_list_without_a_native_system_runs_and_reports(tmp_path, capsys):
    """Only a vLLM system asked for: its table is printed and written (the suite used to look
    for the first native system and died with StopIteration). A native engine stands in for
    vLLM here (not installed in this environment); the real one runs in the vllm-marked test."""
    from agentrt.engine import NativeEngine, models

    path = models.ensure("smollm2-135m", "bf16")
    built = []

    def make_engine(system, loop, **options):
        built.append((system, options))
        return NativeEngine(model=str(path), dtype="bf16", threads=1, max_seq_len=2048)

    code = concurrency.run(_args(tmp_path), ["llamacpp", "vllm"], ["agent_code"], make_engine)
    assert code == 0
    assert built == [("vllm", {})]  # no prefix-scenario engines: those are for native systems
    results = _results(tmp_path)
    assert results["meta"]["systems"] == ["vllm"] and results["meta"]["failed"] == {}
    table = results["results"]["levels"]["vllm"]
    assert [lv["concurrency"] for lv in table] == [1, 2]
    assert all(lv["tokens"] > 0 and lv["aggregate_decode_tok_s"] > 0 for lv in table)
    assert results["results"]["scenarios"] == {}
    out = capsys.readouterr()
    assert "| vllm | 2 |" in out.out
    assert "--concurrency skips llamacpp (it runs plain, " in out.err  # said, not silently dropped


def test_no_runnable_system_is_a_clear_error(tmp_path, capsys):
    code = concurrency.run(_args(tmp_path), ["llamacpp"], ["agent_code"], None)
    assert code == 2
    assert "none of those was asked for" in capsys.readouterr().err
    assert not list(tmp_path.glob("engine-*"))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_each_system_runs_in_a_child_and_failures_are_reported(tmp_path, capfd):
    """Two systems: each runs in a child process of its own; here both fail (no vLLM), and
    the run says which and why, writes what it has and exits 1."""
    code = concurrency.run(_args(tmp_path), ["vllm", "vllm-spec"], ["agent_code"], None)
    assert code == 1
    err = capfd.readouterr().err
    assert "vllm in its own process" in err and "vllm-spec in its own process" in err
    assert "VLLMEngine needs vLLM" in err  # the child's own message, passed through
    meta = _results(tmp_path)["meta"]
    assert set(meta["failed"]) == {"vllm", "vllm-spec"}
    assert "exited with status 2" in meta["failed"]["vllm"]


@pytest.mark.slow
def test_native_systems_run_alone_each_in_its_own_process(tmp_path):
    """`plain,ngram`: two child processes, distinct from this one; the prefix scenarios run
    once, with the first native system."""
    import os

    code = concurrency.run(_args(tmp_path, engine="native"), ["plain", "ngram"], ["agent_code"],
                           None)
    assert code == 0
    results = _results(tmp_path)["results"]
    pids = results["processes"]
    assert set(pids) == {"plain", "ngram"} and len(set(pids.values())) == 2
    assert os.getpid() not in pids.values()
    assert set(results["levels"]) >= {"plain", "ngram"}
    assert "multi_turn" in results["scenarios"]["plain"]
    assert "multi_turn" not in results["scenarios"]["ngram"]


def test_the_agent_ratio_is_only_given_where_both_runs_answered():
    def run(status, answer, wall):
        return {"status": status, "answer": answer, "wall_s": wall}

    ok = concurrency.agent_summary(run("final", "[1, 3]", 4.0), run("final", "[1, 3]", 2.0))
    assert ok == {"same_answer": True, "finished": True, "speedup": 2.0}
    for failed in (run("max_turns", "None", 2.0), run("final", "None", 2.0), run("error", "None", 2.0)):
        summary = concurrency.agent_summary(run("final", "None", 4.0), failed)
        assert summary == {"finished": False, "same_answer": None, "speedup": None}


def test_the_agent_scenario_answers_in_both_modes():
    # the root's program is scripted, the sub-queries are the real model's on the same engine
    import anyio

    from agentrt.engine import NativeEngine

    out = anyio.run(concurrency.agent_run, lambda: NativeEngine(drafter=None, max_seq_len=2048))
    for mode in ("sequential", "speculative"):
        assert out[mode]["status"] == "final" and out[mode]["tool_calls"] == 6, out[mode]
    assert out["finished"] and out["same_answer"] and out["speedup"] is not None
    assert out["speculative"]["early_hits"] == 6


def test_every_level_starts_from_a_fresh_engine(tmp_path):
    # the levels run the same prompts: the solo run and each level start with an empty prefix
    # cache and drafter corpus, not with what the runs before them left
    from agentrt.engine import NativeEngine, models

    served_at_reset = []

    class Engine(NativeEngine):
        def reset(self, **options):
            served_at_reset.append(self.batch_metrics().requests)
            super().reset(**options)

    path = models.ensure("smollm2-135m", "bf16")
    make = lambda system, loop, **o: Engine(model=str(path), drafter="suffix", threads=1,  # noqa: E731
                                            max_seq_len=2048)
    results = concurrency.run_here(_args(tmp_path, sets="chat", limit=2), "suffix", ["chat"],
                                   [1, 2], make, prefix_scenarios=False)
    assert served_at_reset == [1, 3]  # after the warm-up, then after the two solo requests
    assert [lv["concurrency"] for lv in results["levels"]["suffix"]] == [1, 2]


def test_budget_values_name_the_variants():
    assert concurrency.budget_values(None) == [None]
    assert concurrency.budget_values("off, 128") == ["off", "128"]
    for bad in ("0", "many", "off,-4", ","):
        with pytest.raises(ValueError, match="--step-token-budget"):
            concurrency.budget_values(bad)
    assert concurrency.budget_options(None) == {}
    assert concurrency.budget_options("off") == {"step_token_budget": None}
    assert concurrency.budget_options("64") == {"step_token_budget": 64}
    assert concurrency.variant_name("plain", None) == "plain"
    assert concurrency.variant_name("plain", "off") == "plain budget=off"


def test_levels_report_inter_token_latency_and_prompt_throughput(tmp_path):
    # one system at one budget runs here, under its variant's name, with that engine option
    from agentrt.engine import NativeEngine, models

    path = models.ensure("smollm2-135m", "bf16")
    built = []

    def make(system, loop, **options):
        built.append(options)
        return NativeEngine(model=str(path), drafter=None, threads=1, max_seq_len=2048, **options)

    results = concurrency.run_here(_args(tmp_path, sets="chat", limit=2), "plain", ["chat"],
                                   [1, 2], make, prefix_scenarios=False, budget="16")
    assert built == [{"step_token_budget": 16}]
    assert set(results["processes"]) == {"plain budget=16"}
    for level in results["levels"]["plain budget=16"]:
        assert 0 < level["gaps"] <= sum(r["tokens"] - 1 for r in level["requests"])
        assert 0 < level["itl_p50_s"] <= level["itl_p99_s"] <= level["itl_max_s"]
        assert level["processed_tok_s"] > level["aggregate_tok_s"] > 0  # prompts count too
    assert concurrency.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert concurrency.percentile([0.0, 10.0], 99) == pytest.approx(9.9)
