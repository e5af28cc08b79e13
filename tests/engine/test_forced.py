"""Forced text (`ForcedEngine`: scripted replies teacher-forced through the native engine) and
`NativeEngine.reset`, on the real SmolLM2-135M (bf16, CPU kernels)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Sequence

import pytest

from agentrt import Agent
from agentrt.engine import (
    EngineError, ForcedEngine, NativeEngine, SamplingParams, complete, models,
)
from agentrt.engine.draft_policy import AdaptiveK, StepCosts
from agentrt.engine.drafters import Draft, DrafterDefaults

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.anyio

CODE = (
    "Sure — here is the program:\n"
    "```repl\n"
    "def größe(rows):\n"
    '    """Counts per label → dict (π ≈ 3.14, 日本語 🙂)."""\n'
    "    counts = {}\n"
    "    for row in rows:\n"
    "\tcounts[row] = counts.get(row, 0) + 1\n"
    "    return counts\n"
    "print(größe(['a', 'b', 'a']))\n"
    "```\n"
)
TWICE = CODE + "And once more:\n" + CODE
ASK = [{"role": "user", "content": "Write a Python function that counts labels."}]


@pytest.fixture(scope="module")
def plain():
    models.ensure("smollm2-135m", "bf16")
    eng = NativeEngine(drafter=None, max_seq_len=1024)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def suffix():
    eng = NativeEngine(drafter="suffix", draft_tokens=4, max_seq_len=1024)
    yield eng
    eng.close()


async def forced(engine: NativeEngine, text: str, messages=ASK, params: SamplingParams | None = None):
    return await complete(ForcedEngine(engine, [text]), messages, params)


# ----------------------------------------------------------------------------- forced text

async def test_plain_forced_stream_is_the_script_one_step_per_token(plain):
    deltas = [d async for d in ForcedEngine(plain, [CODE]).stream(ASK)]
    text = "".join(d.text for d in deltas)
    last = deltas[-1]
    assert text == CODE
    assert len(deltas) > 10  # streamed piece by piece, not in one chunk
    assert last.finish_reason == "stop"
    script = plain.tokenizer.encode(CODE)
    assert [t for d in deltas for t in d.token_ids] == script
    m = last.metrics
    assert last.usage.completion_tokens == m.generated_tokens == len(script) + 1  # + end of turn
    assert m.tau == 1.0 and m.draft_tokens == 0
    assert m.verify_steps == len(script)  # the first token comes with the prompt's prefill


async def test_forced_request_reads_the_real_prompt(plain):
    plain.reset()
    long_ask = [{"role": "system", "content": "You write Python. " * 30}, *ASK]
    for messages in (ASK, long_ask):
        out = await forced(plain, "ok", messages)
        n = len(plain.tokenizer.encode_chat(messages))
        assert out.usage.prompt_tokens == n
        assert out.metrics.prefill_tokens + out.metrics.cached_tokens == n
        assert out.text == "ok"
    assert n > 100


async def test_a_chunk_that_stops_one_short_counts_the_last_prompt_token_as_prefill(suffix):
    """A prompt whose chunks end one token before its end runs that token as a decode row:
    it still counts as prefilled, draws no draft and is no verify step."""
    n = len(suffix.tokenizer.encode_chat(ASK))
    eng = NativeEngine(drafter="suffix", draft_tokens=4, max_seq_len=1024, prefill_chunk=n - 1,
                       prefix_cache=False)
    try:
        out = await complete(ForcedEngine(eng, [CODE]), ASK)
    finally:
        eng.close()
    m = out.metrics
    assert out.text == CODE
    assert m.prefill_tokens == n and m.cached_tokens == 0
    assert m.generated_tokens == len(suffix.tokenizer.encode(CODE)) + 1
    assert m.verify_steps + m.accepted_tokens == m.generated_tokens - 1


async def test_max_tokens_stop_strings_and_bad_scripts(plain):
    script = plain.tokenizer.encode(CODE)
    cut = await forced(plain, CODE, params=SamplingParams(max_tokens=7))
    assert cut.finish_reason == "length" and cut.usage.completion_tokens == 7
    assert cut.text == plain.tokenizer.decode(script[:7])
    stopped = await forced(plain, CODE, params=SamplingParams(stop=("```\n",)))
    assert stopped.finish_reason == "stop" and stopped.text == CODE[:CODE.index("```\n")]
    with pytest.raises(EngineError, match="decode back"):
        await forced(plain, "done<|im_end|>more")
    engine = ForcedEngine(plain, ["a"])
    await complete(engine, ASK)
    with pytest.raises(EngineError, match="1 scripted responses; call 2"):
        await complete(engine, ASK)
    assert (await forced(plain, "still serving")).text == "still serving"


async def test_forced_and_free_requests_share_batches(plain):
    alone = await complete(plain, ASK, SamplingParams(max_tokens=24))
    together = await asyncio.gather(forced(plain, CODE), complete(plain, ASK, SamplingParams(max_tokens=24)),
                                    forced(plain, TWICE))
    assert together[0].text == CODE and together[2].text == TWICE
    assert together[1].token_ids == alone.token_ids
    assert plain.batch_metrics().max_batch >= 2


async def test_suffix_drafts_speed_up_a_repetitive_script(suffix):
    suffix.reset()
    out = await forced(suffix, TWICE)
    assert out.text == TWICE and out.finish_reason == "stop"
    assert out.metrics.accepted_tokens > 20 and out.metrics.tau > 1.3


async def test_cancelling_a_forced_stream_frees_it(suffix):
    blocks_before = suffix.pool.in_use()
    stream = ForcedEngine(suffix, [TWICE * 3]).stream(ASK)
    async with contextlib.aclosing(stream):
        received = 0
        async for _ in stream:
            received += 1
            if received == 3:
                break
    after = await asyncio.wait_for(forced(suffix, CODE), timeout=120)
    assert after.text == CODE
    assert suffix.pool.in_use() == blocks_before == 0
    assert suffix.scheduler.in_flight() == 0


class ScriptedDrafter(DrafterDefaults):
    """Drafts the script's own next tokens, with draft position ``wrong_at`` changed (and
    cannot forget: it has no reset of its own)."""

    name = "scripted"
    lookup = True

    def __init__(self) -> None:
        self.script: list[int] = []
        self.wrong_at: int | None = None

    def begin(self, prompt_ids: Sequence[int], sampling=None) -> "ScriptedState":
        return ScriptedState(self)

    def draft_cost(self, context: int = 64) -> float:
        return 0.0

    def remember(self, token_ids: Sequence[int]) -> None:
        return None


class ScriptedState:
    def __init__(self, drafter: ScriptedDrafter) -> None:
        self.drafter, self.produced = drafter, 0

    def extend(self, token_ids: Sequence[int]) -> None:
        self.produced += len(token_ids)

    def draft(self, k: int) -> Draft:
        p = self.drafter
        tokens = list(p.script[self.produced:self.produced + k])
        if p.wrong_at is not None and p.wrong_at < len(tokens):
            tokens[p.wrong_at] = tokens[p.wrong_at] + 1
        return Draft(tokens, match_len=8)

    def end(self) -> None:
        return None


async def test_a_draft_token_is_accepted_iff_it_is_the_scripted_token():
    drafter = ScriptedDrafter()
    engine = NativeEngine(drafter=drafter, draft_tokens=4, max_seq_len=1024)
    try:
        drafter.script = engine.tokenizer.encode(CODE)
        results = {}
        for wrong_at in (None, 0, 2):
            drafter.wrong_at = wrong_at
            out = await forced(engine, CODE)
            assert out.text == CODE
            results[wrong_at] = out.metrics
        right, first_wrong, third_wrong = results[None], results[0], results[2]
        # the script's own tokens are always accepted, whatever the model would have said
        assert right.accepted_tokens == right.draft_tokens > 0 and right.tau > 4.0
        assert first_wrong.accepted_tokens == 0 and first_wrong.draft_tokens > 0
        drafted, accepted = third_wrong.drafted_per_position, third_wrong.accepted_per_position
        assert accepted[:2] == drafted[:2] and drafted[2] > 0 and accepted[2:] == [0, 0]
        with pytest.raises(EngineError, match="no reset"):
            engine.reset()
        engine.reset(drafter=False)
    finally:
        engine.close()


# ----------------------------------------------------------------------------------- reset

async def test_reset_forgets_the_drafter_corpus_and_the_prefix_cache(suffix):
    suffix.reset()
    first = (await forced(suffix, TWICE)).metrics
    second = (await forced(suffix, TWICE)).metrics
    assert first.cached_tokens == 0 and second.cached_tokens > 0
    assert second.tau > first.tau + 1.0  # the corpus holds the first run's output
    suffix.remember(TWICE)
    suffix.reset()
    assert suffix.pool.cached_blocks() == 0 and suffix.pool.available() == suffix.pool.num_blocks
    cached_before = suffix.batch_metrics().cached_tokens
    third = (await forced(suffix, TWICE)).metrics
    assert third.cached_tokens == 0 and suffix.batch_metrics().cached_tokens == cached_before
    assert (third.tau, third.accepted_tokens, third.verify_steps) == (
        first.tau, first.accepted_tokens, first.verify_steps)


async def test_reset_is_refused_while_a_request_streams(suffix):
    long_script = CODE * 4  # over a hundred steps: still running when reset is asked for
    stream = ForcedEngine(suffix, [long_script]).stream(ASK)
    parts = []
    async with contextlib.aclosing(stream):
        async for delta in stream:
            parts.append(delta.text)
            if len(parts) == 1:
                with pytest.raises(EngineError, match="1 request\\(s\\) in flight"):
                    suffix.reset()
    assert "".join(parts) == long_script  # the refused reset changed nothing
    suffix.reset()


def test_adaptive_k_forgets_acceptance_but_keeps_step_costs():
    costs = StepCosts({1: 0.010, 4: 0.011, 8: 0.013, 16: 0.020})
    policy = AdaptiveK(costs, max_k=8)
    fresh = [policy.accept(b) for b in range(AdaptiveK.BUCKETS)]
    for _ in range(30):
        policy.observe(8, 8, bucket=4)
        policy.observe(2, 0, bucket=1)
    costs.observe(4, 0.03)
    assert policy.accept(4) != fresh[4] and policy.accept(1) != fresh[1]
    factor = costs.factor
    policy.forget()
    assert [policy.accept(b) for b in range(AdaptiveK.BUCKETS)] == fresh
    assert policy.costs is costs and costs.factor == factor != 1.0


# ----------------------------------------------------------------------------------- agent

def test_forced_engine_runs_an_agent_and_reset_clears_adaptive_k():
    native = NativeEngine(max_seq_len=1024)  # the default: bf16, suffix drafts, adaptive k
    try:
        script = [
            "Let me look at the data first.\n```repl\nn = len(context)\nprint('rows:', n)\n```\n",
            "Now the answer.\n```repl\nFINAL(n * 2)\n```\n",
        ]
        engine = ForcedEngine(native, script)
        result = Agent(engine, max_turns=3).run_sync("Twice the number of rows?", context=[1, 2, 3])
        assert result.status == "final" and result.answer == 6
        assert [t.response for t in result.turns] == script
        assert "rows: 3" in result.turns[0].observation
        assert engine.calls == 2 and native.metrics().verify_steps > 0
        policy = native._policy
        assert policy is not None and any(any(s) for s in policy.seen)
        costs = policy.costs
        native.reset()
        assert not any(any(s) for s in policy.seen) and policy.costs is costs
        assert native.drafter.corpus_tokens == 0
    finally:
        native.close()
