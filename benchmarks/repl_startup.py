"""REPL start-up side by side: without the OS jail, in the jail, and in the jail with a warm
worker from the pool; and an agent's first-block latency with and without the pool.

REPL rounds start one REPL of each kind in rotating order and time (a) ``start()`` up to a
ready namespace plus the first cell's result, and (b) ``aclose()``. Before each pooled round the
pool has had time to load its worker (as it does while a model streams its first tokens).

Agent rounds run ``Agent.run`` on a response whose first block closes with its first tokens
(``warm_repls=1`` against ``0``, alternating) and time that block from ``block_closed`` to
``exec_finished``: what the run waits for the sandbox.

Prints the per-round figures, the medians and the ratios.

    python -m benchmarks.repl_startup [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from agentrt import Agent, ReplayEngine
from agentrt.interpreter import Repl, ReplLimits
from agentrt.interpreter.repl.pool import WorkerPool, WorkerSpec, shared_pool

KINDS = ("plain", "jailed", "jailed+pool")
FIRST_BLOCK = "```repl\nFINAL(6 * 7)\n```\n"


async def _no_tools(name: str, args: tuple, kwargs: dict) -> None:
    raise LookupError(name)


async def _one(kind: str, pool: WorkerPool) -> tuple[float, float]:
    limits = ReplLimits(jail=kind != "plain")
    if kind == "jailed+pool":
        await asyncio.to_thread(pool.wait_loaded, WorkerSpec.for_limits(limits))
    repl = Repl(_no_tools, (), limits, pool=pool if kind == "jailed+pool" else None)
    started = time.perf_counter()
    await repl.start()
    result = await repl.execute("x = 1\nprint(x)")
    ready = time.perf_counter()
    assert result.ok and result.stdout == "1\n", result.error
    assert repl.warm_start == (kind == "jailed+pool")
    await repl.aclose()
    return ready - started, time.perf_counter() - ready


async def measure(rounds: int) -> dict[str, list[tuple[float, float]]]:
    """``{kind: [(start-up + first cell s, teardown s), ...]}``, kinds in rotating order."""
    pool = WorkerPool()
    pool.reserve(WorkerSpec.for_limits(ReplLimits(jail=True)), 1)
    times: dict[str, list[tuple[float, float]]] = {kind: [] for kind in KINDS}
    try:
        for kind in KINDS:  # warm-up: the jail plan (bwrap probe, filter), the import caches
            await _one(kind, pool)
        for index in range(rounds):
            for kind in KINDS[index % 3:] + KINDS[:index % 3]:
                times[kind].append(await _one(kind, pool))
    finally:
        pool.close()
    return times


async def _first_block_s(warm_repls: int) -> float:
    """Seconds the first block of a run waits from its close to its result."""
    agent = Agent(ReplayEngine([FIRST_BLOCK], tokens_per_second=1000.0), warm_repls=warm_repls,
                  speculation=False)
    with agent:
        if warm_repls:
            await asyncio.to_thread(shared_pool().wait_loaded,
                                    WorkerSpec.for_limits(agent.repl_limits))
        result = await agent.run("answer")
    assert result.answer == 42, result.error
    times = {e.kind: e.t for e in result.trace.events if e.kind in ("block_closed",
                                                                      "exec_finished")}
    return times["exec_finished"] - times["block_closed"]


async def measure_agent(rounds: int) -> dict[int, list[float]]:
    """``{warm_repls: [first-block wait s, ...]}`` for 1 and 0, alternating first."""
    waits: dict[int, list[float]] = {1: [], 0: []}
    await _first_block_s(1)
    await _first_block_s(0)
    for index in range(rounds):
        for warm in ((1, 0) if index % 2 == 0 else (0, 1)):
            waits[warm].append(await _first_block_s(warm))
    return waits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    rounds = parser.parse_args().rounds
    times = asyncio.run(measure(rounds))
    print(f"{'round':>5}  " + "  ".join(f"{kind:>12}" for kind in KINDS))
    for index in range(rounds):
        print(f"{index + 1:>5}  " + "  ".join(f"{times[kind][index][0] * 1000:>10.1f}ms"
                                              for kind in KINDS))
    for label, column in (("start-up + first cell", 0), ("teardown", 1)):
        medians = {kind: statistics.median(t[column] for t in times[kind]) for kind in KINDS}
        print(f"median {label}: " + ", ".join(f"{kind} {medians[kind] * 1000:.1f} ms"
                                              for kind in KINDS)
              + f"; jailed/plain {medians['jailed'] / medians['plain']:.2f}x, "
              f"jailed+pool/jailed {medians['jailed+pool'] / medians['jailed']:.2f}x")
    waits = asyncio.run(measure_agent(rounds))
    print(f"{'round':>5}  {'warm_repls=0':>12}  {'warm_repls=1':>12}")
    for index in range(rounds):
        print(f"{index + 1:>5}  {waits[0][index] * 1000:>10.1f}ms  "
              f"{waits[1][index] * 1000:>10.1f}ms")
    cold, warm = statistics.median(waits[0]), statistics.median(waits[1])
    print(f"median first-block wait (block closed -> result): warm_repls=0 {cold * 1000:.1f} ms, "
          f"warm_repls=1 {warm * 1000:.1f} ms, ratio {warm / cold:.2f}x")


if __name__ == "__main__":
    main()
