"""The peer system (spec-ptc from PyPI) in the pattern benchmark, in its own virtualenv."""

from __future__ import annotations

import json

import pytest

from benchmarks import pattern_bench
from benchmarks.oolong.generate import generate
from benchmarks.oolong.trajectories import trajectory
from benchmarks.oolong.scoring import score
from benchmarks.oolong.server import MODEL_NAME, LatencyModel, Oracle, SimulatedSubModel
from benchmarks.patterns import patterns
from benchmarks.peer import PeerDriver, PeerUnavailable, job, oolong_job, peer_python

FAST = {"--tokens-per-second": "400", "--latency": "0.05"}


def peer_or_skip():
    try:
        return peer_python()
    except PeerUnavailable:
        pytest.skip("the peer's virtualenv (.venv-peer) is missing: bash .ci/peer-venv.sh")


def pattern(name: str):
    return next(p for p in patterns() if p.name == name)


def bench(tmp_path, *extra: str) -> tuple[dict, str]:
    """Run the benchmark (its exit status also says whether speculation kept within its time
    bound, which load can break: not checked here); its JSON and markdown."""
    pattern_bench.main([*sum(FAST.items(), ()), "--no-plots", "--out", str(tmp_path), *extra])
    return (json.loads((tmp_path / "patterns.json").read_text()),
            (tmp_path / "patterns.md").read_text())


def test_missing_peer_venv_is_a_note_and_agentrt_rows_still_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PEER_VENV", str(tmp_path / "no-such-venv"))
    with pytest.raises(PeerUnavailable, match="bash .ci/peer-venv.sh"):
        peer_python()
    data, table = bench(tmp_path, "--systems", "agentrt,spec-ptc", "--only", "serial_chain")
    assert [r["pattern"] for r in data["rows"]] == ["serial_chain"]
    assert data["rows"][0]["identical"] and "peer_s" not in data["rows"][0]
    assert "no-such-venv is missing" in data["peer_note"] and data["peer_note"] in table
    assert "spec-ptc was not run" in capsys.readouterr().out


def test_unknown_system_is_refused(tmp_path):
    with pytest.raises(SystemExit) as stop:
        pattern_bench.main(["--systems", "agentrt,nope", "--out", str(tmp_path)])
    assert stop.value.code == 2


def test_peer_row_counts_a_differing_or_failed_peer_as_no_speedup():
    from agentrt import Agent, ReplayEngine

    seq = Agent(ReplayEngine(["```repl\nprint(1)\nFINAL(2)\n```"], 1000),
                builtin_tools=False).run_sync("t")
    same = {"status": "final", "answer": "2", "turns": [["1\n", None]], "wall_s": 0.5,
            "launched": 0, "hits": 0, "misses": 0, "wasted": 0}
    assert pattern_bench.peer_row(seq, same)["peer_identical"] is True
    assert pattern_bench.peer_row(seq, same)["peer_speedup"] == seq.wall_s / 0.5
    other = pattern_bench.peer_row(seq, {**same, "answer": "3"})
    assert other["peer_identical"] is False and other["peer_speedup"] is None
    failed = pattern_bench.peer_row(seq, {"pattern": "x", "error": "RuntimeError: boom"})
    assert failed == {"peer_error": "RuntimeError: boom", "peer_identical": False}
    table = pattern_bench.markdown([{
        "pattern": "p", "sequential_s": 1.0, "speculative_s": 0.5, "speedup": 2.0, "limit_s": 0.5,
        "efficiency": 1.0, "launched": 1, "hits": 1, "misses": 0, "wasted": 0, "retracted": 0,
        "identical": True, **failed}], 50, 1.0)
    assert "failed: RuntimeError: boom" in table and "count as no speedup" in table


def test_peer_runs_the_same_program_and_stream_side_by_side(tmp_path):
    peer_or_skip()
    data, table = bench(tmp_path, "--systems", "agentrt,spec-ptc",
                              "--only", "map_reduce", "several_blocks", "two_turn_dependency")
    assert data["peer_note"] is None
    for row in data["rows"]:
        assert row["identical"] and row["peer_identical"], row
        assert row["peer_hits"] >= 1 and row["peer_s"] > 0
    assert "spec-ptc speedup" in table


def test_driver_and_the_peers_own_harness_agree():
    python = peer_or_skip()
    payload = job(pattern("several_blocks"), 400, 0.05)
    with PeerDriver(python) as ours, PeerDriver(python, own_harness=True) as theirs:
        a, b = ours.run(payload), theirs.run(payload)
    assert a["answer"] == b["answer"] != "None"


def test_peer_answers_an_oolong_task_in_replay_mode():
    python = peer_or_skip()
    task = generate([1024], 1, seed=3)[0]
    fast = LatencyModel(prefill_tokens_per_s=1e6, ttft_overhead_s=0.0, decode_tokens_per_s=4000)
    with SimulatedSubModel(Oracle.from_tasks([task]), fast) as sub, PeerDriver(python) as peer:
        result = peer.run(oolong_job(task.id, trajectory(task, "loop"), task.context,
                                     400, sub.url, MODEL_NAME, 1024))
    assert result["status"] == "final", result
    assert len(result["turns"]) == 4  # the whole RLM-style trajectory, turn by turn
    assert score(result["answer_text"], task.answer, task.answer_type) == 1.0
    assert result["hits"] >= 1


def test_a_driver_that_cannot_start_says_why():
    import sys

    with pytest.raises(PeerUnavailable, match="spec_ptc"):  # this venv has no spec-ptc
        PeerDriver(sys.executable)


def test_a_pattern_whose_runs_never_answer_gives_no_speedup():
    from benchmarks.patterns import Pattern, fence

    unanswered = Pattern("no_final", [fence("x = 1\nprint(x)")])  # no FINAL: the turn limit
    row = pattern_bench.compare(unanswered, 1000.0, 0.01)
    assert row["identical"] and row["speedup"] is None
    answered = pattern_bench.compare(pattern("serial_chain"), 400.0, 0.05)
    table = pattern_bench.markdown([row, answered], 400, 0.05)
    assert "| no_final | " in table and " | - | " in table.split("| no_final | ")[1].splitlines()[0]
    assert "over the 1 of 2 patterns whose runs both finished identically" in table
