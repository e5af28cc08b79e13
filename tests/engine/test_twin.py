"""The int8 twin drafter (`drafter="twin"`, `"hybrid-twin"`): the target's own int8 weights
draft in the request's KV blocks, and the output stays the exact target's, token for token,
alone and batched (bf16 on the CPU kernels: a row's logits do not depend on the rows verified
with it, so there are no near-ties to excuse)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from agentrt.engine import NativeEngine, SamplingParams, complete
from agentrt.engine.drafters.base import DraftSampling, DraftSlots
from agentrt.engine.drafters.twin import TwinDrafter
from agentrt.engine.llama import SeqRows
from random_models import qwen_like

PROMPT_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts"
PROMPTS = [json.loads(line) for name in ("agent_code", "chat")
           for line in (PROMPT_DIR / f"{name}.jsonl").read_text().splitlines() if line.strip()][::5]


def _outputs(engine, params, together: bool) -> list[list[int]]:
    async def one(p):
        return (await complete(engine, p["messages"], params)).token_ids

    async def go():
        if together:
            return list(await asyncio.gather(*(one(p) for p in PROMPTS)))
        return [await one(p) for p in PROMPTS]

    return asyncio.run(go())


@pytest.fixture(scope="module")
def plain_outputs():
    engine = NativeEngine(drafter=None, max_seq_len=2048)
    if engine.model.ops is None:
        engine.close()
        pytest.skip("no AVX2 / C compiler here: no int8 twin")
    try:
        yield _outputs(engine, SamplingParams(max_tokens=24), together=False)
    finally:
        engine.close()


@pytest.mark.parametrize("drafter", ["twin", "hybrid-twin"])
def test_twin_drafts_give_the_plain_output_alone_and_batched(plain_outputs, drafter):
    # 16-position blocks: drafts of 6 cross block boundaries
    engine = NativeEngine(drafter=drafter, draft_tokens=6, block_size=16, max_seq_len=2048)
    try:
        params = SamplingParams(max_tokens=24)
        assert _outputs(engine, params, together=False) == plain_outputs
        engine.reset()
        assert _outputs(engine, params, together=True) == plain_outputs
        m = engine.metrics()
        assert m.draft_tokens > 0 and m.acceptance_rate > 0.8, m.to_dict()
    finally:
        engine.close()


def test_adaptive_k_starts_from_the_twins_acceptance_prior_and_cost_line():
    engine = NativeEngine(drafter="hybrid-twin", max_seq_len=2048)
    try:
        if engine.model.ops is None:
            pytest.skip("no CPU kernels")
        policy = engine._policy_for()
        assert policy.accept(0)[0] == TwinDrafter.acceptance_prior  # model drafts
        assert policy.accept(1)[0] == policy.prior                   # lookups keep theirs
        # a twin token's cost, measured at two lengths, is a line in the sequence's length
        # (never below the short one's), and adaptive k charges it at each sequence's length
        cost = engine.drafter.draft_cost
        assert cost(0) == cost(TwinDrafter.COST_CONTEXTS[0]) > 0
        assert cost(64) <= cost(512) <= cost(1024) <= cost(2048)
        assert cost(2048) - cost(1024) == pytest.approx(2 * (cost(1024) - cost(512)))
        assert [policy.draft_cost(n) for n in (64, 700, 1500)] == [cost(n) for n in (64, 700, 1500)]
    finally:
        engine.close()


def test_sampled_requests_draft_from_the_twins_distribution():
    # no prefix cache: a second request would start decoding at once from the cached prompt
    # (with drafts where the first ran a prefill), a different but equally valid sample
    engine = NativeEngine(drafter="twin", draft_tokens=4, max_seq_len=2048, prefix_cache=False)
    try:
        if engine.model.ops is None:
            pytest.skip("no CPU kernels")
        params = SamplingParams(max_tokens=24, temperature=0.8, top_k=40, seed=3)
        out = asyncio.run(complete(engine, PROMPTS[0]["messages"], params))
        assert len(out.token_ids) > 0 and engine.metrics().accepted_tokens > 0
        again = asyncio.run(complete(engine, PROMPTS[0]["messages"], params))
        assert again.token_ids == out.token_ids  # the same seed: the same sample
    finally:
        engine.close()


@pytest.fixture
def small_blocks_twin():
    """A twin engine with 16-position blocks, drafting 4 tokens."""
    engine = NativeEngine(drafter="twin", draft_tokens=4, block_size=16, max_seq_len=256)
    try:
        if engine.model.ops is None:
            pytest.skip("no CPU kernels")
        yield engine
    finally:
        engine.close()


class Request:
    """A request decoding its last token, in ``blocks``, whose committed positions hold the
    target's keys and values."""

    def __init__(self, engine: NativeEngine, tokens: list[int], blocks: list[int]):
        self.tokens, self.computed, self.blocks = tokens, len(tokens) - 1, blocks
        with torch.inference_mode():
            engine.model(torch.tensor(tokens[:-1]),
                         [SeqRows(0, self.computed, torch.tensor(blocks, dtype=torch.int32))], engine.pool)

    def state(self, drafter, sampling: DraftSampling | None = None):
        return drafter.begin(self.tokens, sampling)

    def slots(self, room: int) -> DraftSlots:
        """The rows a step would reserve for ``room`` drafts after the last token."""
        return DraftSlots(self.computed, torch.tensor(self.blocks, dtype=torch.int32), room)


