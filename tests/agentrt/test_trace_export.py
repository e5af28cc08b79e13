"""The exports of a real run's trace: Chrome trace-event JSON (the format's required fields,
units, lanes) and the timeline."""

from __future__ import annotations

import json
from collections import defaultdict

import anyio

from agentrt import Agent, ReplayEngine, tool
from agentrt.cli import main as cli_main
from agentrt.trace import Trace, chrome_trace, save_chrome_trace
from agentrt.trace_export import timeline

PROGRAM = '''Let me look.
```repl
sizes = [size(name) for name in context]
saved = save(str(sizes))
summary = llm_query("summarise " + str(sizes))
print(sizes, saved)
```
And the answer:
```repl
FINAL(sum(sizes))
```'''


def make_run():
    @tool(speculate=True)
    async def size(name: str) -> int:
        """Read-only."""
        await anyio.sleep(0.15)
        return len(name)

    @tool
    async def save(text: str) -> str:
        """Effectful: never early."""
        await anyio.sleep(0.05)
        return "ok"

    def respond(messages):
        return "fine" if messages[-1]["content"].startswith("summarise") else PROGRAM

    agent = Agent(ReplayEngine(respond, tokens_per_second=40), tools=[size, save])
    result = agent.run_sync("t", ["a", "bb", "ccc", "dddd"])
    assert result.status == "final" and result.answer == 10
    assert result.stats.hits >= 1  # some calls really were early
    return result


def test_required_fields_units_and_lanes():
    result = make_run()
    data = json.loads(json.dumps(chrome_trace(result.trace, name="demo run")))
    events = data["traceEvents"]
    for e in events:
        assert {"ph", "ts", "pid", "tid", "name"} <= set(e), e
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        assert e["ph"] in ("X", "i", "C", "M")
        if e["ph"] == "X":
            assert e["dur"] >= 0
    # balanced: complete events only, no dangling begin/end pairs
    assert not [e for e in events if e["ph"] in ("B", "E")]
    meta = {(e["name"], e["tid"]): e["args"] for e in events if e["ph"] == "M"}
    assert meta["process_name", 0] == {"name": "demo run"}
    lanes = {tid: args["name"] for (name, tid), args in meta.items() if name == "thread_name"}
    used = {e["tid"] for e in events if e["ph"] != "M"}
    assert used <= set(lanes), "every lane that holds events is named"
    for lane in ("run", "root model", "root tokens", "shadow", "code blocks", "block execution",
                 "early calls #1", "tool calls #1", "sub-model #1"):
        assert lane in lanes.values(), (lane, lanes)
    # microseconds: the run span lasts the run's wall time
    run = next(e for e in events if e["ph"] == "X" and e["name"] == "run")
    assert abs(run["dur"] - result.wall_s * 1e6) < 0.2 * 1e6
    # one span per tool call, in the lane of its kind; spans in one lane never overlap
    spans = [e for e in events if e["ph"] == "X" and e["cat"] in ("early calls", "tool calls",
                                                                     "sub-model")]
    assert len(spans) == len(result.trace.of("tool_finished"))
    assert "save" in {e["name"] for e in spans if e["cat"] == "tool calls"}
    assert {(e["name"], e["args"]["mode"]) for e in spans if e["cat"] == "early calls"} == \
        {("size", "early")}
    # llm_query is pure: it may start early, across the effectful save()
    assert [e["name"].removesuffix(" (early)") for e in spans if e["cat"] == "sub-model"] == \
        ["llm_query"]
    by_lane = defaultdict(list)
    for e in spans:
        by_lane[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    for intervals in by_lane.values():
        intervals.sort()
        assert all(a[1] <= b[0] + 1e-3 for a, b in zip(intervals, intervals[1:]))
    deltas = [e for e in events if e["ph"] == "i" and e["name"] == "delta"]
    assert "".join(e["args"]["text"] for e in deltas).startswith(PROGRAM)
    turns = [e for e in events if e["ph"] == "X" and e["cat"] == "root model"]
    assert [t["name"] for t in turns] == ["turn 1"]
    blocks = [e for e in events if e["ph"] == "X" and e["cat"] == "block execution"]
    assert [b["name"] for b in blocks] == ["turn 1 block 1", "turn 1 block 2"]


def test_unfinished_spans_are_closed_at_the_end_and_marked():
    trace = Trace.from_dict({"events": [
        {"t": 0.0, "kind": "run_started", "data": {"task": "t"}},
        {"t": 0.1, "kind": "turn_started", "data": {"turn": 0}},
        {"t": 0.2, "kind": "tool_started", "data": {"call_id": 1, "tool": "f", "mode": "sync"}},
        {"t": 0.5, "kind": "run_error", "data": {"error": "EngineError: gone"}},
    ]})
    events = chrome_trace(trace)["traceEvents"]
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    assert spans["f"]["args"]["unfinished"] is True and spans["f"]["dur"] == 0.3e6
    assert spans["turn 1"]["args"]["unfinished"] is True
    assert spans["run"]["dur"] == 0.5e6
    assert [e["name"] for e in events if e["ph"] == "i"] == ["error"]


def test_trace_round_trips_and_saves(tmp_path):
    result = make_run()
    again = Trace.from_dict(json.loads(result.trace.to_json()))
    assert [(e.t, e.kind) for e in again.events] == [(e.t, e.kind) for e in result.trace.events]
    path = save_chrome_trace(result.trace, tmp_path / "run.json")
    assert json.loads(path.read_text()) == json.loads(json.dumps(result.trace.to_chrome()))


def test_cli_trace_out(tmp_path, capsys):
    replies = tmp_path / "replies.json"
    replies.write_text(json.dumps(["```repl\nx = 6 * 7\nFINAL(x)\n```"]))
    out = tmp_path / "run.json"
    code = cli_main(["run", "t", "--engine", "replay", "--replay-file", str(replies),
                     "--tokens-per-second", "500", "--trace-out", str(out)])
    assert code == 0 and "answer: 42" in capsys.readouterr().out
    events = json.loads(out.read_text())["traceEvents"]
    assert any(e["ph"] == "X" and e["name"] == "turn 1 block 1" for e in events)


def test_the_timeline_reads_the_runs_spans():
    result = make_run()
    spans = timeline(result.trace)
    assert (spans[0].lane, spans[0].label) == ("generation", "t0")  # one span per turn, first
    assert [s for s in spans if s.lane == "generation"] == spans[:1]
    executed = [s.label for s in spans if s.lane == "execution"]
    assert executed == ["t0b0", "t0b1"]
    calls = [(s.lane, s.label) for s in spans if s.lane.endswith("call")]
    assert len(calls) == len(result.trace.of("tool_finished"))
    assert ("sync call", "save") in calls and ("early call", "size") in calls
    assert all(s.start <= s.end for s in spans)
