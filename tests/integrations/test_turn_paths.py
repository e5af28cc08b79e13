"""One scripted response through both loops that run model code, the `Agent` and the RLM
environment: both adapt the same `Turn`, so they must emit the same protocol events with the same
data. Real sandbox workers, real shadows; the response's first block waits for its two early
calls to be launched before it closes, so that both runs claim them."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence

import anyio
import pytest

pytest.importorskip("rlm", reason="the RLM library is not installed (pip install 'agentrt[rlm]')")

from agentrt import Agent, tool  # noqa: E402
from agentrt.engine import BaseEngine, Delta, SamplingParams, Usage  # noqa: E402
from agentrt.integrations.rlm import AgentrtREPL  # noqa: E402
from agentrt.trace import Event, Trace  # noqa: E402

FIRST = 'a = lookup("alpha")\nb = lookup("beta")\nprint(a + b)'
SECOND = "n = note(a + b)\nc = lookup(str(n))\nprint(n, c)"
RESPONSE = f"I will look the words up.\n```repl\n{FIRST}\n```\nThen note the sum.\n" \
           f"```repl\n{SECOND}\n```\nThat is all.\n"
EARLY = 2
"""Early calls the first block waits for: lookup("alpha") and lookup("beta")."""

# Kind -> the fields compared, per lane: the events of one lane come in a fixed order in both
# loops (the agent runs a block while the next one streams: lanes keep that apart).
STREAM = {"turn_started": ("turn",), "delta": ("turn", "text"), "block_opened": ("turn", "block"),
          "statement_closed": ("turn", "block", "stmt", "lineno"),
          "block_closed": ("turn", "block", "chars", "unterminated")}
EXECUTION = {"exec_started": ("turn", "block"), "spec_claim": ("seq", "tool", "hit"),
             "spec_effect": ("turn", "epoch"), "program_call": ("tool", "args", "result", "error"),
             "tool_started": ("tool", "mode", "turn", "block", "lineno"),
             "tool_finished": ("tool", "mode", "error"),
             "exec_finished": ("turn", "block", "error", "final"), "turn_finished": ("turn",)}
RUN_ONLY = {"run_started", "run_finished", "run_error"}
"""The agent's run events: the RLM library, not the environment, owns its run."""


def pieces() -> list[str]:
    """The response as the model streams it: every line in two deltas."""
    out = []
    for line in RESPONSE.splitlines(keepends=True):
        half = max(1, len(line) // 2)
        out += [line[:half], line[half:]] if len(line) > 1 else [line]
    return out


def first_close() -> int:
    """The delta that starts the first block's closing fence."""
    text = ""
    for index, piece in enumerate(pieces()):
        if text.endswith(FIRST + "\n"):
            return index
        text += piece
    raise AssertionError("the script has no first block")


def make_tools(notes: list[int]):
    @tool(speculate=True)
    async def lookup(word: str) -> int:
        """The length of a word."""
        await anyio.sleep(0.02)
        return len(word)

    @tool
    async def note(total: int) -> str:
        """Write a note (effectful: never early)."""
        notes.append(total)
        return f"noted {total}"

    return lookup, note


def launched(events: list[Event]) -> int:
    return sum(1 for e in events if e.kind == "spec_launch")


class GatedEngine(BaseEngine):
    """Streams `pieces`; the first block's closing fence waits for ``gate()``."""

    name = "gated"

    def __init__(self, gate: Callable[[], bool]) -> None:
        self.gate = gate

    async def stream(self, messages: Sequence, params: SamplingParams | None = None
                     ) -> AsyncIterator[Delta]:
        for index, piece in enumerate(pieces()):
            if index == first_close():
                with anyio.fail_after(30):
                    while not self.gate():
                        await anyio.sleep(0.01)
            yield Delta(text=piece)
            await anyio.sleep(0.002)
        yield Delta(text="", finish_reason="stop", usage=Usage(0, 0))


def run_agent() -> tuple[Trace, list[int]]:
    notes: list[int] = []
    seen: list[Event] = []
    agent = Agent(GatedEngine(lambda: launched(seen) >= EARLY), tools=make_tools(notes),
                  builtin_tools=False, max_turns=1, on_event=seen.append)
    result = agent.run_sync("look up")
    assert result.status == "max_turns", result.error
    assert result.stats.hits == EARLY
    return result.trace, notes


def run_rlm_environment() -> tuple[Trace, list[int]]:
    notes: list[int] = []
    lookup, note = make_tools(notes)
    trace = Trace()
    env = AgentrtREPL(custom_tools={"lookup": lookup, "note": note}, trace=trace)
    try:
        env.begin_stream()
        for piece in pieces():
            env.feed(piece)
        env.end_stream()
        deadline = time.monotonic() + 30
        while launched(trace.events) < EARLY:
            assert time.monotonic() < deadline, "the early calls were not launched"
            time.sleep(0.01)
        outputs = [env.execute_code(code).stdout for code in (FIRST, SECOND)]
    finally:
        env.cleanup()
    assert outputs == ["9\n", "noted 9 7\n"]
    assert env.stats.hits == EARLY
    return trace, notes


def lane(trace: Trace, fields: dict[str, tuple[str, ...]]) -> list[tuple]:
    out = []
    for event in trace.events:
        data = {**event.data, "hit": event.data.get("early_id") is not None}
        if event.kind not in fields or data.get("mode") == "early":
            continue
        out.append((event.kind, *(data[name] for name in fields[event.kind])))
    return out


def early_calls(trace: Trace) -> list[str]:
    return sorted(e.data["tool"] for e in trace.of("tool_started") if e.data["mode"] == "early")


def test_the_agent_and_the_rlm_environment_emit_the_same_turn():
    agent, agent_notes = run_agent()
    rlm, rlm_notes = run_rlm_environment()
    assert agent_notes == rlm_notes == [9]
    assert lane(agent, STREAM) == lane(rlm, STREAM)
    assert "".join(e.data["text"] for e in rlm.of("delta")) == RESPONSE
    assert lane(agent, EXECUTION) == lane(rlm, EXECUTION)
    assert early_calls(agent) == early_calls(rlm) == ["lookup"] * EARLY
    assert {e.kind for e in agent.events} - RUN_ONLY == {e.kind for e in rlm.events}
    # what the lanes hold: every call in program order, the two early ones claimed
    calls = [(kind, *rest) for kind, *rest in lane(rlm, EXECUTION) if kind == "spec_claim"]
    assert calls == [("spec_claim", 0, "lookup", True), ("spec_claim", 1, "lookup", True),
                     ("spec_claim", 3, "lookup", False)]
    assert len(rlm.of("program_call")) == 4 and len(rlm.of("spec_effect")) == 1
    assert [e.data["block"] for e in rlm.of("block_closed")] == [0, 1]
