"""The spare shadow fork: made ahead for the current state, taken by the next shadow, never
used once the state it was forked in has changed; alone and in the speculator. Real REPL, real
forks."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import pytest

from agentrt import SpeculationBudget, tool
from agentrt.interpreter.repl import Repl, ReplLimits
from agentrt.results import RunStats
from agentrt.spare_fork import SpareFork
from agentrt.speculation import Speculator
from agentrt.tools import ToolRegistry
from agentrt.trace import Trace

pytestmark = pytest.mark.anyio


@tool(speculate=True, pure=True)
async def f(x: int) -> int:
    """x + 1."""
    return x + 1


async def until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true in time"
        await anyio.sleep(0.01)


async def test_the_next_shadow_takes_the_spare_fork_of_its_state():
    registry = ToolRegistry()
    registry.register(f)
    trace = Trace()

    async def handler(name: str, args: tuple, kwargs: dict):
        return await registry.get(name).func(*args, **kwargs)

    def peeks() -> list:
        return [e for e in trace.events if e.kind == "spec_peek"]

    async with Repl(handler, {"f": "f(x: int) -> int"}, ReplLimits(cpu_s=2, wall_s=30)) as repl:
        async with Speculator(repl, registry, SpeculationBudget(), trace, RunStats()) as spec:
            spec.start_turn(0)
            await until(lambda: spec.spare.handle is not None)
            spare = spec.spare.handle
            spec.statement_closed(0, 1, 1, "x = f(1)\n")
            await until(lambda: any(e.kind == "spec_launch" for e in trace.events))
            assert peeks()[0].data["spare"] is True
            assert spec._shadow.handle is spare

            await until(lambda: spec.spare.handle is not None)  # the next one, made ahead
            stale = spec.spare.handle
            spec.start_turn(1)  # a new state: that spare may no longer be used
            spec.statement_closed(0, 1, 1, "y = f(2)\n")
            await until(lambda: len(peeks()) == 2 and spec._shadow is not None)
            assert spec._shadow.handle is not stale
            await until(lambda: not stale.alive)


async def test_a_spare_fork_alone_serves_only_its_state():
    state = [0]

    async def handler(name: str, args: tuple, kwargs: dict):
        raise AssertionError("no tool is called")

    async with Repl(handler, {}, ReplLimits(cpu_s=2, wall_s=30)) as repl:
        spare = SpareFork(repl, lambda: state[0])
        async with anyio.create_task_group() as tg:
            tg.start_soon(spare.keep, tg)
            assert spare.take() is None  # none made yet; asks for one
            await until(lambda: spare.handle is not None)
            made = spare.handle
            assert spare.take() is made and spare.handle is None
            await until(lambda: spare.handle is not None)  # the next one, made ahead
            stale = spare.handle
            state[0] = 1
            assert spare.take() is None  # of another state: never used, killed
            await until(lambda: not stale.alive)
            await until(lambda: spare.handle is not None)
            fresh = spare.take()
            assert fresh is not None and fresh is not stale
            await until(lambda: spare.handle is not None)
            await spare.kill()
            assert spare.handle is None
            tg.cancel_scope.cancel()
        await made.kill()
        await fresh.kill()
