"""What large tool payloads cost the runtime (the host process) in memory.

Each scenario runs one agent run (ReplayEngine, real sandbox workers) in a fresh Python process
and measures that process:

* ``args``: the model's code passes ``count`` distinct arguments of ``mb`` MB each to a pure,
  speculatable tool, so the shadow interpreter launches them early (or, past the speculation
  caps, the calls run when their statements execute). Host RSS before the run, right after it
  returns (no ``gc.collect()``: what a long-lived process keeps), after a collection, and the
  peak during the run. ``args`` has a dozen 15 MB arguments under the default caps,
  ``args-uncapped`` the same with caps raised so that all of them launch early, ``args-small``
  a dozen 3 MB arguments (under the default caps).
* ``result``: a tool returns a string of ``mb`` MB (through the authoritative run, ``sync``, or
  through an early call that the shadow receives and the run claims, ``early``). The host's peak
  RSS above its level before the run, and the peak of Python allocations (``tracemalloc``, in a
  second process), each relative to the payload.

Peak RSS is the kernel's high-water mark (``VmHWM``), reset before the run through
``/proc/self/clear_refs``; where that is not allowed, a thread samples ``VmRSS`` every 2 ms.

    python -m benchmarks.host_memory [--only NAME]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import subprocess
import sys
import threading
import time
import tracemalloc
from typing import Any

MB = 1_000_000

SCENARIOS: dict[str, dict[str, Any]] = {
    "args": {"kind": "args", "count": 12, "mb": 15},
    "args-uncapped": {"kind": "args", "count": 12, "mb": 15,
                      "budget": {"max_arg_bytes_per_launch": 16 * MB,
                                 "max_arg_bytes_per_run": 256 * MB}},
    "args-small": {"kind": "args", "count": 12, "mb": 3},
    "result-sync": {"kind": "result", "mb": 120, "speculate": False},
    "result-early": {"kind": "result", "mb": 120, "speculate": True},
}


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def rss_mb() -> float:
    """The process's resident set now, in MB."""
    return _status_kb("VmRSS") * 1024 / MB


class PeakRss:
    """The peak RSS of this process from ``start()``: the kernel's high-water mark when it can
    be reset, else a sampling thread's maximum."""

    def __init__(self) -> None:
        self._sampled = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.method = ""

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")
            self.method = "VmHWM"
        except OSError:
            self.method = "sampled"
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._sampled = max(self._sampled, rss_mb())
            time.sleep(0.002)

    def peak_mb(self) -> float:
        if self._thread is None:
            return _status_kb("VmHWM") * 1024 / MB
        self._stop.set()
        self._thread.join()
        return max(self._sampled, rss_mb())


def _args_code(count: int, mb: int) -> str:
    lines = ["out = []"]
    lines += [f"out.append(size({chr(65 + i)!r} * {mb * MB}))" for i in range(count)]
    lines.append("FINAL(sum(out))")
    return "```repl\n" + "\n".join(lines) + "\n```"


def run_args(count: int, mb: int, budget: dict[str, int]) -> dict[str, Any]:
    """Speculated arguments: RSS before, right after, after gc, and the peak. ``budget``:
    `SpeculationBudget` fields to set (those this version has)."""
    from agentrt import Agent, ReplayEngine, SpeculationBudget, tool

    known = {f.name for f in dataclasses.fields(SpeculationBudget)}
    caps = SpeculationBudget(**{k: v for k, v in budget.items() if k in known})

    @tool(speculate=True, pure=True)
    async def size(text: str) -> int:
        """The length of ``text``."""
        return len(text)

    agent = Agent(ReplayEngine([_args_code(count, mb)], tokens_per_second=200), tools=[size],
                  builtin_tools=False, warm_repls=0, speculation_budget=caps)
    gc.collect()
    before = rss_mb()
    peak = PeakRss()
    peak.start()
    result = agent.run_sync("sum the sizes")
    after = rss_mb()
    top = peak.peak_mb()
    events = [e.kind for e in result.trace.events]
    stats = result.stats
    answer, status = result.answer, result.status
    del result
    gc.collect()
    return {"status": status, "answer_ok": answer == count * mb * MB,
            "launched": stats.launched, "hits": stats.hits, "misses": stats.misses,
            "too_large": events.count("spec_too_large"),
            "rss_before": before, "rss_after": after, "rss_after_gc": rss_mb(),
            "rss_peak": top, "payload_mb": count * mb, "peak_method": peak.method}


