"""The OOLONG runner's accounting: which runs failed, which tasks are identical, speedups with
confidence intervals, and the markdown report.

The rules (ARCHITECTURE.md, "Honest measurement"):

- a run *failed* when it ended in an error, without ``FINAL``, at ``max_turns`` or with no answer;
  failed runs count in "failed k/n" and never in a latency, a speedup or an identity;
- a task's speedup for a mode is ``median(base walls) / median(mode walls)`` over its succeeded
  repeats; the headline is the median over tasks, with a bootstrap 95% confidence interval
  (tasks resampled, and repeats within each task);
- a task is *identical* only when every run of every mode succeeded with the same ``FINAL``
  answer and the same ordered list of tool calls (tool, arguments, result);
- when nothing succeeded there is no speedup to print, and the report says so.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

BOOTSTRAP_SAMPLES = 2000

Record = dict[str, Any]


def failure(record: Record) -> str | None:
    """Why a run does not count, or None when it succeeded."""
    if record.get("status") == "error":
        return f"error: {record.get('error') or 'unknown'}"
    if record.get("status") == "max_turns":
        return "no FINAL within the turn limit"
    if record.get("status") != "final":
        return f"ended with status {record.get('status')!r}"
    if record.get("answer") in (None, ""):
        return "FINAL without an answer"
    return None


def succeeded(record: Record) -> bool:
    return failure(record) is None


def _p90(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


def _percentile(ordered: Sequence[float], q: float) -> float:
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def task_speedup(base: Sequence[float], mode: Sequence[float]) -> float:
    """One task's speedup: the median base wall time over the median mode wall time."""
    return statistics.median(base) / statistics.median(mode)


def bootstrap_ci(pairs: Sequence[tuple[Sequence[float], Sequence[float]]],
                 samples: int = BOOTSTRAP_SAMPLES, seed: int = 0) -> tuple[float, float] | None:
    """95% interval of the median per-task speedup: tasks are resampled with replacement and,
    within each task drawn, its base and mode repeats too. ``pairs``: (base walls, mode walls)
    per task. None for no task."""
    if not pairs:
        return None
    rng = random.Random(seed)
    stats = []
    for _ in range(samples):
        ratios = []
        for _ in pairs:
            base, mode = pairs[rng.randrange(len(pairs))]
            ratios.append(task_speedup(rng.choices(base, k=len(base)),
                                       rng.choices(mode, k=len(mode))))
        stats.append(statistics.median(ratios))
    stats.sort()
    return _percentile(stats, 0.025), _percentile(stats, 0.975)


def _walls(records: Iterable[Record]) -> list[float]:
    return [r["wall_s"] for r in records if succeeded(r)]


def speedups(by_task: dict[str, dict[str, list[Record]]], mode: str, base_mode: str,
             tasks: Iterable[str] | None = None) -> list[tuple[list[float], list[float]]]:
    """(base walls, mode walls) of each task where both modes have a succeeded run."""
    pairs = []
    for task in (by_task if tasks is None else tasks):
        runs = by_task.get(task, {})
        base, walls = _walls(runs.get(base_mode, [])), _walls(runs.get(mode, []))
        if base and walls:
            pairs.append((base, walls))
    return pairs


def call_list(record: Record) -> list[tuple] | None:
    """The run's tool calls in program order, (tool, arguments digest, result digest, error);
    None when the system that ran it does not record them (the peer)."""
    calls = record.get("calls")
    return None if calls is None else [tuple(c) for c in calls]


def identity(runs: dict[str, list[Record]]) -> tuple[bool, str | None]:
    """Whether every run of a task succeeded with the same answer and the same tool calls (among
    the runs that record them), and if not, why (the first difference)."""
    flat = [(mode, r) for mode, rs in runs.items() for r in rs]
    for mode, r in flat:
        if not succeeded(r):
            return False, f"{mode} repeat {r['repeat']} failed ({failure(r)})"
    mode0, first = flat[0]
    for mode, r in flat[1:]:
        if r["answer"] != first["answer"]:
            return False, f"answer {r['answer']!r} ({mode}) != {first['answer']!r} ({mode0})"
    recorded = [(mode, calls) for mode, r in flat if (calls := call_list(r)) is not None]
    for mode, calls in recorded[1:]:
        mode0, calls0 = recorded[0]
        if calls != calls0:
            at = next((i for i, (a, b) in enumerate(zip(calls, calls0)) if a != b),
                      min(len(calls), len(calls0)))
            return False, (f"tool calls differ from call {at} on ({mode}: {len(calls)} calls, "
                           f"{mode0}: {len(calls0)} calls)")
    return True, None


