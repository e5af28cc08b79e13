"""The sequential agent loop end to end: replay engine, real sandbox worker, real tools."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from agentrt import Agent, ReplLimits, ReplayEngine, tool
from agentrt.engine import EngineStreamError

ROOT = Path(__file__).resolve().parents[2]
FAST = 2000.0  # tokens per second: fast replay for functional tests


def block(code: str, lang: str = "repl") -> str:
    return f"```{lang}\n{code.strip()}\n```"


@tool(speculate=True)
def double(x: int) -> int:
    """Twice x."""
    return 2 * x


@tool
def fragile(n: int) -> int:
    """Fails on negative input."""
    if n < 0:
        raise ValueError(f"negative: {n}")
    return n


def make_agent(responses, **kw) -> Agent:
    kw.setdefault("tools", [double, fragile])
    kw.setdefault("speculation", False)
    return Agent(ReplayEngine(responses, tokens_per_second=FAST), **kw)


def test_multi_turn_with_final():
    responses = [
        "First I look at the data.\n" + block("n = len(context)\nprint('items', n)"),
        block("total = sum(double(x) for x in context)\nprint(total)"),
        "Done.\n" + block("FINAL(total + n)"),
    ]
    result = make_agent(responses).run_sync("sum doubled", context=[1, 2, 3])
    assert result.status == "final" and result.ok
    assert result.answer == 12 + 3
    assert len(result.turns) == 3
    assert result.turns[0].output == "items 3\n"
    assert "items 3" in result.turns[0].observation
    assert result.turns[1].output == "12\n"
    assert result.stats.tool_calls["double"] == 3


def test_final_var_in_code_and_in_prose():
    code = block("answer = {'k': [1, 2]}\nFINAL_VAR('answer')")
    assert make_agent([code]).run_sync("t").answer == {"k": [1, 2]}
    prose = [block("best = 'oslo'"), "The answer is in a variable.\nFINAL_VAR(best)"]
    result = make_agent(prose).run_sync("t")
    assert result.status == "final" and result.answer == "oslo"


def test_final_in_prose():
    result = make_agent(["I know this one.\nFINAL(42 apples)"]).run_sync("t")
    assert result.status == "final" and result.answer == "42 apples"


def test_max_turns_status():
    result = make_agent([block("x = 1")] * 3, max_turns=3).run_sync("t")
    assert result.status == "max_turns" and result.answer is None
    assert len(result.turns) == 3


def test_response_without_code_gets_a_hint():
    result = make_agent(["hmm", block("FINAL(1)")]).run_sync("t")
    assert "No code was run" in result.turns[0].observation
    assert result.answer == 1


def test_tool_error_is_catchable_in_model_code():
    code = block(
        "try:\n    fragile(-1)\nexcept ValueError as e:\n    print('caught', e)\n"
        "try:\n    double('ten')\nexcept TypeError as e:\n    print('bad arg', e)\n"
        "FINAL(fragile(3))"
    )
    result = make_agent([code]).run_sync("t")
    assert result.answer == 3
    out = result.turns[0].output
    assert "caught negative: -1" in out
    assert "bad arg" in out and "double()" in out and "'x'" in out


def test_uncaught_tool_error_becomes_observation_and_run_continues():
    responses = [block("v = 5\nfragile(-2)"), block("FINAL(v)")]
    result = make_agent(responses).run_sync("t")
    assert "ValueError" in result.turns[0].error and "negative: -2" in result.turns[0].error
    assert "negative: -2" in result.turns[0].observation
    assert result.answer == 5


def test_hostile_code_in_a_run_keeps_the_run_alive():
    responses = [
        block("keep = 7\nimport os"),
        block("open('/etc/passwd').read()"),
        block("while True:\n    pass"),
        block("FINAL(keep)"),
    ]
    agent = make_agent(responses, repl_limits=ReplLimits(cpu_s=1))
    result = agent.run_sync("t")
    assert result.answer == 7
    errors = [t.error for t in result.turns[:3]]
    assert all(errors), errors


def test_several_blocks_in_one_response_and_python_fence():
    response = (
        "Step one.\n" + block("a = double(2)") + "\nand step two:\n"
        + block("b = a + 1\nprint(b)", lang="python") + "\n"
    )
    result = make_agent([response, block("FINAL(b)")]).run_sync("t")
    assert [b.stdout for b in result.turns[0].blocks] == ["", "5\n"]
    assert result.answer == 5


def test_final_stops_the_turn_and_later_blocks():
    response = block("FINAL('early')") + "\n" + block("print('never')")
    result = make_agent([response]).run_sync("t")
    assert result.answer == "early"
    assert len(result.turns[0].blocks) == 1


def test_observation_is_truncated_with_a_note():
    result = make_agent(
        [block("print('z' * 50000)"), block("FINAL(0)")], max_observation_chars=1000
    ).run_sync("t")
    obs = result.turns[0].observation
    assert len(obs) < 1300 and "characters truncated" in obs


def test_engine_stream_dying_mid_turn_reports_error_with_trace():
    responses = [block("x = 1"), block("y = double(21)\nprint(y)\nFINAL(y)")]
    engine = ReplayEngine(responses, tokens_per_second=FAST, fail_at={1: 20})
    result = Agent(engine, tools=[double], speculation=False).run_sync("t")
    assert result.status == "error"
    assert "EngineStreamError" in result.error
    kinds = [e.kind for e in result.trace.events]
    assert kinds[0] == "run_started" and kinds[-1] == "run_finished"
    assert "run_error" in kinds
    assert len(result.turns) == 2


def test_trace_is_complete_and_ordered():
    responses = [block("r = double(4)\nprint(r)"), block("FINAL(r)")]
    result = make_agent(responses).run_sync("t")
    events = result.trace.events
    times = [e.t for e in events]
    assert times == sorted(times)
    kinds = [e.kind for e in events]
    for kind in ("run_started", "turn_started", "delta", "block_opened", "statement_closed",
                 "block_closed", "exec_started", "tool_started", "tool_finished",
                 "exec_finished", "turn_finished", "run_finished"):
        assert kind in kinds, kind
    # every delta's text is in the trace: the responses can be rebuilt from it
    text = "".join(e.data["text"] for e in events if e.kind == "delta" and e.data["turn"] == 0)
    assert text == responses[0]
    assert kinds.index("block_closed") < kinds.index("exec_started") < kinds.index("tool_started")
    assert json.loads(result.trace.to_json())["events"][0]["kind"] == "run_started"


def test_context_variable_and_prompt_description():
    seen = []

    def respond(messages):
        seen.append(messages)
        return block("FINAL(context['a'] * 2)")

    result = make_agent(respond).run_sync("t", context={"a": 21})
    assert result.answer == 42
    system = seen[0][0]["content"]
    assert "a dict with 1 keys" in system
    assert "double(x: int) -> int" in system


def _readme_quickstart() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"## Quickstart\n\n```python\n(.*?)\n```\n", text, re.S)
    assert match, "README quickstart block not found"
    return match.group(1)


def test_readme_quickstart_runs_as_pasted(tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(_readme_quickstart())
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("5600 final"), out.stdout


def test_cli_version():
    out = subprocess.run(
        [sys.executable, "-m", "agentrt.cli", "--version"], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.startswith("agentrt ")


def test_cli_run_on_replay(tmp_path):
    replies = tmp_path / "replies.json"
    replies.write_text(json.dumps([block("FINAL(len(context))")]))
    ctx = tmp_path / "ctx.txt"
    ctx.write_text("hello")
    trace = tmp_path / "trace.json"
    out = subprocess.run(
        [sys.executable, "-m", "agentrt.cli", "run", "count", "--engine", "replay",
         "--replay-file", str(replies), "--context-file", str(ctx), "--trace", str(trace)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "answer: 5" in out.stdout
    assert json.loads(trace.read_text())["events"]


@pytest.mark.parametrize("bad", ["{", "[1]"])
@pytest.mark.parametrize("flag", ["--drafter-config", "--spec-config"])  # and its former name
def test_cli_bad_drafter_config_is_a_clear_error(bad, flag):
    out = subprocess.run(
        [sys.executable, "-m", "agentrt.cli", "run", "t", "--engine", "replay",
         "--replay-file", "x.json", flag, bad],
        capture_output=True, text=True,
    )
    assert out.returncode == 2 and "--drafter-config" in out.stderr


def test_cli_models_list():
    out = subprocess.run(
        [sys.executable, "-m", "agentrt.cli", "models", "list"], capture_output=True, text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "smollm2-135m" in out.stdout and " ok " in out.stdout


def test_program_calls_are_recorded_in_program_order_with_and_without_speculation():
    """``program_call`` events: one per call the program made, hits included, same either way."""
    code = ("a = [double(x) for x in context]\n"
            "try:\n    fragile(-1)\nexcept ValueError:\n    pass\n"
            "b = double(a[-1])\nFINAL(b)")
    runs = {}
    for speculation in (False, True):
        agent = make_agent([block(code)], speculation=speculation)
        agent.engine.tokens_per_second = 200.0
        result = agent.run_sync("go", context=[1, 2, 3])
        assert result.answer == 12 and (result.stats.hits > 0) == speculation
        runs[speculation] = [(e.data["tool"], e.data["args"], e.data["result"], e.data["error"])
                             for e in result.trace.of("program_call")]
    assert runs[True] == runs[False]
    assert [c[0] for c in runs[False]] == ["double"] * 3 + ["fragile", "double"]
    assert runs[False][3][2] is None and "negative: -1" in runs[False][3][3]
    assert len({c[1] for c in runs[False]}) == 5  # different arguments, different digests
