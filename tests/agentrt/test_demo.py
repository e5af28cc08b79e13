"""`agentrt demo` reports a speedup only when both runs finished with the same answer."""

from __future__ import annotations

import pytest

from agentrt import demo
from agentrt.results import RunResult, RunStats
from agentrt.trace import Trace


def result(answer, status="final", wall=1.0, error=None) -> RunResult:
    return RunResult(answer=answer, status=status, turns=[], stats=RunStats(), wall_s=wall,
                     trace=Trace(), error=error)


def test_verdict_same_answer_reports_the_speedup_and_correctness():
    text = demo.verdict([result(demo.EXPECTED, wall=3.0), result(demo.EXPECTED, wall=1.5)])
    assert "same answer" in text and "(correct)" in text and "2.00x faster" in text
    wrong = demo.verdict([result([1], wall=3.0), result([1], wall=1.0)])
    assert f"wrong (the truth is {demo.EXPECTED})" in wrong and "3.00x" in wrong


@pytest.mark.parametrize("plain, fast, reason", [
    (result([1]), result([2]), "the answers differ"),
    (result(None, "max_turns"), result([1]), "plain ended with status max_turns"),
    (result([1]), result(None, "error", error="EngineError: x"), "agentrt ended with status error: EngineError: x"),
])
def test_verdict_never_reports_a_speedup_when_runs_differ_or_fail(plain, fast, reason):
    text = demo.verdict([plain, fast])
    assert text.startswith("NO SPEEDUP REPORTED") and reason in text and "faster" not in text


def test_main_exit_code_follows_the_verdict(monkeypatch, capsys):
    outcomes = iter([result([1], wall=2.0), result([2], wall=1.0)])
    monkeypatch.setattr(demo, "run_once", lambda *a, **k: (next(outcomes), _Metrics()))
    assert demo.main() == 1
    assert "NO SPEEDUP REPORTED" in capsys.readouterr().out


class _Metrics:
    tokens_per_s = 0.0
    tau = 0.0


@pytest.mark.slow
def test_demo_end_to_end_gives_the_right_answer_in_both_modes(capsys):
    assert demo.main() == 0
    out = capsys.readouterr().out
    assert f"same answer, {demo.EXPECTED!r} (correct)" in out
