"""REPL start-up with the sandbox's OS jail against without it, side by side.

Each round starts one REPL of each kind in alternating order and times (a) ``start()`` up to
a ready namespace plus the first cell's result, and (b) ``aclose()``. Prints the per-round
figures, the medians and the jailed/plain ratios.

    python -m benchmarks.repl_startup [--rounds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from agentrt.interpreter import Repl, ReplLimits


async def _no_tools(name: str, args: tuple, kwargs: dict) -> None:
    raise LookupError(name)


async def _one(jail: bool) -> tuple[float, float]:
    repl = Repl(_no_tools, (), ReplLimits(jail=jail))
    started = time.perf_counter()
    await repl.start()
    result = await repl.execute("x = 1\nprint(x)")
    ready = time.perf_counter()
    assert result.ok and result.stdout == "1\n", result.error
    await repl.aclose()
    return ready - started, time.perf_counter() - ready


async def measure(rounds: int) -> dict[bool, list[tuple[float, float]]]:
    """``{jailed: [(start-up s, teardown s), ...]}``, both kinds alternating first."""
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    await _one(True)  # warm-up: the jail plan (bwrap probe, filter) and the import caches
    await _one(False)
    for index in range(rounds):
        order = (True, False) if index % 2 == 0 else (False, True)
        for jailed in order:
            times[jailed].append(await _one(jailed))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    rounds = parser.parse_args().rounds
    times = asyncio.run(measure(rounds))
    print(f"{'round':>5}  {'plain start':>12}  {'jailed start':>12}  {'ratio':>6}")
    for index, (plain, jailed) in enumerate(zip(times[False], times[True]), 1):
        print(f"{index:>5}  {plain[0] * 1000:>10.1f}ms  {jailed[0] * 1000:>10.1f}ms  "
              f"{jailed[0] / plain[0]:>6.2f}")
    for label, column in (("start-up + first cell", 0), ("teardown", 1)):
        plain = statistics.median(t[column] for t in times[False])
        jailed = statistics.median(t[column] for t in times[True])
        print(f"median {label}: plain {plain * 1000:.1f} ms, jailed {jailed * 1000:.1f} ms, "
              f"ratio {jailed / plain:.2f}x")


if __name__ == "__main__":
    main()
