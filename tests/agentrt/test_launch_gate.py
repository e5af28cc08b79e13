"""`LaunchGate` on its own, on a real `Ledger`: adoption across shadow runs, the refusals (not
speculatable, overtaking an effect, too late, argument caps) and the ghost bound and window of
the open tail."""

from __future__ import annotations

import anyio
import pytest

from agentrt import SpeculationBudget, tool
from agentrt.claims import Claims
from agentrt.effect_epochs import EffectEpochs
from agentrt.interpreter.frames import Launch
from agentrt.launch_gate import LaunchGate, ShadowLaunches
from agentrt.ledger import Ledger
from agentrt.results import RunStats
from agentrt.shadow_code import ShadowProgram
from agentrt.tools import ToolRegistry
from agentrt.trace import Trace

pytestmark = pytest.mark.anyio


@tool(speculate=True, pure=True)
async def f(x: int) -> int:
    """x + 1."""
    return x + 1


@tool(speculate=True)
async def peek() -> int:
    """Reads every scope."""
    return 0


@tool(speculate=True, pure=True)
async def size(text: str) -> int:
    """The length of ``text``."""
    return len(text)


@tool
async def note(x: int) -> int:
    """Effectful: never early."""
    return x


class Parts:
    """A gate and the real parts it asks, with early calls that run until ``finish``."""

    def __init__(self, budget: SpeculationBudget = SpeculationBudget(), window: int = 4):
        self.tools = ToolRegistry()
        for t in (f, peek, size, note):
            self.tools.register(t)
        self.trace, self.stats = Trace(), RunStats()
        self.finish = anyio.Event()
        self.ledger = Ledger(self._invoke, budget, self.trace.now)
        self.epochs = EffectEpochs(self.tools)
        self.claims = Claims(self.ledger, self.trace, self.stats)
        self.gate = LaunchGate(self.tools, self.ledger, self.epochs, self.claims, self.trace,
                               self.stats, window)
        self._ids = 0

    async def _invoke(self, call):
        await self.finish.wait()
        return await self.tools.call(call.tool, call.args, call.kwargs)

    def launch(self, run: ShadowLaunches, name: str, *args, lineno: int = 1, deps=()):
        self._ids += 1
        return self.gate.admit(run, Launch(self._ids, name, args, {}, lineno, tuple(deps)))


def closed_run(number: int = 1, epoch: int = 0) -> ShadowLaunches:
    return ShadowLaunches(number, 0, epoch, ((0, 1),), None)


async def test_a_later_shadow_adopts_the_calls_in_flight_in_order():
    parts = Parts()
    async with parts.ledger:
        first = closed_run(1)
        a, b = parts.launch(first, "f", 1), parts.launch(first, "f", 1, lineno=2)
        assert a is not b and parts.stats.launched == 2  # identical calls are separate
        second = closed_run(2)
        assert parts.launch(second, "f", 1) is a
        assert parts.launch(second, "f", 1, lineno=2) is b
        c = parts.launch(second, "f", 1, lineno=3)
        assert c not in (a, b) and parts.stats.launched == 3
        third = closed_run(3)
        assert parts.launch(third, "f", 1) is a
        parts.gate.retract_unadopted(third)
        assert a.live and not b.live and not c.live
        launches = parts.trace.of("spec_launch")
        assert [e.data["early_id"] for e in launches] == [a.id, b.id, c.id]
        assert [e.data["lineno"] for e in launches] == [1, 2, 3]
        parts.finish.set()


async def test_refusals_not_speculatable_overtaking_an_effect_too_late():
    parts = Parts()
    async with parts.ledger:
        run = closed_run()
        assert parts.launch(run, "note", 1) is None
        parts.epochs.advance(note)
        assert parts.launch(run, "peek") is None  # it reads what note wrote since epoch 0
        assert parts.launch(run, "f", 2) is not None  # pure: crosses the effect
        assert parts.launch(closed_run(2, epoch=1), "peek") is not None
        parts.claims.block_started(0, 0)
        assert await parts.claims.claim(f, (9,), {}, turn=0, block=0) == (False, None)
        assert parts.launch(run, "f", 9) is None  # the program already made that call
        assert parts.stats.launched == 2
        parts.finish.set()


async def test_argument_caps_refuse_and_are_traced_once_per_site_and_cap():
    parts = Parts(SpeculationBudget(max_arg_bytes_per_launch=1000, max_arg_bytes_per_run=1500))
    async with parts.ledger:
        run = closed_run()
        assert parts.launch(run, "size", "x" * 2000) is None
        assert parts.launch(closed_run(2), "size", "y" * 2000) is None  # same site
        assert parts.launch(run, "size", "a" * 800, lineno=2) is not None
        assert parts.launch(run, "size", "b" * 800, lineno=3) is None  # the run's total
        events = [(e.data["lineno"], e.data["cap"], e.data["limit"])
                  for e in parts.trace.of("spec_too_large")]
        assert events == [(1, "launch", 1000), (3, "run", 1500)]
        assert parts.trace.of("spec_too_large")[0].data["arg_bytes"] > 2000
        parts.finish.set()


def tail_run(tail: str, number: int = 1) -> ShadowLaunches:
    program = ShadowProgram(((0, 1, "i = 0\n"), (0, 2, tail)), ((0, 1),), 2)
    return ShadowLaunches.of(program, number, 0, 0, 0.0)


async def test_a_while_in_the_tail_that_repeats_a_key_stops_the_tails_launches():
    parts = Parts()
    async with parts.ledger:
        run = tail_run("while i < n:\n    r = f(i)\n")
        assert run.while_lines == frozenset({2, 3}) and run.unread_lines == frozenset({3})
        assert parts.launch(run, "f", 0, lineno=3) is not None
        assert parts.launch(run, "f", 0, lineno=3) is None  # no progress: stalled
        assert parts.launch(run, "f", 1, lineno=3) is None
        assert run.tail_stalled
        parts.finish.set()


async def test_the_window_bounds_unread_results_and_maps_go_unthrottled():
    parts = Parts(window=1)
    async with parts.ledger:
        run = tail_run("for i in range(9):\n    d = f(i)\n")
        got = [parts.launch(run, "f", i, lineno=3) for i in range(4)]
        assert [call is not None for call in got] == [True, True, False, False]
        assert not run.tail_stalled  # a for loop advances by itself
        mapped = tail_run("for x in xs:\n    out.append(f(x))\n", number=2)
        assert all(parts.launch(mapped, "f", 10 + i, lineno=3) is not None for i in range(6))
        parts.finish.set()
        await got[0].done.wait()
        await got[1].done.wait()
        third = tail_run("for i in range(9):\n    d = f(i)\n", number=3)
        assert parts.launch(third, "f", 0, lineno=3) is got[0]  # adopted, finished
        assert parts.launch(third, "f", 1, lineno=3) is got[1]
        assert parts.launch(third, "f", 2, lineno=3) is not None  # the window slid
