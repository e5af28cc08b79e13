"""The protocol's frames: one typed class per op, used by both sides; a renamed op breaks loudly."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from typing import Any, ClassVar

import anyio
import pytest

from agentrt.interpreter import Repl, ReplLimits, frames, protocol
from agentrt.interpreter.frames import HostFrame, Shadow, ShadowDone
from agentrt.interpreter.protocol import ProtocolError

ROOT = Path(__file__).resolve().parents[2]

SAMPLES: dict[type, frames.Frame] = {frame.__class__: frame for frame in (
    frames.Init({"memory_mb": 1, "max_output_chars": 2, "recursion_limit": 3},
                (("f", "f(x)"),), None),
    frames.Spawn("t", 1), frames.Exec("x = 1", "cell", True, 1.0, "t", 2),
    frames.Fork("t", 3), frames.SetVar("x", [1], 4), frames.GetVar("x", 5), frames.Summary(6),
    frames.Extend("m:f", 7), frames.Exit(), frames.ToolResult(1, {"a": 1}),
    frames.ToolFailed(1, "ValueError", "ValueError", "bad"),
    frames.Shadow(((0, 1, "x = 1\n"),), ("f", "g"), 2.0, (("g", ("a",)),), (("h", ()),)),
    frames.EarlyResult(1, [1, 2]),
    frames.EarlyFailed(1, "boom"), frames.EarlyPoisoned(1, "cancelled"),
    frames.Hello(5, "fork", "t"), frames.Forked("t", 9), frames.Reply(1, True, {"v": 1}),
    frames.ToolCall(1, "f", (1,), {"k": 2}, 3), frames.ChildExit(9, 0, None),
    frames.Launch(1, "f", (1,), {}, 2, (3,)), frames.ShadowDone(1, 0, 0, 2),
    frames.RefusedCall("f"),
)}


def test_every_frame_has_a_sample_and_round_trips_through_its_parser():
    assert set(SAMPLES) == {*frames.HOST_FRAMES.values(), *frames.WORKER_FRAMES.values(),
                            frames.RefusedCall}
    for cls, frame in SAMPLES.items():
        if cls in frames.HOST_FRAMES.values():
            assert frames.parse_host_frame(frame.to_message()) == frame
        elif cls in frames.WORKER_FRAMES.values():
            assert frames.parse_worker_frame(frame.to_message()) == frame


def test_ops_are_unique_and_every_frame_is_in_the_protocol_table():
    classes = [*frames.HOST_FRAMES.values(), *frames.WORKER_FRAMES.values(), frames.RefusedCall]
    ops = [cls.op for cls in classes]
    assert len(set(ops)) == len(ops)
    table = dict(re.findall(r"^``(\w+)``\s+``(\w+)``", protocol.__doc__, re.M))
    assert table == {cls.op: cls.__name__ for cls in classes}


def test_a_frame_with_an_unknown_op_is_refused_by_both_parsers():
    message = SAMPLES[frames.EarlyResult].to_message() | {"op": "early_value"}
    with pytest.raises(ProtocolError, match="unknown op 'early_value'"):
        frames.parse_host_frame(message)
    with pytest.raises(ProtocolError, match="unknown op"):
        frames.parse_worker_frame(SAMPLES[frames.Launch].to_message() | {"op": "launched"})
    with pytest.raises(ProtocolError, match="early_result"):
        frames.parse_host_frame({"op": "early_result", "call": 1, "result": 2})


def _op_literals(path: Path) -> list[str]:
    """Where ``path`` spells the key "op" itself (a dict display, a subscript, ``.get``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        keys = []
        if isinstance(node, ast.Dict):
            keys = node.keys
        elif isinstance(node, ast.Subscript):
            keys = [node.slice]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "get":
            keys = node.args[:1]
        if any(isinstance(k, ast.Constant) and k.value == "op" for k in keys):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_no_module_but_frames_and_protocol_builds_or_reads_raw_messages():
    allowed = {ROOT / "interpreter" / "frames.py", ROOT / "interpreter" / "protocol.py"}
    found = [hit for folder in ("interpreter", "agentrt", "tools")
             for path in sorted((ROOT / folder).rglob("*.py")) if path not in allowed
             for hit in _op_literals(path)]
    assert found == []


@dataclasses.dataclass(frozen=True)
class _RenamedEarlyResult(HostFrame):
    """``EarlyResult`` as a runtime whose op name drifted would send it."""

    op: ClassVar[str] = "early_value"
    call: int
    value: Any


@pytest.mark.anyio
async def test_a_shadow_that_gets_a_renamed_op_stops_loudly():
    async def no_tools(name: str, args: tuple, kwargs: dict) -> None:
        raise LookupError(name)

    async with Repl(no_tools, (), ReplLimits(cpu_s=5, wall_s=30)) as repl:
        messages = repl.messages()
        shadow = await repl.fork_shadow()
        await shadow.post(Shadow((), (), 2.0))
        with anyio.fail_after(10):
            token, done = await messages.receive()
        assert token == shadow.token and isinstance(done, ShadowDone)
        await shadow.post(_RenamedEarlyResult(1, 2))  # its lazy values would wait forever
        with anyio.fail_after(10):
            while shadow.alive:
                await anyio.sleep(0.02)
        holder = await repl.fork()
        await holder.post(_RenamedEarlyResult(1, 2))
        with anyio.fail_after(10):
            while holder.alive:
                await anyio.sleep(0.02)
        messages.close()
        assert (await repl.execute("print(1)")).stdout == "1\n"
    assert f"exit code {frames.EXIT_PROTOCOL}" in shadow.death_cause
    assert f"exit code {frames.EXIT_PROTOCOL}" in holder.death_cause
