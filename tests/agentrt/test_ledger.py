"""The speculation ledger: keyed early calls, in-order claims, budgets, cancellation."""

from __future__ import annotations

import time

import anyio
import pytest

from agentrt.ledger import Ledger, SpeculationBudget


class Recorder:
    """An invoker that counts invocations and concurrency."""

    def __init__(self, delay: float = 0.05, fail: set[str] = frozenset()):
        self.delay = delay
        self.fail = fail
        self.invocations = 0
        self.running = 0
        self.peak = 0
        self.cancelled = 0

    async def __call__(self, call):
        self.invocations += 1
        n = self.invocations
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await anyio.sleep(self.delay)
        except BaseException:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
        if call.key in self.fail:
            raise ValueError(f"bad {call.key}")
        return {"key": call.key, "args": list(call.args), "n": n}


def run(coro_fn):
    return anyio.run(coro_fn)


def test_identical_calls_are_separate_invocations_claimed_in_order():
    async def main():
        rec = Recorder()
        async with Ledger(rec, SpeculationBudget(), time.monotonic) as ledger:
            first = ledger.launch("f", "k", (1,), {})
            second = ledger.launch("f", "k", (1,), {})
            assert ledger.claim("k") is first
            assert ledger.claim("k") is second
            assert ledger.claim("k") is None  # a third identical call is a miss
            await first.done.wait()
            await second.done.wait()
            assert rec.invocations == 2
            assert first.outcome()["n"] != second.outcome()["n"]

    run(main)


def test_outcome_is_a_private_copy():
    async def main():
        async with Ledger(Recorder(0), SpeculationBudget(), time.monotonic) as ledger:
            call = ledger.launch("f", "k", (1,), {})
            await call.done.wait()
            a = call.outcome()
            a["args"].append("mutated")
            assert call.outcome()["args"] == [1]

    run(main)


def test_in_flight_budget_queues_and_per_turn_budget_refuses():
    async def main():
        rec = Recorder(0.05)
        budget = SpeculationBudget(max_in_flight=3, max_per_turn=5)
        async with Ledger(rec, budget, time.monotonic) as ledger:
            calls = [ledger.launch("f", f"k{i}", (i,), {}) for i in range(7)]
            assert all(c is not None for c in calls[:5])
            assert calls[5] is None and calls[6] is None
            assert ledger.refused == 2
            assert ledger.in_flight == 3
            for c in calls[:5]:
                await c.done.wait()
            assert rec.peak == 3 and rec.invocations == 5
            ledger.new_turn()
            assert ledger.launch("f", "again", (0,), {}) is not None

    run(main)


def test_argument_bytes_budget():
    async def main():
        rec = Recorder(0.05)
        budget = SpeculationBudget(max_in_flight=10, max_arg_bytes_in_flight=3000)
        async with Ledger(rec, budget, time.monotonic) as ledger:
            big = "x" * 2000
            calls = [ledger.launch("f", f"k{i}", (big,), {}) for i in range(3)]
            assert ledger.in_flight == 1  # a second 2 KB call would exceed 3 KB
            for c in calls:
                await c.done.wait()
            assert rec.peak == 1 and rec.invocations == 3

    run(main)


def test_claiming_a_queued_call_starts_it():
    async def main():
        rec = Recorder(0.2)
        budget = SpeculationBudget(max_in_flight=1)
        async with Ledger(rec, budget, time.monotonic) as ledger:
            ledger.launch("f", "a", (), {})
            queued = ledger.launch("f", "b", (), {})
            assert queued.state == "queued"
            assert ledger.claim("b") is queued
            assert queued.state == "running"

    run(main)


def test_cancel_unclaimed_counts_and_stops_running_calls():
    rec = Recorder(5.0)

    async def main():
        async with Ledger(rec, SpeculationBudget(), time.monotonic) as ledger:
            a = ledger.launch("f", "a", (), {}, tag=(0, 0))
            b = ledger.launch("f", "b", (), {}, tag=(0, 1))
            ledger.claim("a")
            await anyio.sleep(0.05)
            n = ledger.cancel_where(lambda c: c.tag[0] == 0)
            assert n == 1 and b.state == "cancelled" and a.state == "running"
            await anyio.sleep(0.05)
            assert rec.cancelled == 1
            assert ledger.cancel(a) is False  # claimed calls are never cancelled
        # leaving the ledger stops what is still running, claimed or not
        assert rec.cancelled == 2

    t0 = time.monotonic()
    run(main)
    assert time.monotonic() - t0 < 2


def test_errors_are_kept_for_the_claimer():
    async def main():
        async with Ledger(Recorder(0, fail={"bad"}), SpeculationBudget(), time.monotonic) as ledger:
            call = ledger.launch("f", "bad", (), {})
            assert ledger.claim("bad") is call
            await call.done.wait()
            with pytest.raises(ValueError, match="bad bad"):
                call.outcome()

    run(main)