def _median_or_none(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _breakdown(by_task: dict[str, dict[str, list[Record]]], modes: Sequence[str], base_mode: str,
               key: Callable[[Record], Any]) -> dict[str, dict[str, float]]:
    """Median per-task speedup of each mode, for the tasks grouped by ``key``."""
    groups: dict[Any, list[str]] = defaultdict(list)
    for task, runs in by_task.items():
        some = next(r for rs in runs.values() for r in rs)
        groups[key(some)].append(task)
    out: dict[str, dict[str, float]] = {}
    for group in sorted(groups, key=str):
        row = {}
        for mode in modes:
            pairs = speedups(by_task, mode, base_mode, groups[group])
            if pairs:
                row[mode] = statistics.median(task_speedup(b, m) for b, m in pairs)
        if row:
            out[str(group)] = row
    return out


def summarise(records: Sequence[Record], modes: Sequence[str], base_mode: str,
              limit: Callable[[Record, Record], float] | None = None) -> dict[str, Any]:
    """The summary of one setting's runs (one record per task, mode and repeat)."""
    by_task: dict[str, dict[str, list[Record]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        by_task[r["task"]][r["mode"]].append(r)
    rows: dict[str, dict[str, Any]] = {}
    for mode in modes:
        runs = [r for r in records if r["mode"] == mode]
        if not runs:
            continue
        good = [r for r in runs if succeeded(r)]
        pairs = speedups(by_task, mode, base_mode)
        per_task = [task_speedup(b, m) for b, m in pairs]
        ci = bootstrap_ci(pairs) if mode != base_mode else None
        limits, effs = [], []
        if limit is not None and mode.startswith("speculative+"):
            twin = "sequential+" + mode.split("+")[1]
            for task, task_runs in by_task.items():
                for r in task_runs.get(mode, []):
                    seq = next((s for s in task_runs.get(twin, [])
                                if s["repeat"] == r["repeat"] and succeeded(s)), None)
                    if seq is not None and succeeded(r):
                        value = limit(r, seq)
                        limits.append(value)
                        effs.append(value / r["wall_s"])
        taus = [r["tau"] for r in good if r.get("tau")]
        toks = [r["tok_s"] for r in good if r.get("tok_s")]
        walls = _walls(runs)
        rows[mode] = {
            "runs": len(runs), "failed": len(runs) - len(good),
            "median_s": _median_or_none(walls), "p90_s": _p90(walls) if walls else None,
            "speedup": _median_or_none(per_task), "tasks": len(per_task),
            "ci": list(ci) if ci else None,
            "limit_s": _median_or_none(limits), "efficiency": _median_or_none(effs),
            "score": statistics.mean(r["score"] if succeeded(r) else 0.0 for r in runs),
            "hits": sum(r["stats"].get("hits", 0) for r in good),
            "wasted": sum(r["stats"].get("wasted", 0) for r in good),
            "retracted": sum(r["stats"].get("retracted", 0) for r in good),
            "tau": statistics.mean(taus) if taus else None,
            "tok_s": _median_or_none(toks),
            "sub": _sub_calls(good),
        }
    identical, differing, incomplete = 0, [], []
    for task, runs in by_task.items():
        if set(runs) != set(modes):
            continue
        same, why = identity(runs)
        if same:
            identical += 1
        elif all(succeeded(r) for rs in runs.values() for r in rs):
            differing.append({"task": task, "why": why})
        else:
            incomplete.append({"task": task, "why": why})
    failures: dict[str, int] = defaultdict(int)
    for r in records:
        if (why := failure(r)) is not None:
            failures[why.split("\n")[0][:160]] += 1
    return {
        "modes": rows,
        "sizes": _breakdown(by_task, modes, base_mode, lambda r: size_label(r["context_tokens"])),
        "shapes": _breakdown(by_task, modes, base_mode, lambda r: r["shape"]),
        "turns": _breakdown(by_task, modes, base_mode, lambda r: r["turns_n"]),
        "tasks": len(by_task), "runs": len(records),
        "succeeded_runs": sum(succeeded(r) for r in records),
        "identical": identical, "compared": identical + len(differing),
        "differing": differing, "incomplete": incomplete,
        "failures": dict(sorted(failures.items(), key=lambda kv: -kv[1])),
    }


SUB_COUNTERS = ("calls", "prompt_tokens", "prefill_tokens", "cached_tokens", "generated_tokens")


def _sub_calls(good: Sequence[Record]) -> dict[str, float | None] | None:
    """Sub-calls served on the root's engine (``--sub forced``): the median per succeeded run of
    each counter, and τ over all of them; None when the runs have no such counters."""
    subs = [r["sub"] for r in good if r.get("sub")]
    if not subs:
        return None
    out: dict[str, float | None] = {k: statistics.median(s[k] for s in subs) for k in SUB_COUNTERS}
    steps = sum(s["verify_steps"] for s in subs)
    out["tau"] = (sum(s["accepted_tokens"] for s in subs) + steps) / steps if steps else None
    return out


def size_label(tokens: int) -> str:
    """The context size rounded to a power of two: 4105 tokens -> '4K'."""
    return f"{2 ** round(math.log2(max(1, tokens))) / 1024:g}K"


def any_speedup(summary: dict[str, Any]) -> bool:
    return any(row["speedup"] is not None for mode, row in summary["modes"].items()
               if row["tasks"])


# ------------------------------------------------------------------------------ markdown

def _f(value: Any, fmt: str, none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def _speedup_cell(row: dict[str, Any]) -> str:
    if row["speedup"] is None:
        return "-"
    return f"{row['speedup']:.2f}x"


def _ci_cell(row: dict[str, Any]) -> str:
    return "-" if not row["ci"] else f"{row['ci'][0]:.2f}-{row['ci'][1]:.2f}x"


def markdown(summary: dict[str, Any], heading: str) -> str:
    """One setting's report."""
    lines = [heading, ""]
    if not summary["succeeded_runs"]:
        lines += [f"**No run succeeded** ({summary['runs']} runs, all failed): no speedup and no "
                  "identity are reported.", ""]
    lines += ["| mode | failed | median s | p90 s | speedup | 95% CI | tasks | limit s | "
              "efficiency | score | hits | wasted | retracted | tau | tok/s |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, r in summary["modes"].items():
        lines.append(
            f"| {mode} | {r['failed']}/{r['runs']} | {_f(r['median_s'], '.2f')} | "
            f"{_f(r['p90_s'], '.2f')} | {_speedup_cell(r)} | {_ci_cell(r)} | {r['tasks']} | "
            f"{_f(r['limit_s'], '.2f')} | {_f(r['efficiency'], '.2f')} | {r['score']:.2f} | "
            f"{r['hits']} | {r['wasted']} | {r['retracted']} | {_f(r['tau'], '.2f')} | "
            f"{_f(r['tok_s'], '.1f')} |")
    subs = {m: r["sub"] for m, r in summary["modes"].items() if r.get("sub")}
    if subs:
        lines += ["", "Sub-calls on the root's engine (median per succeeded run; tau over all):", "",
                  "| mode | calls | prompt tokens | prefilled | from prefix cache | answer tokens "
                  "| tau |", "|---|---|---|---|---|---|---|"]
        for mode, c in subs.items():
            lines.append(f"| {mode} | {c['calls']:g} | {c['prompt_tokens']:g} | "
                         f"{c['prefill_tokens']:g} | {c['cached_tokens']:g} | "
                         f"{c['generated_tokens']:g} | {_f(c['tau'], '.2f')} |")
    modes = list(summary["modes"])
    for title, key in (("context size", "sizes"), ("call shape", "shapes"),
                       ("root turns", "turns")):
        table = summary[key]
        if len(table) < 2:
            continue
        lines += ["", f"Median per-task speedup by {title}:", "",
                  f"| {title} | " + " | ".join(modes) + " |", "|---|" + "---|" * len(modes)]
        for group, by_mode in table.items():
            lines.append(f"| {group} | " + " | ".join(
                _f(by_mode.get(m), ".2f") + ("x" if by_mode.get(m) is not None else "")
                for m in modes) + " |")
    lines.append("")
    if summary["compared"]:
        lines.append(f"Identical answers and tool calls across every mode and repeat: "
                     f"{summary['identical']}/{summary['compared']} tasks whose runs all "
                     f"succeeded.")
    else:
        lines.append("Identity not assessed: no task succeeded in every run of every mode.")
    for d in summary["differing"]:
        lines.append(f"- differs: {d['task']}: {d['why']}")
    if summary["incomplete"]:
        lines.append(f"Tasks with a failed run (not compared): {len(summary['incomplete'])}.")
    if summary["failures"]:
        lines += ["", "Why runs failed:"]
        lines += [f"- {n} x {why}" for why, n in list(summary["failures"].items())[:8]]
    return "\n".join(lines)
