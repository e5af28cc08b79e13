"""`evaluate`: how often a trained head's drafts are accepted, per draft position, on prompts it
was not trained on (``agentrt draft eval``)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..base import SamplingParams
from ..metrics import DecodeMetrics
from .head import HeadConfig, head_dir
from .training_prompts import training_prompts

HELDOUT_SEED = 7919
"""Seed of the held-out prompt draw (training recipes use small seeds)."""


@dataclass
class EvalReport:
    """Acceptance of a head's drafts on held-out prompts (greedy, fixed draft length): the
    engine's `DecodeMetrics` of the whole evaluation."""

    head: str
    prompts: int
    draft_tokens: int
    metrics: DecodeMetrics = field(default_factory=DecodeMetrics)
    wall_s: float = 0.0

    @property
    def acceptance(self) -> list[float]:
        """Per position i: the share of drafts with a token i whose tokens 0..i were all
        accepted."""
        return self.metrics.position_acceptance

    @property
    def conditional(self) -> list[float]:
        """Per position i: the share of drafts with tokens 0..i-1 accepted whose token i was
        accepted too."""
        m = self.metrics
        reached = m.drafted_per_position[:1] + m.accepted_per_position[:-1]
        return [a / r if r else 0.0 for a, r in zip(m.accepted_per_position, reached)]

    @property
    def mean_accepted(self) -> float:
        """Tokens per verify step (accepted drafts + the target's own token)."""
        m = self.metrics
        return m.generated_tokens / m.verify_steps if m.verify_steps else 0.0


def heldout_prompts(count: int, exclude: list | None = None):
    """``count`` prompts of the training mix's kinds drawn with another seed, none equal to a
    prompt in ``exclude`` (the training prompts)."""
    seen = {json.dumps(m, sort_keys=True) for _, m in (exclude or [])}
    drawn = training_prompts(count + len(seen), HELDOUT_SEED)
    return [(k, m) for k, m in drawn if json.dumps(m, sort_keys=True) not in seen][:count]


def evaluate(model: str = "smollm2-135m", head: str | Path | None = None, *, prompts: int = 24,
             draft_tokens: int = 6, max_tokens: int = 96, precision: str = "exact",
             threads: int | None = None) -> EvalReport:
    """Generate greedily on ``prompts`` held-out prompts with the head drafting
    ``draft_tokens`` tokens every step, and count acceptance per position."""
    from ..native import NativeEngine
    from .train import RECIPES

    path = Path(head) if head is not None else head_dir(model)
    config = HeadConfig.from_json(json.loads((path / "config.json").read_text()))
    recipe = RECIPES.get(config.recipe)
    exclude = training_prompts(recipe.prompts, recipe.seed, recipe.mix) if recipe else []
    chosen = heldout_prompts(prompts, exclude)
    engine = NativeEngine(model, drafter="eagle", draft_head=path, draft_tokens=draft_tokens,
                          precision=precision, threads=threads)
    report = EvalReport(str(path), len(chosen), draft_tokens)

    async def one(messages) -> None:
        async for _ in engine.stream(messages, SamplingParams(max_tokens=max_tokens)):
            pass

    async def run() -> None:
        await asyncio.gather(*(one(m) for _, m in chosen))

    start = time.perf_counter()
    try:
        asyncio.run(run())
    finally:
        engine.close()
    report.wall_s = time.perf_counter() - start
    report.metrics = engine.metrics()
    return report


def format_report(report: EvalReport) -> str:
    """The report as printed by ``agentrt draft eval``."""
    m = report.metrics
    lines = [f"head {report.head}: {report.prompts} held-out prompts, {report.draft_tokens} "
             f"drafted tokens per step, {m.generated_tokens} tokens in "
             f"{m.verify_steps} verify steps ({report.wall_s:.1f} s)",
             f"mean accepted length (tokens per verify step): {report.mean_accepted:.2f}",
             "position  drafted  accepted  acceptance  given the earlier ones"]
    for i, (d, a, r, c) in enumerate(zip(m.drafted_per_position, m.accepted_per_position,
                                         report.acceptance, report.conditional)):
        lines.append(f"{i + 1:8d} {d:8d} {a:9d} {r:11.3f} {c:23.3f}")
    return "\n".join(lines)
