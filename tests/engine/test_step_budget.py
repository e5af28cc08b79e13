"""The step token budget (`SchedulingOptions.step_token_budget`): while requests decode, a step
runs at most that many rows, so a burst's prompts prefill in chunks beside them; every output
stays the one its request gives alone (bf16 SmolLM2 on the CPU kernels)."""

from __future__ import annotations

import asyncio

import pytest

from agentrt.engine import NativeConfig, NativeEngine, SamplingParams, complete, models
from chat_prompts import PROMPTS, RULES

pytestmark = pytest.mark.anyio

LONG = [[{"role": "user", "content": f"Item {i}. {RULES}\nWhich code word goes with item {i}?"}]
        for i in (3, 5, 7)]


def _engine(budget: int | None, **options) -> NativeEngine:
    models.ensure("smollm2-135m", "bf16")
    return NativeEngine(drafter=None, max_seq_len=2048, step_token_budget=budget, **options)


async def _solo(engine, prompts, params):
    return [(await complete(engine, m, params)).token_ids for m in prompts]


async def _burst(engine, prompts, params):
    return [c.token_ids for c in await asyncio.gather(*[complete(engine, m, params) for m in prompts])]


def test_the_budget_is_an_option_of_the_scheduling_group():
    assert NativeConfig().scheduling.step_token_budget == NativeConfig().step_token_budget > 0
    assert NativeConfig(step_token_budget=None).scheduling.step_token_budget is None
    for bad in (0, -4, 2.5, True):
        with pytest.raises(ValueError, match="step_token_budget"):
            NativeConfig(step_token_budget=bad)


async def test_the_budget_bounds_the_steps_that_decode():
    # a short prompt decodes while three ~1K-token prompts of the same burst prefill (no prefix
    # cache: each prefills in full); with the budget every step that has decode rows runs at
    # most 48 rows, the prefill in chunks beside them; without it such steps run 512 rows
    params = SamplingParams(max_tokens=8)
    prompts = [PROMPTS[0], *LONG]
    steps = {}
    outputs = {}
    for budget in (48, None):
        engine = _engine(budget, prefix_cache=False)
        try:
            outputs[budget] = await _burst(engine, prompts, params)
            if budget is None:
                outputs["solo"] = await _solo(engine, prompts, params)
            steps[budget] = engine.batch_metrics().timeline
        finally:
            await engine.aclose()
    decoding = [(rows, prompt) for _, _, rows, prompt in steps[48] if rows > prompt]
    assert decoding and all(rows <= 48 for rows, _ in decoding)
    assert sum(prompt for _, prompt in decoding) > 0  # prompts prefilled beside decode rows
    assert max(rows for _, _, rows, prompt in steps[48] if rows == prompt) > 48  # none decoding
    unbounded = [rows for _, _, rows, prompt in steps[None] if rows > prompt]
    assert max(unbounded) > 48
    assert outputs[48] == outputs[None] == outputs["solo"]


@pytest.mark.parametrize("drafter", [None, "suffix"])
async def test_batched_greedy_equals_solo_with_the_budget_on(drafter):
    # a budget of 16 rows: two ~1K-token prompts prefill a few tokens per step beside the
    # short ones that already decode (their drafts count too)
    params = SamplingParams(max_tokens=12)
    prompts = [*PROMPTS[:6], *LONG[:2]]
    engine = NativeEngine(drafter=drafter, max_seq_len=2048, step_token_budget=16)
    try:
        solo = await _solo(engine, prompts, params)
        engine.reset()
        together = await _burst(engine, prompts, params)
        timeline = engine.batch_metrics().timeline
    finally:
        await engine.aclose()
    assert together == solo
    assert any(rows > prompt > 0 for _, _, rows, prompt in timeline)  # chunks beside decode rows
    assert all(rows <= 16 for _, _, rows, prompt in timeline if rows > prompt)
