"""The OOLONG runner's pictures: one task's timeline in every mode, and speedup against the
replay root's speed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentrt.trace import Trace
from agentrt.trace_export import timeline


def as_trace(record: dict[str, Any]) -> Trace:
    """A run record's trace as a `Trace` again."""
    return Trace.from_dict(record["trace"])


_COLORS = {"generation": "tab:gray", "sync call": "tab:blue", "early call": "tab:orange",
           "execution": "tab:green"}
_PREFIXES = {"generation": "root tokens ", "execution": "block "}


def _spans(record: dict) -> list[tuple[str, float, float, str]]:
    """A record's timeline (`agentrt.trace_export.timeline`) as labelled, coloured bars."""
    return [(_PREFIXES.get(s.lane, "") + s.label, s.start, s.end, _COLORS[s.lane])
            for s in timeline(as_trace(record))]


def plot_timeline(out: Path, setting, tasks, modes, records) -> None:
    """The largest task whose runs all succeeded (repeat 0), one row of bars per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from .summary import succeeded

    def runs(task):
        return {m: records.get((setting.tag, task.id, m, 0)) for m in modes}

    chosen = [t for t in tasks if all(r is not None and succeeded(r) for r in runs(t).values())]
    if not chosen:
        return
    task = max(chosen, key=lambda t: t.context_tokens)
    by_mode = runs(task)
    fig, axes = plt.subplots(len(modes), 1, figsize=(10, 1.6 + 1.5 * len(modes)), sharex=True)
    axes = list(axes) if len(modes) > 1 else [axes]
    for ax, (mode, record) in zip(axes, by_mode.items()):
        spans = _spans(record)
        for i, (_, t0, t1, color) in enumerate(spans):
            ax.barh(i, max(t1 - t0, 0.02), left=t0, color=color, height=0.7)
        ax.set_yticks(range(len(spans)), [s[0] for s in spans], fontsize=5)
        ax.invert_yaxis()
        ax.set_title(f"{mode}: {record['wall_s']:.1f} s, answer {str(record['answer'])[:40]!r}",
                     fontsize=8)
    axes[-1].set_xlabel("seconds since the run started")
    axes[0].legend(handles=[Patch(color=c, label=l) for c, l in (
        ("tab:gray", "root tokens"), ("tab:blue", "sub-model call (at its statement)"),
        ("tab:orange", "early sub-model call"), ("tab:green", "block execution"))],
        fontsize=6, loc="lower right")
    fig.suptitle(f"{task.id} ({task.context_tokens} tokens, {setting.label})", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=110)
    plt.close(fig)


def plot_root_speed(path: Path, summaries, modes) -> None:
    """Tool-speculation speedup (median, 95% CI) against the replay root's token rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    levels = sorted({s.concurrency for s, _ in summaries})
    for level in levels:
        points = [(s.root_tps, summary["modes"].get(modes[1]))
                  for s, summary in summaries if s.concurrency == level]
        points = [(x, r) for x, r in points if r and r["speedup"] is not None]
        if not points:
            continue
        xs = [x for x, _ in points]
        ys = [r["speedup"] for _, r in points]
        lo = [r["speedup"] - r["ci"][0] if r["ci"] else 0 for _, r in points]
        hi = [r["ci"][1] - r["speedup"] if r["ci"] else 0 for _, r in points]
        ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3,
                    label=f"{level} task{'s' if level > 1 else ''} at once")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("root decode speed (tokens/s)")
    ax.set_ylabel(f"{modes[1]} speedup")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
