"""Tool-speculation benchmark: every pattern, sequential vs speculative, side by side.

For each pattern of `benchmarks.patterns` it runs the real runtime twice on `ReplayEngine` (same
token rate, same tool latency) — speculation off, then on — checks that answers, printed output
and errors are identical, and reports sequential wall, speculative wall, speedup, the overlap
limit (see `benchmarks.overlap`), efficiency = limit / speculative wall, and hits / misses /
wasted. Writes JSON, a markdown table and one timeline PNG per pattern.

Launch cost: for every early call the speculative run starts, the time from the moment the code
making the call was complete (the delta that completed its line, or the block that executed
before it) to the tool's start, split into fork (until the shadow had its code), shadow (until
the runtime had its launch: the shadow's run up to the call and the hop back) and dispatch
(until the tool started). The table reports the p50 per pattern and the first early call of
each run; the summary, the p50 over all launches and the median first-call latency.
``--launch-ab`` instead runs every pattern's speculative run with and without the spare shadow
fork (`agentrt.speculation`: a fork made ahead, so a new line reaches its shadow without a
fork round trip), alternating which goes first, and prints both launch costs side by side.

``--systems agentrt,spec-ptc`` also runs the peer, spec-ptc from PyPI (`benchmarks.peer`, in its
own Python >= 3.12 virtualenv), on each pattern right after agentrt's two runs: same responses,
same replay tokens and rate, same tools and latencies. Its wall time, its speedup over agentrt's
sequential run and whether its answer, printed output and errors match that run go in the same
rows. Without the peer's virtualenv a note says so and agentrt's rows still run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from agentrt import Agent, ReplayEngine, RunResult
from agentrt.spare_fork import SpareFork
from agentrt.trace_export import timeline

from .overlap import overlap_limit
from .patterns import Pattern, patterns, tool_list
from .peer import PEER, PeerDriver, PeerUnavailable, job, peer_python

RESULTS = Path(__file__).resolve().parent / "results"
SYSTEMS = ("agentrt", PEER)


def run_pattern(p: Pattern, speculation: bool, tps: float, latency: float) -> RunResult:
    engine = ReplayEngine(p.responses, tokens_per_second=tps)
    agent = Agent(engine, tools=tool_list(p, latency), speculation=speculation,
                  max_turns=len(p.responses), builtin_tools=False)
    return agent.run_sync(f"pattern {p.name}", p.context)


def outcome(r: RunResult) -> tuple:
    """What must be identical across modes."""
    return (r.status, repr(r.answer), [(t.output, t.error) for t in r.turns])


def peer_outcome(r: RunResult) -> tuple:
    """What the peer's run must match: errors by their first line (``Type: message``)."""
    return (r.status, repr(r.answer),
            [[t.output, t.error.splitlines()[0] if t.error else None] for t in r.turns])


def peer_row(seq: RunResult, result: dict[str, Any]) -> dict[str, Any]:
    """The peer's columns of a row; a failed peer run is no speedup and not identical."""
    if result.get("error"):
        return {"peer_error": result["error"], "peer_identical": False}
    same = (result["status"], result["answer"], result["turns"]) == peer_outcome(seq)
    return {
        "peer_s": result["wall_s"],
        "peer_speedup": seq.wall_s / result["wall_s"] if same else None,
        "peer_identical": same,
        "peer_launched": result["launched"], "peer_hits": result["hits"],
        "peer_misses": result["misses"], "peer_wasted": result["wasted"],
    }


def compare(p: Pattern, tps: float, latency: float,
            peer: PeerDriver | None = None) -> dict[str, Any]:
    seq = run_pattern(p, False, tps, latency)
    spec = run_pattern(p, True, tps, latency)
    limit = overlap_limit(spec.trace, seq.trace)
    costs = launch_costs(spec.trace)
    identical = outcome(seq) == outcome(spec)
    answered = identical and seq.status == "final" and spec.status == "final"
    row = {
        "pattern": p.name,
        "note": p.note,
        "sequential_s": seq.wall_s,
        "speculative_s": spec.wall_s,
        "speedup": seq.wall_s / spec.wall_s if answered else None,  # none over failed runs
        "limit_s": limit,
        "efficiency": limit / spec.wall_s,
        "hits": spec.stats.hits,
        "misses": spec.stats.misses,
        "wasted": spec.stats.wasted,
        "retracted": spec.stats.retracted,
        "launched": spec.stats.launched,
        "hidden_s": spec.stats.hidden_s,
        "identical": identical,
        "within_bound": spec.wall_s <= seq.wall_s * 1.05 + 0.05,
        "answer": repr(spec.answer)[:80],
        "launch_costs_ms": costs,
    }
    if peer is not None:
        try:
            result = peer.run(job(p, tps, latency))
        except PeerUnavailable as exc:  # the driver died: this row (and later ones) fail
            result = {"error": str(exc)}
        row |= peer_row(seq, result)
    return row | {"_traces": (seq.trace, spec.trace)}