def test_the_twin_writes_only_its_slots(small_blocks_twin):
    engine = small_blocks_twin
    drafter, pool = engine.drafter, engine.pool
    # decoding its 21st token: position 20 sits in its second block
    request = Request(engine, list(range(100, 121)), [pool.allocate(), pool.allocate()])
    second = request.blocks[1]
    stored = [t for layer in pool.caches for t in layer]  # keys and values of every layer
    before = [t.view(torch.int16).clone() for t in stored]  # bits: NaN-safe
    (two,) = drafter.draft_many([request.state(drafter)], [4], [request.slots(2)])
    assert len(two.tokens) == 2  # the slots bound the draft
    for t, b in zip(stored, before):
        changed = (t.view(torch.int16) != b).any(dim=-1).any(dim=1)  # [block, position]
        assert not changed[torch.arange(pool.num_blocks) != second].any()
        assert not changed[second, :4].any() and not changed[second, 6:].any()  # only 20, 21
    (four,) = drafter.draft_many([request.state(drafter)], [4], [request.slots(8)])
    assert four.tokens[:2] == two.tokens and len(four.tokens) == 4
    assert drafter.draft_many([request.state(drafter)], [4], [None])[0].tokens == []
    sampled = request.state(drafter, DraftSampling(0.8, 40, 1.0, torch.Generator().manual_seed(0)))
    (draft,) = drafter.draft_many([sampled], [3], [request.slots(3)])
    # sampled from the twin's distribution, which it reports
    assert draft.probs.shape == (3, engine.model.vocab_size)
    assert torch.allclose(draft.probs.sum(-1), torch.ones(3))
    assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.tokens))
    assert all(int((row > 0).sum()) <= 40 for row in draft.probs)  # top-k applied


def test_the_twin_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="int8 twin of an exact target; this engine's precision is 'int8'"):
        NativeEngine(drafter="twin", precision="int8", max_seq_len=256)
    with pytest.raises(ValueError, match="needs the model's GGUF blocks"):
        qwen_like().int8_twin()


def test_drafts_of_several_requests_together_equal_each_alone(small_blocks_twin):
    engine = small_blocks_twin
    drafter, pool = engine.drafter, engine.pool
    # drafts at positions 20.., 13.. and 29.. (the last two run into their next block)
    requests = [Request(engine, list(range(200, 221)), [pool.allocate() for _ in range(2)]),
                Request(engine, list(range(300, 314)), [pool.allocate() for _ in range(2)]),
                Request(engine, list(range(400, 430)), [pool.allocate() for _ in range(3)])]
    states = [r.state(drafter) for r in requests]
    slots = [r.slots(k) for r, k in zip(requests, (5, 4, 4))]
    alone = [drafter.draft_many([s], [k], [slot])[0].tokens
             for s, k, slot in zip(states, (5, 4, 4), slots)]
    together = [d.tokens for d in drafter.draft_many(states, [5, 4, 4], slots)]
    assert [len(t) for t in alone] == [5, 4, 4]
    assert together == alone
