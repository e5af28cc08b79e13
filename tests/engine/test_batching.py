"""Continuous batching in the native engine, on the real SmolLM2-135M (bf16, CPU kernels):
a ragged batch step against each sequence run alone bit for bit, the paged KV pool and its
prefix index, and every request's output in a batch against the same request run alone."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from agentrt.engine import EngineError, NativeEngine, SamplingParams, complete, models
from agentrt.engine.draft_policy import plan_draft_lengths
from agentrt.engine.kv_cache import KVPool
from agentrt.engine.llama import SeqRows, SequenceCache, Transformer
from agentrt.engine.scheduler import common_prefix
from chat_prompts import PROMPTS, RULES
from per_op_forward import per_op_forward
from random_models import qwen_like

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def plain():
    models.ensure("smollm2-135m", "bf16")
    eng = NativeEngine(drafter=None, max_seq_len=2048)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def spec():
    eng = NativeEngine(drafter="suffix", max_seq_len=2048)
    yield eng
    eng.close()


def _kernels_or_skip(model: Transformer) -> None:
    if model.ops is None or model.matmul.ops is None:
        pytest.skip("no AVX2 / C compiler here: the torch path is in use")


# ------------------------------------------------------------------------ the forward

def _ragged_steps(model: Transformer, ids: torch.Tensor, pool: KVPool,
                  forward=None) -> list[torch.Tensor]:
    """Three sequences through ragged steps (prefill chunks of different sizes next to
    single-token and 5-row steps of the others), in scattered blocks; logits per sequence.
    ``forward(model, tokens, seqs, pool)``: the step to use (default: the model's)."""
    tables = [torch.tensor(t, dtype=torch.int32) for t in ([5, 0, 9], [2, 7, 1], [3, 8, 4])]
    cuts = [[0, 50, 51, 56, 90], [0, 1, 2, 70, 90], [0, 33, 34, 35, 90]]
    out: list[list[torch.Tensor]] = [[], [], []]
    with torch.inference_mode():
        for step in range(4):
            seqs, tokens = [], []
            for i in range(3):
                a, b = cuts[i][step], cuts[i][step + 1]
                seqs.append(SeqRows(a, b - a, tables[i]))
                tokens.append(ids[i, a:b])
            if forward is None:
                logits = model(torch.cat(tokens), seqs, pool)
            else:
                logits = forward(model, torch.cat(tokens), seqs, pool)
            row = 0
            for i, s in enumerate(seqs):
                out[i].append(logits[row:row + s.n])
                row += s.n
    return [torch.cat(o) for o in out]


def _pool(model: Transformer) -> KVPool:
    """A small block pool in the model's cache format."""
    return model.new_pool(10, 32)


def _alone(model: Transformer, ids: torch.Tensor, cuts: list[int]) -> list[torch.Tensor]:
    """Each sequence of ``ids`` alone (one block table of its own), in steps between ``cuts``:
    logits per sequence."""
    out = []
    with torch.inference_mode():
        for row in ids:
            cache = SequenceCache(model)
            out.append(torch.cat([cache(row[None, a:b], a)[0] for a, b in zip(cuts, cuts[1:])]))
    return out


def test_ragged_batch_equals_each_sequence_alone_bit_for_bit():
    path = models.ensure("smollm2-135m", "bf16")
    for model in (Transformer.from_pretrained(path, "bf16", max_seq_len=128), qwen_like()):
        _kernels_or_skip(model)
        ids = torch.randint(0, model.vocab_size, (3, 90), generator=torch.Generator().manual_seed(3))
        alone = _alone(model, ids, [0, 30, 60, 61, 90])
        fused = _ragged_steps(model, ids, _pool(model))
        per_op = _ragged_steps(model, ids, _pool(model), per_op_forward)
        for i in range(3):
            assert torch.equal(fused[i], per_op[i]), "one C call must equal one call per op"
            assert torch.equal(fused[i], alone[i]), "batching must not change a bit"


def test_int8_ragged_batch_equals_each_sequence_alone_bit_for_bit():
    """precision="int8" in the batch: the int8 kernel is row-independent too, so the ragged
    step (one C call and one call per op) equals each sequence alone bit for bit."""
    path = models.ensure("smollm2-135m", "bf16")
    model = Transformer.from_pretrained(path, "bf16", max_seq_len=128, precision="int8")
    _kernels_or_skip(model)
    if model.int8_head is None:
        pytest.skip("no GGUF blocks for this checkpoint: int8 precision is not in use")
    ids = torch.randint(0, model.vocab_size, (3, 90), generator=torch.Generator().manual_seed(5))
    alone = _alone(model, ids, [0, 32, 33, 60, 90])
    fused = _ragged_steps(model, ids, _pool(model))
    per_op = _ragged_steps(model, ids, _pool(model), per_op_forward)
    for i in range(3):
        assert torch.equal(fused[i], per_op[i])
        assert torch.equal(fused[i], alone[i])


def test_torch_path_matches_the_kernels():
    path = models.ensure("smollm2-135m", "bf16")
    fast = Transformer.from_pretrained(path, "bf16", max_seq_len=128)
    _kernels_or_skip(fast)
    slow = Transformer.from_pretrained(path, "bf16", max_seq_len=128, cpu_kernel=False)
    ids = torch.randint(0, fast.vocab_size, (3, 90), generator=torch.Generator().manual_seed(4))
    a = _ragged_steps(fast, ids, _pool(fast))
    b = _ragged_steps(slow, ids, _pool(slow))
    for x, y in zip(a, b):
        assert (x - y).abs().max() < 2e-2 * y.abs().max()
        assert (x.argmax(-1) == y.argmax(-1)).float().mean() >= 0.8


# ----------------------------------------------------------------------- the KV pool

def test_pool_prefix_index_sharing_and_lru_eviction():
    pool = KVPool(num_layers=1, kv_heads=1, head_dim=8, num_blocks=4, block_size=4)
    a = [pool.allocate() for _ in range(3)]
    tokens = list(range(10))
    chain = pool.register(a[0], KVPool.ROOT, tokens[0:4])
    chain = pool.register(a[1], chain, tokens[4:8])
    pool.register_partial(a[2], chain, tokens[8:10])
    blocks, _, partial, n = pool.match(tokens + [99], limit=10)
    assert blocks == a[:2] and partial == a[2] and n == 2
    blocks, _, partial, n = pool.match([0, 1, 2, 3, 4, 5, 9, 9], limit=7)  # diverges in block 2
    assert blocks == a[:1] and partial == a[1] and n == 2
    pool.release(a)
    assert pool.available() == 4 and pool.cached_blocks() == 3
    pool.take(a[:2])  # a later request shares the first two blocks
    assert pool.available() == 2
    fresh = [pool.allocate(), pool.allocate()]  # the free block, then the LRU unused one
    assert a[2] in fresh and pool.evictions == 1 and pool.allocate() is None
    assert pool.match(tokens + [99], limit=10)[2] is None  # the evicted leaf is gone
    assert pool.match(tokens, limit=10)[0] == a[:2]


def test_plan_draft_lengths_drafts_less_as_rows_get_dearer():
    chains = [[0.9, 0.8, 0.6, 0.3], [0.5, 0.2]]
    flat = plan_draft_lengths(chains, 2, 2, lambda rows: 1.0 + 0.01 * rows)
    steep = plan_draft_lengths(chains, 2, 2, lambda rows: float(rows))
    assert flat == [4, 2] and steep == [0, 0]
    assert plan_draft_lengths(chains, 2, 2, lambda rows: 1.0 + 0.3 * rows) == [3, 0]



def test_model_drafts_of_a_batch_are_charged_one_draft_forward_per_position():
    # four requests drafting with a model: one batched draft forward per position costs 0.3
    # on a flat curve, so one more position for all four (+3.6 tokens) pays; charged 0.3 per
    # request and position (drafting each alone) it would not: (4 + 3.6) / (1 + 1.2) < 4 / 1
    chains = [[0.9, 0.81]] * 4
    flat = lambda rows: 1.0  # noqa: E731
    assert plan_draft_lengths(chains, 4, 4, flat, draft_cost=0.3) == [2, 2, 2, 2]
    assert plan_draft_lengths(chains, 4, 4, flat, draft_cost=2.0) == [0, 0, 0, 0]
    # the first draft row pays for a whole draft forward, the others for what its rows add
    rising = lambda rows: 1.0 + 0.1 * rows  # noqa: E731
    assert plan_draft_lengths([[0.99]] * 4, 4, 4, rising, draft_cost=0.3) == [1, 1, 1, 1]
    assert plan_draft_lengths([[0.99]] * 4, 4, 4, rising, draft_cost=9.0) == [0, 0, 0, 0]

# ------------------------------------------------------------------ engine: identity

async def _solo(engine, prompts, params):
    return [await complete(engine, m, params) for m in prompts]


@pytest.mark.parametrize("concurrency", [2, 4, 8])
async def test_batched_greedy_equals_solo_plain(plain, spec, concurrency):
    params = SamplingParams(max_tokens=12)
    prompts = PROMPTS[:concurrency]
    solo = await _solo(plain, prompts, params)
    for engine in (plain, spec):
        together = await asyncio.gather(*[complete(engine, m, params) for m in prompts])
        assert [c.token_ids for c in together] == [s.token_ids for s in solo]
        assert [c.text for c in together] == [s.text for s in solo]
    assert plain.batch_metrics().max_batch >= concurrency


async def test_batched_seeded_sampling_equals_solo(plain, spec):
    prompts = PROMPTS[:4]
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=10 + i) for i in range(4)]
    solo = [await complete(plain, m, p) for m, p in zip(prompts, params)]
    for engine in (plain, spec):
        together = await asyncio.gather(*[complete(engine, m, p) for m, p in zip(prompts, params)])
        assert [c.token_ids for c in together] == [s.token_ids for s in solo]


