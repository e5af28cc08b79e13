"""The pattern benchmark's launch cost: one entry per early call started, its segments adding up."""

from __future__ import annotations

import pytest

from benchmarks import pattern_bench
from benchmarks.patterns import patterns


def test_launch_costs_cover_every_early_call_started():
    p = next(p for p in patterns() if p.name == "map_reduce")
    run = pattern_bench.run_pattern(p, True, 400, 0.05)
    started = sum(1 for e in run.trace.events
                  if e.kind == "tool_started" and e.data.get("mode") == "early")
    costs = pattern_bench.launch_costs(run.trace)
    assert started > 0 and len(costs) == started
    for cost in costs:
        assert min(cost.values()) >= 0, cost
        assert cost["fork"] + cost["shadow"] + cost["dispatch"] == pytest.approx(cost["total"])
    summary = pattern_bench.launch_summary([{"launch_costs_ms": costs}])
    assert f"Launch cost over {started} early calls" in summary
