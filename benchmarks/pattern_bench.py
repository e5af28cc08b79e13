"""Tool-speculation benchmark: every pattern, sequential vs speculative, side by side.

For each pattern of `benchmarks.patterns` it runs the real runtime twice on `ReplayEngine` (same
token rate, same tool latency) — speculation off, then on — checks that answers, printed output
and errors are identical, and reports sequential wall, speculative wall, speedup, the overlap
limit (see `benchmarks.overlap`), efficiency = limit / speculative wall, and hits / misses /
wasted. Writes JSON, a markdown table and one timeline PNG per pattern.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from agentrt import Agent, ReplayEngine, RunResult

from .overlap import generation_spans, overlap_limit
from .patterns import Pattern, patterns, tool_list

RESULTS = Path(__file__).resolve().parent / "results"


def run_pattern(p: Pattern, speculation: bool, tps: float, latency: float) -> RunResult:
    engine = ReplayEngine(p.responses, tokens_per_second=tps)
    agent = Agent(engine, tools=tool_list(p, latency), speculation=speculation,
                  max_turns=len(p.responses), builtin_tools=False)
    return agent.run_sync(f"pattern {p.name}", p.context)


def outcome(r: RunResult) -> tuple:
    """What must be identical across modes."""
    return (r.status, repr(r.answer), [(t.output, t.error) for t in r.turns])


def compare(p: Pattern, tps: float, latency: float) -> dict[str, Any]:
    seq = run_pattern(p, False, tps, latency)
    spec = run_pattern(p, True, tps, latency)
    limit = overlap_limit(spec.trace, seq.trace)
    row = {
        "pattern": p.name,
        "note": p.note,
        "sequential_s": seq.wall_s,
        "speculative_s": spec.wall_s,
        "speedup": seq.wall_s / spec.wall_s,
        "limit_s": limit,
        "efficiency": limit / spec.wall_s,
        "hits": spec.stats.hits,
        "misses": spec.stats.misses,
        "wasted": spec.stats.wasted,
        "retracted": spec.stats.retracted,
        "launched": spec.stats.launched,
        "hidden_s": spec.stats.hidden_s,
        "identical": outcome(seq) == outcome(spec),
        "within_bound": spec.wall_s <= seq.wall_s * 1.05 + 0.05,
        "answer": repr(spec.answer)[:80],
    }
    return row | {"_traces": (seq.trace, spec.trace)}


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


def _spans(trace) -> list[tuple[str, float, float, str]]:
    rows: list[tuple[str, float, float, str]] = []
    for turn, (start, end) in generation_spans(trace).items():
        rows.append((f"generate t{turn}", start, end, "tab:gray"))
    started: dict[tuple, float] = {}
    for e in trace.events:
        key = (e.data.get("mode"), e.data.get("call_id"))
        if e.kind == "tool_started":
            started[key] = e.t
        elif e.kind == "tool_finished" and key in started:
            color = "tab:orange" if e.data.get("mode") == "early" else "tab:blue"
            rows.append((f"{e.data['tool']}", started.pop(key), e.t, color))
        elif e.kind == "exec_started":
            started[("exec", e.data["turn"], e.data["block"])] = e.t
        elif e.kind == "exec_finished":
            t0 = started.pop(("exec", e.data["turn"], e.data["block"]), e.t)
            rows.append((f"exec t{e.data['turn']}b{e.data['block']}", t0, e.t, "tab:green"))
    return rows


def markdown(rows: list[dict], tps: float, latency: float) -> str:
    lines = [
        f"Replay at {tps:g} tok/s, tool latency {latency:g} s (x0.5..x2 per tool).",
        "",
        "| pattern | sequential s | speculative s | speedup | limit s | efficiency | launched | hits | misses | wasted | retracted | identical |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['pattern']} | {r['sequential_s']:.2f} | {r['speculative_s']:.2f} | "
            f"{r['speedup']:.2f}x | {r['limit_s']:.2f} | {r['efficiency']:.2f} | "
            f"{r['launched']} | {r['hits']} | {r['misses']} | {r['wasted']} | {r['retracted']} | "
            f"{'yes' if r['identical'] else 'NO'} |"
        )
    geo = math.exp(sum(math.log(r["efficiency"]) for r in rows) / len(rows))
    lines += ["", f"Geometric-mean efficiency: {geo:.3f}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="benchmarks.run patterns", description=__doc__)
    parser.add_argument("--tokens-per-second", type=float, default=50.0)
    parser.add_argument("--latency", type=float, default=1.0, help="base tool latency, seconds")
    parser.add_argument("--only", nargs="*", help="pattern names to run")
    parser.add_argument("--out", type=Path, default=RESULTS / "patterns")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = [p for p in patterns() if not args.only or p.name in args.only]
    rows = []
    t0 = time.monotonic()
    for i, p in enumerate(chosen, 1):
        row = compare(p, args.tokens_per_second, args.latency)
        seq_trace, spec_trace = row.pop("_traces")
        if not args.no_plots:
            plot_timeline(p.name, (seq_trace, spec_trace), args.out / f"{p.name}.png")
        rows.append(row)
        print(
            f"[{i}/{len(chosen)}] {p.name:22} seq {row['sequential_s']:6.2f}s  spec "
            f"{row['speculative_s']:6.2f}s  {row['speedup']:5.2f}x  limit {row['limit_s']:6.2f}s  "
            f"eff {row['efficiency']:.2f}  hits {row['hits']:2} miss {row['misses']:2} "
            f"waste {row['wasted']:2} retr {row['retracted']:2}  "
            f"{'same' if row['identical'] else 'DIFFERENT'}",
            flush=True,
        )
    table = markdown(rows, args.tokens_per_second, args.latency)
    (args.out / "patterns.md").write_text(table + "\n")
    (args.out / "patterns.json").write_text(json.dumps(
        {"tokens_per_second": args.tokens_per_second, "latency": args.latency, "rows": rows}, indent=1
    ))
    print("\n" + table)
    print(f"\nwrote {args.out} in {time.monotonic() - t0:.0f}s")
    different = [r["pattern"] for r in rows if not r["identical"]]
    slower = [r["pattern"] for r in rows if not r["within_bound"]]
    if different:
        print(f"NOT IDENTICAL: {different}")
    if slower:
        print(f"SLOWER than sequential x1.05 + 50 ms: {slower}")
    return 1 if different or slower else 0