async def test_staggered_arrivals_stop_strings_and_cancellation(plain):
    params = SamplingParams(max_tokens=16)
    solo = await _solo(plain, PROMPTS[:3], params)
    stop = solo[2].text[3:6]
    stopped_solo = await complete(plain, PROMPTS[2], SamplingParams(max_tokens=16, stop=(stop,)))

    async def late(i, delay, p=params):
        await asyncio.sleep(delay)
        return await complete(plain, PROMPTS[i], p)

    async def cancelled():
        async for _ in plain.stream(PROMPTS[4], SamplingParams(max_tokens=400)):
            await asyncio.sleep(3600)  # a consumer that stalls mid-stream until it is cancelled

    victim = asyncio.create_task(cancelled())
    results = await asyncio.gather(late(0, 0), late(1, 0.3), late(2, 0.6, SamplingParams(max_tokens=16, stop=(stop,))))
    victim.cancel()
    with pytest.raises(asyncio.CancelledError):
        await victim
    assert results[0].token_ids == solo[0].token_ids and results[1].token_ids == solo[1].token_ids
    assert results[2].text == stopped_solo.text and stop not in results[2].text


# ------------------------------------------------------------------ engine: prefixes

async def test_second_turn_prefills_only_new_tokens(plain):
    first = [{"role": "user", "content": RULES + "\nWhich code word goes with item 3?"}]
    one = await complete(plain, first, SamplingParams(max_tokens=16))
    second = first + [{"role": "assistant", "content": one.text},
                      {"role": "user", "content": "And item 5?"}]
    two = await complete(plain, second, SamplingParams(max_tokens=8))
    prompt1 = plain.tokenizer.encode_chat(first)
    prompt2 = plain.tokenizer.encode_chat(second)
    assert len(prompt1) > 900
    # the first turn's cache holds its prompt and every output token fed back (the last one
    # sampled at max_tokens never was)
    fed = one.token_ids[:-1] if one.finish_reason == "length" else one.token_ids
    shared = common_prefix(prompt2, prompt1 + fed)
    assert two.metrics.cached_tokens == min(shared, len(prompt2) - 1) > 900
    assert two.metrics.prefill_tokens == len(prompt2) - two.metrics.cached_tokens
    fresh = NativeEngine(drafter=None, max_seq_len=2048, prefix_cache=False)
    try:
        assert (await complete(fresh, second, SamplingParams(max_tokens=8))).token_ids == two.token_ids
    finally:
        await fresh.aclose()


