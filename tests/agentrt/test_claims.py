"""`Claims` on its own, on a real `Ledger`: hits and misses, and what unclaimed calls count as."""

from __future__ import annotations

import anyio
import pytest

from agentrt import SpeculationBudget, tool
from agentrt.claims import Claims
from agentrt.ledger import Ledger, Origin, compact_key
from agentrt.results import RunStats
from agentrt.tools import ToolRegistry
from agentrt.trace import Trace

pytestmark = pytest.mark.anyio


@tool(speculate=True, pure=True)
async def f(x: int) -> int:
    """x + 1."""
    await anyio.sleep(0.01)
    return x + 1


@tool(speculate=True, pure=True)
async def size(text: str) -> int:
    """The length of ``text``."""
    return len(text)


@tool
async def note(x: int) -> int:
    """Effectful."""
    return x


def setup(budget: SpeculationBudget = SpeculationBudget()):
    tools = ToolRegistry()
    tools.register(f)
    tools.register(note)
    trace, stats = Trace(), RunStats()

    async def invoke(call):
        return await tools.call(call.tool, call.args, call.kwargs)

    ledger = Ledger(invoke, budget, trace.now)
    return tools, ledger, Claims(ledger, trace, stats), trace, stats


def launch(ledger: Ledger, x: int, block: int = 0):
    key = compact_key(f.call_key((x,), {}))
    return ledger.launch("f", key, (x,), {}, Origin(0, block, 1, 0, False, 1))


async def test_a_hit_waits_for_the_early_call_and_a_miss_does_not_run_the_tool():
    tools, ledger, claims, trace, stats = setup()
    async with ledger:
        early = launch(ledger, 1)
        claims.block_started(0, 0)
        assert await claims.claim(f, (1,), {}, turn=0, block=0) == (True, 2)
        assert await claims.claim(f, (1,), {}, turn=0, block=0) == (False, None)
        assert await claims.claim(note, (5,), {}, turn=0, block=0) == (False, None)
        assert await claims.claim(f, (7,), {}, turn=1, block=0) == (False, None)
    assert (stats.hits, stats.misses) == (1, 2)
    assert stats.hidden_s >= 0
    assert [(e.data["seq"], e.data["early_id"]) for e in trace.of("spec_claim")] == [
        (0, early.id), (1, None), (3, None)]  # the effectful call took seq 2, no event
    assert claims.asked(0, 0, compact_key(f.call_key((1,), {}))) == 2


async def test_arguments_past_the_launch_cap_miss_without_a_key():
    tools, ledger, claims, trace, stats = setup(SpeculationBudget(max_arg_bytes_per_launch=100))
    async with ledger:
        assert await claims.claim(size, ("x" * 1000,), {}, turn=0, block=0) == (False, None)
    assert stats.misses == 1
    assert trace.of("spec_claim")[0].data["early_id"] is None
    assert claims.asked(0, 0, compact_key(size.call_key(("x" * 1000,), {}))) == 0


async def test_unclaimed_calls_count_as_wasted_when_the_program_made_them_else_retracted():
    tools, ledger, claims, trace, stats = setup()
    async with ledger:
        first, duplicate, ghost = launch(ledger, 1), launch(ledger, 1), launch(ledger, 3)
        other_block = launch(ledger, 4, block=1)
        claims.block_started(0, 0)
        assert (await claims.claim(f, (1,), {}, turn=0, block=0))[0]
        claims.settle(turn=0, block=0)
        claims.settle(turn=0, block=0)  # once each
        assert (stats.wasted, stats.retracted) == (1, 1)
        assert {(e.data["early_id"], e.data["reason"]) for e in trace.of("spec_cancel")} == {
            (duplicate.id, "wasted"), (ghost.id, "retracted")}
        assert other_block.live and first.released
        claims.settle()
        assert stats.retracted == 2
    claims.release()
    assert claims.asked(0, 0, compact_key(f.call_key((1,), {}))) == 0
