"""The typed trace events: one registry, checked fields, docs/trace.md listing exactly the
registered types, every emit site typed, saved traces read back into the same events."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from agentrt import Agent, ReplayEngine, tool
from agentrt.events import (
    EVENTS,
    TABLE_END,
    TABLE_START,
    EventData,
    SpecClaim,
    ToolStarted,
    TurnFinished,
    event_table,
)
from agentrt.trace import Trace

ROOT = Path(__file__).resolve().parents[2]


def test_docs_list_exactly_the_registered_event_types():
    text = (ROOT / "docs" / "trace.md").read_text()
    section = text[text.index(TABLE_START):text.index(TABLE_END) + len(TABLE_END)]
    assert section == event_table(), "regenerate: python -m agentrt.events docs/trace.md"
    listed = [line.split("`")[1] for line in section.splitlines() if line.startswith("| `")]
    assert listed == list(EVENTS)


def test_a_wrong_event_fails_loudly_where_it_is_emitted():
    trace = Trace()
    with pytest.raises(TypeError, match="field 'early_id'"):
        trace.emit(SpecClaim(0, "f", "7"))
    with pytest.raises(TypeError, match="mode"):
        ToolStarted(1, "f", "later")
    with pytest.raises(TypeError):
        ToolStarted(1, "f", "sync", where=3)  # no such field
    with pytest.raises(TypeError):
        TurnFinished()  # turn is missing

    @dataclasses.dataclass(frozen=True)
    class Unregistered(EventData):
        turn: int

    with pytest.raises(TypeError, match="registered"):
        trace.emit(Unregistered(0))
    with pytest.raises(TypeError, match="registered"):
        trace.emit("turn_started")
    assert trace.events == []


def test_every_emit_in_the_runtime_passes_a_typed_event():
    untyped = []
    for path in sorted((ROOT / "agentrt").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr == "emit" and (
                        node.keywords or len(node.args) != 1
                        or isinstance(node.args[0], ast.Constant)):
                untyped.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not untyped, untyped


@tool(speculate=True)
def double(x: int) -> int:
    """Twice x."""
    return 2 * x


def test_a_saved_run_reads_back_into_the_same_events():
    code = "```repl\nys = [double(x) for x in context]\nFINAL(sum(ys))\n```"
    result = Agent(ReplayEngine([code], 200), tools=[double], builtin_tools=False).run_sync(
        "t", [1, 2, 3])
    assert result.answer == 12
    kinds = {e.kind for e in result.trace.events}
    assert {"run_started", "delta", "spec_claim", "program_call", "run_finished"} <= kinds
    again = Trace.from_dict(json.loads(result.trace.to_json()))
    assert [(e.t, e.payload) for e in again.events] == \
        [(e.t, e.payload) for e in result.trace.events]
    assert all(type(e.payload) is EVENTS[e.kind] for e in again.events)


def test_an_unknown_kind_in_a_saved_trace_is_refused():
    with pytest.raises(ValueError, match="unknown kind 'tool_begun'"):
        Trace.from_dict({"events": [{"t": 0.0, "kind": "tool_begun", "data": {}}]})