async def test_sixteen_subqueries_prefill_the_shared_prefix_once(plain):
    queries = [[{"role": "system", "content": RULES},
                {"role": "user", "content": f"Item {i}: which code word?"}] for i in range(16)]
    prompts = [plain.tokenizer.encode_chat(q) for q in queries]
    shared = min(common_prefix(prompts[0], p) for p in prompts[1:])
    assert shared > 900
    before = plain.batch_metrics()
    params = SamplingParams(max_tokens=4)
    outs = await asyncio.gather(*[complete(plain, q, params) for q in queries])
    after = plain.batch_metrics()
    prefilled = after.prefill_tokens - before.prefill_tokens
    own = sum(len(p) - shared for p in prompts)
    # the shared part once (its last partly filled block once per request at most)
    assert prefilled <= shared + own + 16 * plain.pool.block_size
    assert after.max_batch >= 8
    alone = await complete(plain, queries[5], params)
    assert outs[5].token_ids == alone.token_ids


# --------------------------------------------------------------- engine: KV budget

def _smollm_bytes_per_token() -> int:
    """KV bytes per token of the pulled model in the format the engine will store."""
    from agentrt.engine.cpu_ops import CACHE_DTYPE, cpu_ops

    return KVPool.bytes_per_token(30, 3, 64, CACHE_DTYPE if cpu_ops() is not None else torch.float32)


