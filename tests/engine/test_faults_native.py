"""Faults against the native engine on the real SmolLM2-135M: bad sampling parameters and
messages are refused up front with errors naming the field, ``max_tokens`` is bounded by the
context before any per-request state exists, and preemption under a tiny KV budget never
changes an output (greedy and seeded, 64 requests at once)."""

from __future__ import annotations

import asyncio
import math
import os

import pytest
import torch

from agentrt.engine import NativeEngine, SamplingParams, complete, models
from agentrt.engine.kv_cache import KVPool

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.anyio

CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
TOPICS = ("colours", "primes", "France", "the sea", "variables", "French", "numbers", "cats",
          "rivers", "Python", "loops", "stars", "music", "bread", "trees", "clouds")


@pytest.fixture(scope="module")
def engine():
    models.ensure("smollm2-135m", "bf16")
    eng = NativeEngine(drafter=None, max_seq_len=160)
    yield eng
    eng.close()


# ------------------------------------------------------------------ checked up front

@pytest.mark.parametrize("field, value", [
    ("max_tokens", 3.5), ("max_tokens", True), ("max_tokens", "10"), ("max_tokens", 0),
    ("temperature", math.nan), ("temperature", math.inf), ("temperature", "hot"),
    ("temperature", -1.0), ("top_p", math.nan), ("top_p", 0.0), ("top_k", 2.0), ("top_k", -1),
    ("seed", "x"), ("seed", 1.5), ("seed", 10**30), ("stop", 5), ("stop", ["ok", 3]), ("priority", None),
])
def test_sampling_params_name_the_field_that_is_wrong(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}\b"):
        SamplingParams(**{field: value})


