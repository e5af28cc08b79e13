"""Agent(warm_repls=): sandbox workers kept ready in the process-wide pool, given back on close."""

from __future__ import annotations

import time

import pytest

from agentrt import Agent, ReplayEngine, ReplLimits
from agentrt.interpreter.repl.pool import WorkerSpec, shared_pool

RESPONSE = "```repl\nFINAL(6 * 7)\n```"


def test_the_agent_keeps_workers_ready_and_close_gives_them_back():
    spec = WorkerSpec.for_limits(ReplLimits())
    pool = shared_pool()
    with Agent(ReplayEngine([RESPONSE], 1000), warm_repls=3, builtin_tools=False) as agent:
        assert pool.wait_loaded(spec, 3)  # other agents of this process ask for one at most
        started = pool.started
        assert agent.run_sync("t").answer == 42
        assert pool.wait_loaded(spec, 3)
        assert pool.started == started + 1  # the run took one; a fresh one replaced it
    deadline = time.monotonic() + 15
    while len(pool.idle(spec)) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(pool.idle(spec)) <= 1


def test_warm_repls_zero_reserves_nothing_and_runs():
    agent = Agent(ReplayEngine([RESPONSE], 1000), warm_repls=0, builtin_tools=False)
    assert agent._pool_lease is None
    assert agent.run_sync("t").answer == 42


def test_warm_repls_is_checked():
    with pytest.raises(ValueError, match="warm_repls must be an int >= 0, got -1"):
        Agent(ReplayEngine(["x"]), warm_repls=-1)