def run_result(mb: int, speculate: bool, trace_python: bool) -> dict[str, Any]:
    """A large tool result: the host's peak above its level before the run."""
    from agentrt import Agent, ReplayEngine, tool

    size = mb * MB

    @tool(speculate=speculate, pure=speculate)
    async def fetch(name: str) -> str:
        """A large document."""
        await _pause(speculate)
        return "x" * size

    code = "```repl\ndoc = fetch('a')\nprint(len(doc))\nFINAL(len(doc))\n```"
    agent = Agent(ReplayEngine([code], tokens_per_second=30), tools=[fetch],
                  builtin_tools=False, warm_repls=0)
    gc.collect()
    before = rss_mb()
    if trace_python:
        tracemalloc.start()
    peak = PeakRss()
    peak.start()
    result = agent.run_sync("measure the document")
    top = peak.peak_mb()
    out: dict[str, Any] = {"status": result.status, "answer_ok": result.answer == size,
                           "launched": result.stats.launched, "hits": result.stats.hits,
                           "payload_mb": mb, "peak_method": peak.method}
    if trace_python:
        _, traced = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out["traced_peak"] = traced / MB
    else:
        out["rss_before"], out["rss_peak"] = before, top
    return out


async def _pause(speculate: bool) -> None:
    """An early call finishes while its shadow still runs (its result is delivered to it)."""
    import anyio

    await anyio.sleep(0.05 if speculate else 0.0)


def _child(name: str, trace_python: bool) -> dict[str, Any]:
    spec = SCENARIOS[name]
    if spec["kind"] == "args":
        return run_args(spec["count"], spec["mb"], spec.get("budget", {}))
    return run_result(spec["mb"], spec["speculate"], trace_python)


def _in_subprocess(name: str, trace_python: bool = False) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.host_memory", "--child", name]
    if trace_python:
        command.append("--tracemalloc")
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"scenario {name} failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=sorted(SCENARIOS))
    parser.add_argument("--child", choices=sorted(SCENARIOS), help=argparse.SUPPRESS)
    parser.add_argument("--tracemalloc", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.tracemalloc)))
        return
    names = [args.only] if args.only else list(SCENARIOS)
    for name in names:
        spec = SCENARIOS[name]
        if spec["kind"] == "args":
            r = _in_subprocess(name)
            print(f"{name}: {spec['count']} speculated arguments of {spec['mb']} MB "
                  f"({r['status']}, answer {'ok' if r['answer_ok'] else 'WRONG'}; "
                  f"launched early {r['launched']}, hits {r['hits']}, misses {r['misses']}, "
                  f"spec_too_large events {r['too_large']})")
            print(f"  host RSS before {r['rss_before']:.0f} MB, right after the run "
                  f"{r['rss_after']:.0f} MB ({r['rss_after'] / r['rss_before']:.2f}x), after "
                  f"gc {r['rss_after_gc']:.0f} MB; peak {r['rss_peak']:.0f} MB "
                  f"({r['peak_method']}), {(r['rss_peak'] - r['rss_before']) / r['payload_mb']:.2f}x"
                  f" the {r['payload_mb']} MB of arguments above the level before")
        else:
            r = _in_subprocess(name)
            t = _in_subprocess(name, trace_python=True)
            grown = r["rss_peak"] - r["rss_before"]
            print(f"{name}: a {spec['mb']} MB tool result ({r['status']}, answer "
                  f"{'ok' if r['answer_ok'] and t['answer_ok'] else 'WRONG'}; launched early "
                  f"{r['launched']}, hits {r['hits']})")
            print(f"  host peak RSS {grown:.0f} MB above the level before "
                  f"({r['peak_method']}): {grown / spec['mb']:.2f}x the payload; Python "
                  f"allocations peak (tracemalloc) {t['traced_peak']:.0f} MB: "
                  f"{t['traced_peak'] / spec['mb']:.2f}x")


if __name__ == "__main__":
    main()
