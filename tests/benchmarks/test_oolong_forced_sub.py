"""``--sub forced``: the simulated sub-model's answers teacher-forced through the root's native
engine, end to end through the runner, against the simulated sub-model itself."""

import asyncio
import dataclasses
import json
import os
from pathlib import Path

import pytest
from agentrt.engine.base import Delta, EngineError, Usage
from agentrt.engine.metrics import DecodeMetrics

from benchmarks.oolong import bench, runs

os.environ.setdefault("HF_HUB_OFFLINE", "1")
TINY = ["--sizes", "512", "--per-size", "1", "--types", "label_count", "--styles", "small",
        "--repeats", "1", "--no-plot"]


def _records(out: Path) -> dict[str, dict]:
    paths = (out / "traces").rglob("*.json")
    return {(r := json.loads(p.read_text()))["mode"]: r for p in paths if ".perfetto" not in p.name}


def test_forced_sub_calls_answer_as_simulated_and_are_prefilled_on_the_engine(tmp_path):
    simulated, forced = tmp_path / "simulated", tmp_path / "forced"
    assert bench.main([*TINY, "--engine", "replay", "--root-tps", "2000", "--sub-decode-tps",
                       "3000", "--out", str(simulated)]) == 0
    assert bench.main([*TINY, "--engine", "forced", "--sub", "forced", "--modes",
                       "sequential+plain,speculative+specdec", "--out", str(forced)]) == 0
    reference = next(iter(_records(simulated).values()))
    runs = _records(forced)
    assert set(runs) == {"sequential+plain", "speculative+specdec"}
    for mode, r in runs.items():
        # the same program, the same sub-call answers (digests), the same answer and score
        assert r["status"] == "final" and r["score"] == 1.0 == reference["score"]
        assert r["answer"] == reference["answer"]
        assert r["calls"] == reference["calls"] and r["calls"]
        sub = r["sub"]
        assert sub["calls"] == len(r["calls"])
        # every prompt token was run through the model or served from the prefix cache
        assert sub["prompt_tokens"] > 400 and sub["prefill_tokens"] > 0
        assert sub["prefill_tokens"] + sub["cached_tokens"] == sub["prompt_tokens"]
        assert sub["generated_tokens"] > 0
        # the drafter drafts the sub-call answers in the speculative decoding modes only
        assert (sub["draft_tokens"] > 0) == mode.endswith("+specdec")
        assert r["tau"] is not None and r["tokens"] > 0  # the root's own counters
    assert "Sub-calls on the root's engine" in (forced / "summary.md").read_text()
    assert "sub-model forced" in json.loads((forced / "summary.json").read_text())["setting"]


def test_forced_sub_needs_a_native_root(tmp_path, capsys):
    assert bench.main([*TINY, "--engine", "replay", "--sub", "forced",
                       "--out", str(tmp_path)]) == 2
    assert "--sub forced shares the root's native engine" in capsys.readouterr().err


class _Engine:
    """Stands for the native engine: each request adds its metrics to the engine's."""

    def __init__(self) -> None:
        self.total = DecodeMetrics()

    def metrics(self) -> DecodeMetrics:
        return dataclasses.replace(self.total)

    def serve(self, steps: int, accepted: int, wall_s: float) -> DecodeMetrics:
        m = DecodeMetrics(generated_tokens=steps + accepted, verify_steps=steps,
                          accepted_tokens=accepted, wall_s=wall_s)
        self.total.merge(m)
        return m

    async def stream(self, messages, params=None, *, forced_text=None):
        yield Delta(forced_text, finish_reason="stop", usage=Usage(5, 4),
                    metrics=self.serve(2, 2, 1.0))


class _Oracle:
    def reply(self, prompt: str) -> str:
        return "label"


def test_the_roots_counters_leave_out_every_forced_sub_call_on_its_engine():
    """Two runs at once on one engine: each run's root counters are its engine's less every
    forced sub-call served meanwhile, its own and the other run's."""
    engine, sub = _Engine(), runs.SubModel("forced", oracle=_Oracle())
    mine, other = sub.make_engine(engine), sub.make_engine(engine)
    before, sub_before = engine.metrics(), sub.forced_metrics(engine)

    async def run() -> None:
        for s in (mine, other, mine):
            async for _ in s.stream([{"role": "user", "content": "rows"}]):
                pass

    asyncio.run(run())
    engine.serve(steps=10, accepted=5, wall_s=2.0)  # the root's own request
    tau, tokens, wall = runs.engine_counters(before, engine.metrics(), sub_before,
                                             sub.forced_metrics(engine))
    assert (tau, tokens, wall) == (1.5, 15, 2.0)
    assert mine.counters()["calls"] == 2 and other.counters()["calls"] == 1
    assert mine.counters()["prompt_tokens"] == 10


def test_a_forced_sub_call_cut_short_is_an_error_not_another_answer():
    class Cut(_Engine):
        async def stream(self, messages, params=None, *, forced_text=None):
            yield Delta(forced_text[:2], finish_reason="length", metrics=self.serve(1, 0, 0.1))

    sub = runs.SubModel("forced", oracle=_Oracle()).make_engine(Cut())

    async def run() -> None:
        async for _ in sub.stream([{"role": "user", "content": "rows"}]):
            pass

    with pytest.raises(EngineError, match=r"ended \(length\) before the simulated answer's end"):
        asyncio.run(run())
