"""The speculation ledger: keyed early calls, in-order claims, budgets, cancellation."""

from __future__ import annotations

import time

import anyio
import pytest

from agentrt.ledger import Ledger, Origin, SpeculationBudget


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


def at(turn: int = 0, block: int = 0, epoch: int = 0, shadow: int = 1) -> Origin:
    return Origin(turn, block, 1, epoch, False, shadow)


def running(calls) -> int:
    return sum(call.state == "running" for call in calls)


def test_identical_calls_are_separate_invocations_claimed_in_order():
    async def main():
        rec = Recorder()
        async with Ledger(rec, SpeculationBudget(), time.monotonic) as ledger:
            first = ledger.launch("f", "k", (1,), {}, at())
            second = ledger.launch("f", "k", (1,), {}, at())
            assert ledger.claim("k", turn=0) is first
            assert ledger.claim("k", turn=0) is second
            assert ledger.claim("k", turn=0) is None  # a third identical call misses
            await first.done.wait()
            await second.done.wait()
            assert rec.invocations == 2
            assert first.outcome()["n"] != second.outcome()["n"]

    run(main)


def test_outcome_is_a_private_copy():
    async def main():
        async with Ledger(Recorder(0), SpeculationBudget(), time.monotonic) as ledger:
            call = ledger.launch("f", "k", (1,), {}, at())
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
            calls = [ledger.launch("f", f"k{i}", (i,), {}, at(shadow=i)) for i in range(7)]
            assert all(c is not None for c in calls[:5])
            assert calls[5] is None and calls[6] is None
            assert running(calls[:5]) == 3
            for c in calls[:5]:
                await c.done.wait()
            assert rec.peak == 3 and rec.invocations == 5
            ledger.new_turn()
            assert ledger.launch("f", "again", (0,), {}, at(turn=1)) is not None

    run(main)


def test_per_shadow_budget_refuses_only_that_shadows_launches():
    async def main():
        budget = SpeculationBudget(max_per_shadow=2)
        async with Ledger(Recorder(0), budget, time.monotonic) as ledger:
            first = [ledger.launch("f", f"a{i}", (i,), {}, at(shadow=1)) for i in range(3)]
            second = ledger.launch("f", "b", (0,), {}, at(shadow=2))
            assert [c is not None for c in first] == [True, True, False]
            assert second is not None

    run(main)


def test_argument_bytes_budget():
    async def main():
        rec = Recorder(0.05)
        budget = SpeculationBudget(max_in_flight=10, max_arg_bytes_in_flight=3000)
        async with Ledger(rec, budget, time.monotonic) as ledger:
            big = "x" * 2000
            calls = [ledger.launch("f", f"k{i}", (big,), {}, at()) for i in range(3)]
            assert running(calls) == 1  # a second 2 KB call would exceed 3 KB
            for c in calls:
                await c.done.wait()
            assert rec.peak == 1 and rec.invocations == 3

    run(main)


def test_claiming_a_queued_call_starts_it():
    async def main():
        rec = Recorder(0.2)
        budget = SpeculationBudget(max_in_flight=1)
        async with Ledger(rec, budget, time.monotonic) as ledger:
            ledger.launch("f", "a", (), {}, at())
            queued = ledger.launch("f", "b", (), {}, at())
            assert queued.state == "queued"
            assert ledger.claim("b", turn=0) is queued
            assert queued.state == "running"

    run(main)


def test_cancel_unclaimed_counts_and_stops_running_calls():
    rec = Recorder(5.0)

    async def main():
        async with Ledger(rec, SpeculationBudget(), time.monotonic) as ledger:
            a = ledger.launch("f", "a", (), {}, at(block=0))
            b = ledger.launch("f", "b", (), {}, at(block=1))
            ledger.claim("a", turn=0)
            await anyio.sleep(0.05)
            n = ledger.cancel_unclaimed(turn=0)
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
            call = ledger.launch("f", "bad", (), {}, at())
            assert ledger.claim("bad", turn=0) is call
            await call.done.wait()
            with pytest.raises(ValueError, match="bad bad"):
                call.outcome()

    run(main)


def test_claims_and_adoption_see_only_the_same_turn_and_the_live_calls():
    async def main():
        async with Ledger(Recorder(0), SpeculationBudget(), time.monotonic) as ledger:
            old = ledger.launch("f", "k", (), {}, at(epoch=0))
            new = ledger.launch("f", "k", (), {}, at(epoch=1, block=2))
            # a call of an older epoch that no effect cancelled still serves
            assert ledger.adoptable("k", turn=0, from_block=0) == [old, new]
            assert ledger.adoptable("k", turn=0, from_block=3) == []
            assert ledger.claim("k", turn=1) is None
            assert ledger.claim("k", turn=0) is old
            assert ledger.cancel_unclaimed(turn=0, keep=[new]) == 0 and new.live
            assert ledger.cancel_unclaimed(tools=["g"]) == 0 and new.live
            assert ledger.cancel_unclaimed(tools=["f"]) == 1 and not new.live
            assert ledger.adoptable("k", turn=0, from_block=0) == [old]
            assert ledger.claim("k", turn=0) is None

    run(main)


def test_settle_takes_each_unclaimed_call_once():
    async def main():
        async with Ledger(Recorder(0), SpeculationBudget(), time.monotonic) as ledger:
            calls = [ledger.launch("f", f"k{b}", (), {}, at(block=b)) for b in (0, 0, 1)]
            ledger.claim("k0", turn=0)
            assert ledger.retire(turn=0, block=0) == [calls[1]]
            assert ledger.retire() == [calls[2]]
            assert ledger.retire() == []
            assert [c.state for c in calls[1:]] == ["cancelled", "cancelled"]

    run(main)