def launch_costs(trace) -> list[dict[str, float]]:
    """Per early call started, in launch order: the milliseconds from its code being complete
    to its tool's start (``total``), and the segments ``fork``, ``shadow`` and ``dispatch``."""
    started = {e.data["call_id"]: e.t for e in trace.events
               if e.kind == "tool_started" and e.data.get("mode") == "early"}
    costs = []
    for e in trace.events:
        if e.kind == "spec_launch" and e.data["early_id"] in started:
            code, posted = e.data["code_s"], e.data["posted_s"]
            start = started[e.data["early_id"]]
            costs.append({"total": (start - code) * 1000, "fork": (posted - code) * 1000,
                          "shadow": (e.t - posted) * 1000, "dispatch": (start - e.t) * 1000})
    return costs


def _cost_cell(costs: list[dict[str, float]]) -> str:
    if not costs:
        return "- | - |"
    return (f"{statistics.median(c['total'] for c in costs):.1f} | "
            f"{costs[0]['total']:.1f} |")


def launch_summary(rows: list[dict]) -> str:
    """The launch-cost summary line over every pattern's early calls."""
    costs = [c for r in rows for c in r.get("launch_costs_ms", [])]
    firsts = [r["launch_costs_ms"][0]["total"] for r in rows if r.get("launch_costs_ms")]
    if not costs:
        return "No early calls were started."
    parts = {k: statistics.median(c[k] for c in costs) for k in ("total", "fork", "shadow",
                                                                  "dispatch")}
    p90 = statistics.quantiles([c["total"] for c in costs], n=10)[-1] if len(costs) > 1 \
        else costs[0]["total"]
    return (f"Launch cost over {len(costs)} early calls (code complete -> tool started): p50 "
            f"{parts['total']:.1f} ms, p90 {p90:.1f} ms; p50 segments: fork {parts['fork']:.1f} "
            f"ms, shadow {parts['shadow']:.1f} ms, dispatch {parts['dispatch']:.1f} ms. First "
            f"early call of each run: median {statistics.median(firsts):.1f} ms over "
            f"{len(firsts)} runs.")


@contextlib.contextmanager
def _without_spare_fork():
    """Speculative runs in this context fork each shadow when it is needed (the old path)."""
    take = SpareFork.take
    SpareFork.take = lambda self: None
    try:
        yield
    finally:
        SpareFork.take = take


def launch_ab(chosen: list[Pattern], tps: float, latency: float) -> str:
    """Launch costs with and without the spare shadow fork, side by side (see the docstring)."""
    costs: dict[str, list[dict[str, float]]] = {"spare": [], "no spare": []}
    firsts: dict[str, list[float]] = {"spare": [], "no spare": []}
    lines = ["| pattern | first launch ms, spare | first launch ms, no spare |", "|---|---|---|"]
    for index, p in enumerate(chosen):
        row = {}
        for mode in (("spare", "no spare") if index % 2 == 0 else ("no spare", "spare")):
            with (_without_spare_fork() if mode == "no spare" else contextlib.nullcontext()):
                run = launch_costs(run_pattern(p, True, tps, latency).trace)
            costs[mode] += run
            if run:
                firsts[mode].append(run[0]["total"])
            row[mode] = f"{run[0]['total']:.1f}" if run else "-"
        lines.append(f"| {p.name} | {row['spare']} | {row['no spare']} |")
        print(lines[-1], flush=True)
    lines.append("")
    for mode in costs:
        parts = {k: statistics.median(c[k] for c in costs[mode])
                 for k in ("total", "fork", "shadow", "dispatch")}
        lines.append(f"{mode}: first early call median {statistics.median(firsts[mode]):.1f} ms "
                     f"over {len(firsts[mode])} runs; all {len(costs[mode])} launches p50 "
                     f"{parts['total']:.1f} ms (fork {parts['fork']:.1f}, shadow "
                     f"{parts['shadow']:.1f}, dispatch {parts['dispatch']:.1f})")
    ratio = statistics.median(firsts["spare"]) / statistics.median(firsts["no spare"])
    lines.append(f"first early call, spare / no spare: {ratio:.2f}x")
    return "\n".join(lines)


