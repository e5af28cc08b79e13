"""Speculative decoding is lossless: with the real SmolLM2 in fp32, greedy drafted output
equals greedy plain output for every drafter, on agent-code, chat and copy-heavy prompts.

Batched (k+1 token) and single-token forwards round differently, so at a genuine near-tie the
two runs may pick different tokens. Such divergences are reported with their logit gap, and the
gap must be tiny; any other difference fails. The same holds for seeded sampling: with
deterministic drafts the engine samples every position from uniforms indexed by output position,
so a seeded drafted run must reproduce the plain run token for token.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch

from agentrt.engine import NativeEngine, SamplingParams, complete, models
from agentrt.engine.llama import SequenceCache, Transformer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPT_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts"
PROMPT_SETS = ("agent_code", "chat", "copy_heavy")
MAX_TIE_GAP = 1e-3  # |logit(a) - logit(b)| / max |logit| at an accepted divergence


def load_prompts() -> list[dict]:
    rows = []
    for name in PROMPT_SETS:
        with open(PROMPT_DIR / f"{name}.jsonl") as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


PROMPTS = load_prompts()


@pytest.fixture(scope="module")
def reference_model() -> Transformer:
    return Transformer.from_pretrained(models.ensure("smollm2-135m", "fp32"), "fp32", max_seq_len=2048)


@pytest.fixture(scope="module")
def plain():
    eng = NativeEngine(dtype="fp32", drafter=None, max_seq_len=2048)
    yield eng
    eng.close()


def run_all(engine, prompts, params) -> list[list[int]]:
    async def go():
        return [(await complete(engine, p["messages"], params)).token_ids for p in prompts]

    return asyncio.run(go())


def logits_after(model: Transformer, engine: NativeEngine, messages, generated: list[int]) -> torch.Tensor:
    ids = engine.tokenizer.encode_chat(messages) + generated
    with torch.inference_mode():
        return SequenceCache(model, max_len=len(ids))(torch.tensor([ids]), 0, "last")[0, -1]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


_plain_outputs: dict[tuple[str, int], list[int]] = {}


def plain_greedy(plain, prompts, max_tokens) -> list[list[int]]:
    """Plain greedy outputs, computed once per (prompt, max_tokens)."""
    todo = [p for p in prompts if (p["id"], max_tokens) not in _plain_outputs]
    for p, ids in zip(todo, run_all(plain, todo, SamplingParams(max_tokens=max_tokens))):
        _plain_outputs[(p["id"], max_tokens)] = ids
    return [_plain_outputs[(p["id"], max_tokens)] for p in prompts]


def check_greedy(engine, plain, reference_model, prompts, max_tokens):
    params = SamplingParams(max_tokens=max_tokens)
    expected = plain_greedy(plain, prompts, max_tokens)
    got = run_all(engine, prompts, params)
    ties = []
    for prompt, want, have in zip(prompts, expected, got):
        i = first_difference(want, have)
        if i is None:
            continue
        assert i < min(len(want), len(have)), (
            f"{prompt['id']}: one run stopped early at token {i} ({len(want)} vs {len(have)} tokens)")
        logits = logits_after(reference_model, plain, prompt["messages"], want[:i])
        gap = float((logits[want[i]] - logits[have[i]]).abs() / logits.abs().max())
        ties.append((prompt["id"], i, gap))
        assert gap < MAX_TIE_GAP, f"{prompt['id']}: diverged at token {i} with logit gap {gap:.2e}"
    print(f"\n{engine.config.drafter}: {len(prompts)} prompts, near-tie divergences: {ties}")
    metrics = engine.metrics()
    assert metrics.drafts > 0, "the drafter never drafted: the test would prove nothing"
    return metrics


@pytest.mark.parametrize("drafter,k,every", [
    ("ngram", 5, 2), ("suffix", 5, 2),  # every other prompt: each set, half the time
    pytest.param("ngram", 5, 1, marks=pytest.mark.slow),
    pytest.param("suffix", 5, 1, marks=pytest.mark.slow),
])
def test_greedy_drafted_equals_plain(plain, reference_model, drafter, k, every):
    engine = NativeEngine(dtype="fp32", drafter=drafter, draft_tokens=k, max_seq_len=2048)
    try:
        metrics = check_greedy(engine, plain, reference_model, PROMPTS[::every], max_tokens=12)
        assert metrics.accepted_tokens > 0
    finally:
        engine.close()


def test_greedy_draft_model_equals_plain(plain, reference_model):
    engine = NativeEngine(dtype="fp32", drafter="draft", draft_model=8, draft_tokens=3,
                          max_seq_len=2048)
    try:
        check_greedy(engine, plain, reference_model, PROMPTS[::6], max_tokens=12)
    finally:
        engine.close()


def test_adaptive_k_equals_plain(plain, reference_model):
    from agentrt.engine.draft_policy import AdaptiveK, StepCosts

    engine = NativeEngine(dtype="fp32", drafter="suffix", max_seq_len=2048)
    # a fixed cost curve (a CPU's shape: extra rows are cheap): the start-up measurement on a
    # loaded machine can make drafting look unprofitable, and then nothing would be drafted
    costs = StepCosts({1: 0.02, 4: 0.022, 8: 0.026, 16: 0.034, 33: 0.05})
    engine._policy = AdaptiveK(costs, engine.max_k, engine.drafter.draft_cost())
    try:
        copy = [p for p in PROMPTS if p["id"].startswith("copy")]
        check_greedy(engine, plain, reference_model, copy[:2], max_tokens=16)
    finally:
        engine.close()


def test_seeded_sampling_drafted_equals_plain(plain, reference_model):
    from agentrt.engine.verify import Uniforms

    engine = NativeEngine(dtype="fp32", drafter="ngram", draft_tokens=4, max_seq_len=2048)
    prompts = [p for p in PROMPTS if p["id"].startswith("copy")][:3]
    try:
        for seed, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=16, temperature=0.7, top_k=50, seed=seed)
            [want] = run_all(plain, [prompt], params)
            [have] = run_all(engine, [prompt], params)
            i = first_difference(want, have)
            if i is None:
                continue
            # only a uniform sitting on a CDF boundary (to rounding) may flip a sampled token
            logits = logits_after(reference_model, plain, prompt["messages"], want[:i])
            from agentrt.kernels import probs_from_logits

            probs = probs_from_logits(logits[None], 0.7, 50)[0].double()
            u = float(Uniforms(seed, 64, torch.device("cpu")).residual[i])
            boundary = float(probs[:min(want[i], have[i]) + 1].sum() / probs.sum())
            assert abs(boundary - u) < 1e-4, f"{prompt['id']}: sampled runs diverged at token {i}"
        assert engine.metrics().accepted_tokens > 0
    finally:
        engine.close()


def test_bf16_greedy_drafted_equals_plain():
    """The default dtype: on CPU, bf16 weights with float32 activations and a batch-independent
    matmul, so verification forwards reproduce single-token forwards (ties are still allowed
    for machines on the plain torch fallback)."""
    reference = Transformer.from_pretrained(models.ensure("smollm2-135m", "bf16"), "bf16", max_seq_len=2048)
    plain = NativeEngine(dtype="bf16", drafter=None, max_seq_len=2048)
    engine = NativeEngine(dtype="bf16", drafter="suffix", draft_tokens=6, max_seq_len=2048)
    try:
        _plain_outputs.clear()
        check_greedy(engine, plain, reference, PROMPTS[1::4], max_tokens=16)
    finally:
        _plain_outputs.clear()
        engine.close()
        plain.close()


def _drafted_equals_plain_in(precision: str, available, missing: str, prompts) -> None:
    """Greedy drafted output equals greedy plain output in ``precision`` (skipped with
    ``missing`` where ``available(plain model)`` says the model computes exactly instead)."""
    plain = NativeEngine(dtype="bf16", drafter=None, max_seq_len=2048, precision=precision)
    if not available(plain.model):
        plain.close()
        pytest.skip(missing)
    engine = NativeEngine(dtype="bf16", drafter="suffix", draft_tokens=6,
                          max_seq_len=2048, precision=precision)
    try:
        params = SamplingParams(max_tokens=24)
        assert run_all(engine, prompts, params) == run_all(plain, prompts, params)
        assert engine.metrics().accepted_tokens > 0, "nothing was accepted: the test proves nothing"
    finally:
        engine.close()
        plain.close()


def test_int8_greedy_drafted_equals_plain():
    """precision="int8": each row's logits are independent of the rows verified with it, so
    greedy drafted output equals greedy plain output token for token, with no near-ties
    to excuse (the int8 logits are not exact ones, but both runs compute the same ones)."""
    _drafted_equals_plain_in("int8", lambda model: model.int8_head is not None,
                             "no AVX2 / C compiler here: int8 precision runs exactly", PROMPTS[2::4])


def test_bf16_precision_greedy_drafted_equals_plain():
    """precision="bf16", one request at a time: prompts of 64+ tokens prefill with bf16
    activations, verify and decode steps (fewer rows) run the exact kernels: greedy drafted
    output equals greedy plain output token for token. (Under concurrency a step's size, and so
    its arithmetic, depends on the other requests: not asserted.)"""
    _drafted_equals_plain_in("bf16", lambda model: model.bf16_rows,
                             "no AVX512-BF16 here: bf16 precision runs exactly", PROMPTS[3::4])


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 24 prompts x 128 tokens in fp32, plus plain's outputs on first use
@pytest.mark.parametrize("drafter,k", [("ngram", 8), ("suffix", 8), ("draft", 4)])
def test_long_greedy_drafted_equals_plain(plain, reference_model, drafter, k):
    engine = NativeEngine(dtype="fp32", drafter=drafter, draft_tokens=k, max_seq_len=2048)
    try:
        check_greedy(engine, plain, reference_model, PROMPTS, max_tokens=128)
    finally:
        engine.close()