async def test_small_budget_queues_and_preempts_without_changing_outputs():
    per_token = _smollm_bytes_per_token()
    eng = NativeEngine(drafter=None, max_seq_len=1024, kv_cache_bytes=per_token * 64 * 4,
                       block_size=64)
    try:
        params = SamplingParams(max_tokens=40)
        prompts = PROMPTS[:5]
        solo = await _solo(eng, prompts, params)
        together = await asyncio.gather(*[complete(eng, m, params) for m in prompts])
        assert [c.token_ids for c in together] == [s.token_ids for s in solo]
        stats = eng.batch_metrics()
        assert stats.preemptions > 0 or stats.mean_queue_s > 0
        with pytest.raises(EngineError, match="whole budget"):
            await complete(eng, [{"role": "user", "content": "word " * 400}], params)
        ok = await complete(eng, PROMPTS[0], params)
        assert ok.token_ids == solo[0].token_ids
    finally:
        await eng.aclose()


async def test_urgent_request_preempts_less_urgent_ones():
    per_token = _smollm_bytes_per_token()
    eng = NativeEngine(drafter=None, max_seq_len=1024, kv_cache_bytes=per_token * 64 * 3,
                       block_size=64)
    try:
        long = SamplingParams(max_tokens=60, priority=1)
        background = [asyncio.create_task(complete(eng, m, long)) for m in PROMPTS[:3]]
        for _ in range(1000):  # until all three hold their blocks and are decoding
            seen = eng.batch_metrics()
            if seen.requests >= 3 and seen.steps >= 5:
                break
            await asyncio.sleep(0.01)
        root = await complete(eng, PROMPTS[3], SamplingParams(max_tokens=8, priority=-1))
        rest = await asyncio.gather(*background)
        alone = await complete(eng, PROMPTS[3], SamplingParams(max_tokens=8))
        assert root.token_ids == alone.token_ids
        assert root.metrics.queue_s < 1.0
        assert all(r.finish_reason in ("stop", "length") for r in rest)
        assert sum(r.metrics.preemptions for r in rest) + eng.batch_metrics().preemptions > 0
    finally:
        await eng.aclose()


async def test_concurrency_benchmark_levels(plain):
    from benchmarks.engine.concurrency import run_level, run_solo

    prompts = [(f"p{i}", m) for i, m in enumerate(PROMPTS[:3])]
    solo = await run_solo(plain, prompts, 6)
    level = await run_level(plain, prompts, 3, 6)
    assert solo["aggregate_decode_tok_s"] > 0 and level["aggregate_decode_tok_s"] > 0
    assert [r["text"] for r in level["requests"]] == [r["text"] for r in solo["requests"]]
    assert level["tokens"] == solo["tokens"] and level["mean_ttft_s"] > 0