def plot_timeline(name: str, traces, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 4.5), sharex=True)
    for ax, trace, title in zip(axes, traces, ("sequential", "speculative")):
        rows = _spans(trace)
        for i, (label, start, end, color) in enumerate(rows):
            ax.barh(i, max(end - start, 0.01), left=start, color=color, height=0.7)
        ax.set_yticks(range(len(rows)), [r[0] for r in rows], fontsize=6)
        ax.invert_yaxis()
        ax.set_title(f"{name}: {title}", fontsize=9)
    axes[-1].set_xlabel("seconds since run start")
    from matplotlib.patches import Patch

    legend = [Patch(color=c, label=l) for c, l in (
        ("tab:gray", "generation"), ("tab:blue", "tool call (at its statement)"),
        ("tab:orange", "early tool call"), ("tab:green", "block execution"))]
    axes[0].legend(handles=legend, fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_COLORS = {"generation": "tab:gray", "sync call": "tab:blue", "early call": "tab:orange",
           "execution": "tab:green"}
_PREFIXES = {"generation": "generate ", "execution": "exec "}


def _spans(trace) -> list[tuple[str, float, float, str]]:
    """The run's timeline (`agentrt.trace_export.timeline`) as labelled, coloured bars."""
    return [(_PREFIXES.get(s.lane, "") + s.label, s.start, s.end, _COLORS[s.lane])
            for s in timeline(trace)]


def _geomean(values: list[float]) -> float:
    if not values:
        return float("nan")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(rows: list[dict], tps: float, latency: float, peer_note: str | None = None) -> str:
    with_peer = any("peer_identical" in r for r in rows)
    answered = [r for r in rows if r["speedup"] is not None]
    head = ("| pattern | sequential s | speculative s | speedup | limit s | efficiency | launched "
            "| hits | misses | wasted | retracted | identical | launch p50 ms | first launch ms |")
    if with_peer:
        head += f" {PEER} s | {PEER} speedup | {PEER} hits / launched | {PEER} identical |"
    lines = [f"Replay at {tps:g} tok/s, tool latency {latency:g} s (x0.5..x2 per tool).", "",
             head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        line = (
            f"| {r['pattern']} | {r['sequential_s']:.2f} | {r['speculative_s']:.2f} | "
            f"{_ratio(r['speedup'])} | {r['limit_s']:.2f} | {r['efficiency']:.2f} | "
            f"{r['launched']} | {r['hits']} | {r['misses']} | {r['wasted']} | {r['retracted']} | "
            f"{'yes' if r['identical'] else 'NO'} | {_cost_cell(r.get('launch_costs_ms', []))}"
        )
        if with_peer:
            line += _peer_cells(r)
        lines.append(line)
    lines += ["", f"Geometric-mean efficiency: {_geomean([r['efficiency'] for r in rows]):.3f}",
              f"Geometric-mean speedup over sequential: agentrt "
              f"{_geomean([r['speedup'] for r in answered]):.2f}x over the {len(answered)} of "
              f"{len(rows)} patterns whose runs both finished identically"]
    if with_peer:
        both = [r for r in answered if r.get("peer_speedup")]
        if both:
            lines[-1] += (f"; on the {len(both)} patterns {PEER} answered identically: agentrt "
                          f"{_geomean([r['speedup'] for r in both]):.2f}x, {PEER} "
                          f"{_geomean([r['peer_speedup'] for r in both]):.2f}x")
        lines[-1] += (f" ({len(answered) - len(both)} where {PEER} differed or failed count as no "
                      "speedup)")
    lines += ["", launch_summary(rows)]
    if peer_note:
        lines += ["", peer_note]
    return "\n".join(lines)


def _peer_cells(r: dict[str, Any]) -> str:
    if "peer_error" in r:
        return f" - | - | - | failed: {r['peer_error'][:60]} |"
    if "peer_s" not in r:
        return " - | - | - | - |"
    speedup = f"{r['peer_speedup']:.2f}x" if r["peer_speedup"] else "-"
    return (f" {r['peer_s']:.2f} | {speedup} | {r['peer_hits']} / {r['peer_launched']} | "
            f"{'yes' if r['peer_identical'] else 'NO'} |")


def start_peer(systems: list[str]) -> tuple[PeerDriver | None, str | None]:
    """The peer's driver when ``systems`` asks for it, else None; and a note when it can't run."""
    if PEER not in systems:
        return None, None
    try:
        return PeerDriver(peer_python()), None
    except PeerUnavailable as exc:
        return None, f"Note: {exc}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.run patterns", description=__doc__)
    parser.add_argument("--tokens-per-second", type=float, default=50.0)
    parser.add_argument("--latency", type=float, default=1.0, help="base tool latency, seconds")
    parser.add_argument("--only", nargs="*", help="pattern names to run")
    parser.add_argument("--out", type=Path, default=RESULTS / "patterns")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--launch-ab", action="store_true",
                        help="launch cost with and without the spare shadow fork, side by side")
    parser.add_argument("--systems", default="agentrt",
                        help=f"comma-separated, of {', '.join(SYSTEMS)}: {PEER} runs the peer from "
                             "PyPI next to agentrt (agentrt always runs: its sequential run is the "
                             "reference)")
    args = parser.parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown system(s) {unknown}; choose from {', '.join(SYSTEMS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = [p for p in patterns() if not args.only or p.name in args.only]
    if args.launch_ab:
        table = launch_ab(chosen, args.tokens_per_second, args.latency)
        (args.out / "launch_ab.md").write_text(table + "\n")
        print("\n" + table)
        return 0
    rows = []
    t0 = time.monotonic()
    peer, peer_note = start_peer(systems)
    if peer_note:
        print(peer_note, flush=True)
    try:
        for i, p in enumerate(chosen, 1):
            rows.append(_run_one(i, len(chosen), p, args, peer))
    finally:
        if peer is not None:
            peer.close()
    table = markdown(rows, args.tokens_per_second, args.latency, peer_note)
    (args.out / "patterns.md").write_text(table + "\n")
    (args.out / "patterns.json").write_text(json.dumps(
        {"tokens_per_second": args.tokens_per_second, "latency": args.latency,
         "systems": systems, "peer_note": peer_note, "rows": rows}, indent=1
    ))
    print("\n" + table)
    print(f"\nwrote {args.out} in {time.monotonic() - t0:.0f}s")
    different = [r["pattern"] for r in rows if not r["identical"]]
    slower = [r["pattern"] for r in rows if not r["within_bound"]]
    if different:
        print(f"NOT IDENTICAL: {different}")
    if slower:
        print(f"SLOWER than sequential x1.05 + 50 ms: {slower}")
    peer_different = [r["pattern"] for r in rows if r.get("peer_identical") is False]
    if peer_different:
        print(f"{PEER} not identical to agentrt's sequential run (or failed): {peer_different}")
    return 1 if different or slower else 0


def _run_one(i: int, n: int, p: Pattern, args: argparse.Namespace,
             peer: PeerDriver | None) -> dict[str, Any]:
    """Run and plot one pattern; print its line of progress."""
    row = compare(p, args.tokens_per_second, args.latency, peer)
    seq_trace, spec_trace = row.pop("_traces")
    if not args.no_plots:
        plot_timeline(p.name, (seq_trace, spec_trace), args.out / f"{p.name}.png")
    line = (f"[{i}/{n}] {p.name:22} seq {row['sequential_s']:6.2f}s  spec "
            f"{row['speculative_s']:6.2f}s  {_ratio(row['speedup']):>6}  limit {row['limit_s']:6.2f}s  "
            f"eff {row['efficiency']:.2f}  hits {row['hits']:2} miss {row['misses']:2} "
            f"waste {row['wasted']:2} retr {row['retracted']:2}  "
            f"{'same' if row['identical'] else 'DIFFERENT'}")
    if "peer_s" in row:
        line += (f"  | {PEER} {row['peer_s']:6.2f}s "
                 f"{'same' if row['peer_identical'] else 'DIFFERENT'}")
    elif "peer_error" in row:
        line += f"  | {PEER} failed: {row['peer_error'][:80]}"
    print(line, flush=True)
    return row