def test_a_single_stop_string_is_one_stop_string():
    assert SamplingParams(stop="\n\n").stop == ("\n\n",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


@pytest.mark.parametrize("messages, where", [
    ("hello", "messages must be a list"),
    (["hello"], r"messages\[0\] must be a dict"),
    ([{"role": "banana", "content": "x"}], r"messages\[0\]\['role'\]"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\['content'\] must be a str"),
    ([{"role": "user"}], r"messages\[0\]\['content'\]"),
    (CHAT + [{"content": "x"}], r"messages\[1\]\['role'\]"),
    (None, "messages must be a list"),
])
async def test_bad_messages_are_refused_before_anything_runs(engine, messages, where):
    with pytest.raises(ValueError, match=where):
        await complete(engine, messages, SamplingParams(max_tokens=2))
    assert engine.scheduler.in_flight() == 0  # nothing was queued
    ok = await complete(engine, CHAT, SamplingParams(max_tokens=3))
    assert ok.usage.completion_tokens >= 1


async def test_params_of_another_type_are_refused(engine):
    with pytest.raises(ValueError, match="params must be a SamplingParams"):
        await complete(engine, CHAT, {"max_tokens": 3})


async def test_huge_max_tokens_is_bounded_by_the_context_before_state_is_built(engine):
    count = [{"role": "user", "content": "Write the numbers from 1 to 300, separated by commas."}]
    prompt = len(engine.tokenizer.encode_chat(count))
    stream = engine.stream(count, SamplingParams(max_tokens=10**8))
    first = await stream.__anext__()  # the request is being decoded now
    assert first.finish_reason is None
    (seq,) = engine.scheduler.running  # the per-request state the bound protects
    assert seq.params.max_tokens == engine.max_seq_len - prompt
    assert seq.uniforms.residual.numel() <= engine.max_seq_len + 2 * 64
    # another request is served meanwhile, and the long one ends at the context, as "length"
    other = await complete(engine, CHAT, SamplingParams(max_tokens=3))
    assert other.usage.completion_tokens == 3
    deltas = [first] + [d async for d in stream]
    final = deltas[-1]
    assert final.finish_reason == "length"
    assert final.usage.prompt_tokens + final.usage.completion_tokens == engine.max_seq_len


# --------------------------------------------------------------- preemption keeps outputs

def _prompts(n: int, verb: str = "Tell me about") -> list[list[dict[str, str]]]:
    """n chats that share no KV block (each starts with its own system message), of lengths
    spread over a block (so that requests cross block boundaries at different steps)."""
    return [[{"role": "system", "content": f"{verb}, request {i}: be brief."},
             {"role": "user", "content": f"{verb} {TOPICS[i % 16]}" + " now" * (i % 16) + "."}]
            for i in range(n)]


@pytest.fixture
def tiny():
    """192 KV tokens (12 blocks of 16) for every request at once; suffix drafts, k=3; a
    fresh engine (cold prefix cache) for each test."""
    from agentrt.engine.cpu_ops import CACHE_DTYPE, cpu_ops

    per_token = KVPool.bytes_per_token(30, 3, 64, CACHE_DTYPE if cpu_ops() is not None
                                       else torch.float32)
    eng = NativeEngine(drafter="suffix", draft_tokens=3, max_seq_len=512,
                       kv_cache_bytes=per_token * 192, block_size=16)
    yield eng
    eng.close()


async def _batched_equals_solo(solo_engine: NativeEngine, engine: NativeEngine, prompts,
                               params) -> None:
    """Every request run at once on ``engine`` equals the same request run alone on
    ``solo_engine`` (identical requests are run alone once). Outputs do not depend on the KV
    budget, the batch or drafting, so the reference may come from a roomier engine; the
    batch runs on a cold prefix cache, as the requests' first arrival."""
    solo: dict[str, object] = {}
    for m, p in zip(prompts, params):
        if repr((m, p)) not in solo:
            solo[repr((m, p))] = await complete(solo_engine, m, p)
    expected = [solo[repr((m, p))] for m, p in zip(prompts, params)]
    before = engine.batch_metrics().preemptions
    together = await asyncio.gather(*[complete(engine, m, p) for m, p in zip(prompts, params)])
    assert engine.batch_metrics().preemptions > before, "the budget must force preemptions"
    differ = [i for i in range(len(prompts)) if together[i].token_ids != expected[i].token_ids]
    assert differ == [], [(i, together[i].finish_reason, len(together[i].token_ids),
                           expected[i].finish_reason, len(expected[i].token_ids)) for i in differ]
    assert [c.finish_reason for c in together] == [s.finish_reason for s in expected]


async def test_tiny_budget_64_greedy_requests_equal_their_solo_outputs(engine, tiny):
    """64 concurrent requests in 192 KV tokens: requests are preempted as they grow past block
    boundaries, and each resumes to exactly its solo output."""
    prompts = _prompts(16) * 4  # 64 requests, 16 different ones
    await _batched_equals_solo(engine, tiny, prompts, [SamplingParams(max_tokens=12)] * 64)


async def test_tiny_budget_seeded_sampling_equals_solo(engine, tiny):
    prompts = _prompts(16, "Describe") * 2
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=7 + i)
              for i in range(32)]
    await _batched_equals_solo(engine, tiny, prompts, params)


async def test_a_request_the_budget_cannot_finish_ends_as_length_alone_or_batched(tiny):
    """A request that would run past the whole KV budget ends with ``finish_reason="length"``
    where the budget is full, with the same text alone and next to others."""
    long = [{"role": "user", "content": "Write the numbers from 1 to 300, separated by commas."}]
    prompt = len(tiny.tokenizer.encode_chat(long))
    params = SamplingParams(max_tokens=400)
    alone = await complete(tiny, long, params)
    assert alone.finish_reason == "length"
    assert alone.usage.completion_tokens == tiny.pool.capacity_tokens - prompt
    batch = await asyncio.gather(complete(tiny, long, params),
                                 *[complete(tiny, m, SamplingParams(max_tokens=8))
                                   for m in _prompts(3)])
    assert batch[0].token_ids == alone.token_ids and batch[0].finish_reason == "length"


@pytest.mark.slow
async def test_tiny_budget_64_longer_greedy_and_seeded_requests_equal_solo(engine, tiny):
    prompts = _prompts(64, "Write two sentences about")
    await _batched_equals_solo(engine, tiny, prompts, [SamplingParams(max_tokens=48)] * 64)
    seeded = [SamplingParams(max_tokens=48, temperature=0.9, seed=i) for i in range(64)]
    await _batched_equals_solo(engine, tiny, _prompts(64, "Explain"), seeded)
