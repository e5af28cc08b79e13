"""NativeEngine on the real SmolLM2-135M: streaming, stops, limits, sampling, cancellation,
concurrency, and the lean Llama forward against transformers on the same weights."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from agentrt.engine import EngineError, NativeConfig, NativeEngine, SamplingParams, complete
from agentrt.engine import models
from agentrt.engine.llama import SeqRows, SequenceCache, Transformer
from agentrt.engine.tokenizer import IncrementalDetokenizer, StopStringMatcher
from per_op_forward import attend_paged, per_op_forward, rope_store_paged, silu_mul
from random_models import qwen_like

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytestmark = pytest.mark.anyio

CODE = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
LIST = [{"role": "user", "content": "Count from one to ten in words, separated by commas."}]



@pytest.fixture(scope="module")
def engine():
    models.ensure("smollm2-135m", "fp32")
    eng = NativeEngine(dtype="fp32", drafter="ngram", draft_tokens=4, max_seq_len=1024)
    yield eng
    eng.close()


async def collect(engine, messages, params):
    deltas = [d async for d in engine.stream(messages, params)]
    return deltas


# ------------------------------------------------------------------------------ the model

def _hf_model(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype).eval()


def test_llama_logits_match_transformers():
    path = models.ensure("smollm2-135m", "fp32")
    ours = Transformer.from_pretrained(path, "fp32", max_seq_len=128)
    theirs = _hf_model(path)
    ids = torch.randint(0, ours.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    cache = SequenceCache(ours)
    with torch.inference_mode():
        ref = theirs(ids).logits
        full = cache(ids, 0)
        split = torch.cat([cache(ids[:, :16], 0), cache(ids[:, 16:20], 16),
                           *[cache(ids[:, i:i + 1], i) for i in range(20, 24)]], dim=1)
        last = cache(ids, 0, "last")
    scale = ref.abs().max()
    assert (full - ref).abs().max() < 1e-4 * scale
    assert (split - ref).abs().max() < 1e-4 * scale
    assert torch.allclose(last[:, -1], full[:, -1], atol=1e-4 * scale)


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_llama_matches_transformers_on_other_families(tmp_path, model_type):
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                  "qwen3": transformers.Qwen3Config}[model_type]
    config = config_cls(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        max_position_embeddings=128, tie_word_embeddings=model_type == "qwen3",
                        rope_theta=5000.0)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # make biases and norms non-trivial so a missing one shows
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path)
    ours = Transformer.from_pretrained(tmp_path, "fp32", max_seq_len=64)
    ids = torch.randint(0, 300, (2, 12))
    cache = SequenceCache(ours, batch=2)
    with torch.inference_mode():
        ref = hf(ids).logits
        got = torch.cat([cache(ids[:, :7], 0), cache(ids[:, 7:], 7)], dim=1)
    assert (got - ref).abs().max() < 1e-4


def test_bf16_model_matches_float32_math_on_bf16_weights():
    """bf16 weights on CPU: activations are float32, so logits match transformers run in
    float32 on the same (bf16-rounded) weights, and single-token and batched forwards agree.
    With the CPU kernels keys and values are stored as float16 (relative rounding <= 2^-11),
    which moves logits by a few 1e-4 of their scale (float32 caches: < 1e-4)."""
    path = models.ensure("smollm2-135m", "bf16")
    model = Transformer.from_pretrained(path, "bf16", max_seq_len=64)
    reference = _hf_model(path, torch.float32)
    ids = torch.randint(0, model.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ref = reference(ids).logits
        wide = SequenceCache(model)(ids, 0)
        cache = SequenceCache(model)
        step = torch.cat([cache(ids[:, i:i + 1], i) for i in range(10)], dim=1)
    scale = ref.abs().max()
    tolerance = 1e-3 if model.cache_dtype == torch.float16 else 1e-4
    assert (wide - ref).abs().max() < tolerance * scale
    assert (step - ref).abs().max() < tolerance * scale
    assert torch.equal(wide.argmax(-1), step.argmax(-1))
    assert torch.equal(wide.argmax(-1), ref.argmax(-1))


def _ops_or_skip():
    from agentrt.engine.cpu_ops import cpu_ops

    ops = cpu_ops()
    if ops is None:
        pytest.skip("no AVX2 / C compiler here: the plain torch path is in use")
    return ops


def test_cpu_bf16_matmul_rows_are_batch_independent():
    from agentrt.engine.llama import Matmul

    mm = Matmul(torch.bfloat16, torch.float32, _ops_or_skip())
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(37, 72, generator=gen).bfloat16()
    x = torch.randn(27, 72, generator=gen)
    batched = mm(x, w)
    assert (batched - x @ w.float().T).abs().max() < 1e-4
    for rows in (1, 2, 5, 9, 13, 27):
        assert torch.equal(mm(x[:rows], w), batched[:rows])
    residual = torch.randn(27, 37, generator=gen)
    assert torch.equal(mm(x, w, residual=residual), residual + batched)


def test_cpu_fused_ops_match_torch():
    import torch.nn.functional as F

    from agentrt.engine.llama import _grouped_attention, apply_rope

    ops = _ops_or_skip()
    gen = torch.Generator().manual_seed(4)
    x, w = torch.randn(3, 64, generator=gen), torch.randn(64, generator=gen)
    assert torch.allclose(ops.rms_norm(x, w, 1e-5), F.rms_norm(x, (64,), w, 1e-5), atol=1e-5)
    gate_up = torch.randn(2, 96, generator=gen) * 4
    ref = F.silu(gate_up[:, :48]) * gate_up[:, 48:]
    assert torch.allclose(silu_mul(ops, gate_up), ref, rtol=1e-5, atol=1e-5)

    heads, kv_heads, dim, length, start = 6, 2, 32, 40, 37
    rope = torch.polar(torch.ones(64, dim // 2), torch.rand(64, dim // 2, generator=gen) * 6)
    k_cache = torch.randn(1, kv_heads, 64, dim, generator=gen).half()
    v_cache = torch.randn(1, kv_heads, 64, dim, generator=gen).half()
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim, generator=gen)
    expected_qk = apply_rope(qkv[:, :(heads + kv_heads) * dim].view(1, 3, heads + kv_heads, dim),
                             rope[start:start + 3, None])
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_ref[0, :, start:start + 3] = expected_qk[0, :, heads:].transpose(0, 1)  # rounded to float16
    v_ref[0, :, start:start + 3] = qkv[:, (heads + kv_heads) * dim:].view(3, kv_heads, dim).transpose(0, 1)
    block = torch.tensor([0], dtype=torch.int32)  # one sequence, its cache one block of 64 positions
    table = ops.seq_table([(0, 3, start, block)])
    rope_store_paged(ops, qkv, torch.view_as_real(rope).contiguous(), table, heads, kv_heads, dim,
                     k_cache, v_cache)
    rotated = qkv[:, :(heads + kv_heads) * dim].view(1, 3, heads + kv_heads, dim)
    assert torch.allclose(rotated, expected_qk, atol=1e-5)
    assert torch.allclose(k_cache.float(), k_ref.float(), atol=1e-3) and torch.equal(v_cache, v_ref)

    got = attend_paged(ops, qkv, k_cache, v_cache, table, heads, kv_heads, dim)
    groups = heads // kv_heads
    causal = (torch.arange(start + 3)[None, :] <= torch.arange(start, start + 3)[:, None]).repeat(groups, 1)
    ref = _grouped_attention(qkv[:, :heads * dim].view(1, 3, heads, dim),
                             k_cache[:, :, :start + 3].float(), v_cache[:, :, :start + 3].float(),
                             causal)
    assert torch.allclose(got, ref.reshape(3, -1), atol=1e-5)


def _steps(model: Transformer, ids: torch.Tensor, forward=None) -> torch.Tensor:
    """Logits of a prefill, single steps and 3-, 8- and 32-row verify steps over ``ids`` (one
    sequence; ``forward(model, tokens, seqs, pool)``: the step, default the model's)."""
    cuts = [0, 40, 41, 42, 45, 53, 85]
    forward = forward or (lambda m, tokens, seqs, pool: m(tokens, seqs, pool))
    cache = SequenceCache(model)
    with torch.inference_mode():
        return torch.cat([forward(model, ids[0, a:b], [SeqRows(a, b - a, cache.tables[0])],
                                  cache.pool) for a, b in zip(cuts, cuts[1:])])


def test_one_call_step_equals_one_call_per_op():
    _ops_or_skip()
    path = models.ensure("smollm2-135m", "bf16")
    pulled = Transformer.from_pretrained(path, "bf16", max_seq_len=128)
    qwen = qwen_like()  # q/k/v bias, 2 query heads per kv head, random bf16 weights
    for model in (pulled, qwen):
        assert model.ops is not None
        ids = torch.randint(0, model.vocab_size, (1, 85), generator=torch.Generator().manual_seed(8))
        assert torch.equal(_steps(model, ids), _steps(model, ids, per_op_forward))


def test_truncated_model_shares_the_weights_and_runs_its_first_layers():
    """A layer-skip drafter is the first n layers of the target, same weights and blocks, with
    a cache of its own: its logits are the target's head over the target's n-th hidden state."""
    path = models.ensure("smollm2-135m", "bf16")
    target = Transformer.from_pretrained(path, "bf16", max_seq_len=64)
    draft = target.truncated(4)
    assert draft.cfg.num_layers == 4 and len(draft.layers) == 4
    assert all(a is b for a, b in zip(draft.layers, target.layers))
    assert draft.embed is target.embed and draft.packed_head is target.packed_head
    ids = torch.randint(0, target.vocab_size, (1, 12), generator=torch.Generator().manual_seed(9))
    first4 = Transformer.from_pretrained(path, "bf16", max_seq_len=64)  # the same, cut by hand
    del first4.layers[4:]
    first4.cfg = draft.cfg
    with torch.inference_mode():
        assert torch.equal(SequenceCache(draft)(ids, 0), SequenceCache(first4)(ids, 0))
        assert not torch.equal(SequenceCache(draft)(ids, 0), SequenceCache(target)(ids, 0))
    with pytest.raises(ValueError, match="num_layers"):
        target.truncated(31)


def test_torch_fallback_matches_cpu_kernels():
    _ops_or_skip()
    path = models.ensure("smollm2-135m", "bf16")
    fast = Transformer.from_pretrained(path, "bf16", max_seq_len=64)
    plain = Transformer.from_pretrained(path, "bf16", max_seq_len=64, cpu_kernel=False)
    assert fast.ops is not None and plain.ops is None
    ids = torch.randint(0, fast.vocab_size, (1, 9), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        a, b = ([cache(ids[:, :6], 0), cache(ids[:, 6:7], 6), cache(ids[:, 7:], 7)]
                for cache in (SequenceCache(fast), SequenceCache(plain)))
        a, b = torch.cat(a, dim=1), torch.cat(b, dim=1)
    # the fallback rounds single-token activations to bf16 for torch's bf16 matmul
    assert (a - b).abs().max() < 1e-2 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.8


# ----------------------------------------------------------------------------- the config

def test_config_checks_its_fields_and_names_renamed_options():
    assert NativeConfig().replace(drafter=None, draft_tokens=3) == NativeConfig(drafter=None, draft_tokens=3)
    for bad in ({"drafter": "turbo"}, {"draft_tokens": -1}, {"draft_tokens": "many"},
                {"acceptance_threshold": 0.0}, {"block_size": 0}, {"precision": "int4"},
                {"dtype": "bf15"}, {"priority_share": 1.5}, {"kv_cache_bytes": None}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            NativeConfig(**bad)
    with pytest.raises(TypeError, match="'speculation' is now 'drafter'"):
        NativeConfig().replace(speculation=None)
    with pytest.raises(TypeError, match="'num_speculative_tokens' is now 'draft_tokens'"):
        NativeEngine(num_speculative_tokens=4)  # refused before any model loads
    with pytest.raises(TypeError, match="no option \\['turbo'\\]"):
        NativeEngine(turbo=True)


# ------------------------------------------------------------------------- text plumbing

def test_stop_matcher_holds_back_prefixes():
    m = StopStringMatcher(["</code>", "STOP"])
    assert m.push("print(1)</") == ("print(1)", False)
    assert m.push("co") == ("", False)
    assert m.push("de> more") == ("", True)
    m = StopStringMatcher(["STOP"])
    assert m.push("ST") == ("", False)
    assert m.push("ART") == ("START", False)
    assert m.push("S") == ("", False)
    assert m.flush() == "S"


def test_incremental_detokenizer_never_splits_characters(engine):
    tok = engine.tokenizer
    text = "naïve café — 🙂 ok"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok.decode)
    pieces = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


# ----------------------------------------------------------------------------- streaming

async def test_stream_deltas_join_to_full_text(engine):
    deltas = await collect(engine, CODE, SamplingParams(max_tokens=24))
    final = deltas[-1]
    assert final.finish_reason in ("stop", "length")
    assert all(d.finish_reason is None for d in deltas[:-1])
    ids = [t for d in deltas for t in d.token_ids]
    text = "".join(d.text for d in deltas)
    assert text == engine.tokenizer.decode(ids)
    assert final.usage.prompt_tokens > 10
    assert final.usage.completion_tokens == len(ids) + (final.finish_reason == "stop")
    m = final.metrics
    assert m.generated_tokens == final.usage.completion_tokens
    assert m.verify_steps >= 1 and m.wall_s > m.prefill_s > 0
    assert len(deltas) >= 3, "the text must arrive incrementally"


async def test_max_tokens(engine):
    deltas = await collect(engine, LIST, SamplingParams(max_tokens=5))
    assert deltas[-1].finish_reason == "length"
    assert sum(len(d.token_ids) for d in deltas) == 5


async def test_stop_string_spanning_tokens(engine):
    base = await complete(engine, LIST, SamplingParams(max_tokens=40))
    pieces = [engine.tokenizer.decode(base.token_ids[:i]) for i in range(len(base.token_ids) + 1)]
    # a stop string made of the 2 characters before and after a token boundary mid-text
    boundary = len(pieces[len(pieces) // 2])
    stop = base.text[boundary - 2:boundary + 2]
    assert len(stop) == 4 and stop.strip()
    expected = base.text[:base.text.find(stop)]
    got = await complete(engine, LIST, SamplingParams(max_tokens=40, stop=(stop, "never-there")))
    assert got.finish_reason == "stop"
    assert got.text == expected
    assert stop not in got.text


async def test_seeded_sampling_is_reproducible(engine):
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=1234)
    a = await complete(engine, CHAT, params)
    b = await complete(engine, CHAT, params)
    assert a.token_ids == b.token_ids
    others = [await complete(engine, CHAT, SamplingParams(max_tokens=24, temperature=0.9, seed=s))
              for s in (1, 2)]
    assert any(o.token_ids != a.token_ids for o in others)


async def test_cancel_mid_stream_then_clean_request(engine):
    reference = await complete(engine, CHAT, SamplingParams(max_tokens=16))
    stream = engine.stream(LIST, SamplingParams(max_tokens=400))
    received = 0
    async for delta in stream:
        received += 1
        if received == 3:
            break
    await stream.aclose()
    after = await asyncio.wait_for(complete(engine, CHAT, SamplingParams(max_tokens=16)), timeout=120)
    assert after.token_ids == reference.token_ids
    assert after.text == reference.text


async def test_cancelled_task_frees_the_engine(engine):
    async def consume():
        async for _ in engine.stream(LIST, SamplingParams(max_tokens=400)):
            await asyncio.sleep(0)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    done = await asyncio.wait_for(complete(engine, CHAT, SamplingParams(max_tokens=4)), timeout=120)
    assert done.usage.completion_tokens >= 1


async def test_concurrent_requests_match_sequential(engine):
    params = SamplingParams(max_tokens=16)
    sequential = [await complete(engine, m, params) for m in (CODE, CHAT)]
    concurrent = await asyncio.gather(complete(engine, CODE, params), complete(engine, CHAT, params))
    assert [c.token_ids for c in concurrent] == [s.token_ids for s in sequential]
    assert [c.text for c in concurrent] == [s.text for s in sequential]


async def test_too_long_prompt_is_an_error_and_engine_survives(engine):
    huge = [{"role": "user", "content": "word " * 1200}]
    with pytest.raises(EngineError, match="max_seq_len"):
        await complete(engine, huge, SamplingParams(max_tokens=4))
    ok = await complete(engine, CHAT, SamplingParams(max_tokens=4))
    assert ok.usage.completion_tokens >= 1


async def test_metrics_aggregate_and_remember(engine):
    before = engine.metrics().verify_steps
    engine.remember("def add(a, b):\n    return a + b\n")
    await complete(engine, CODE, SamplingParams(max_tokens=8))
    after = engine.metrics()
    assert after.verify_steps > before
    assert after.to_dict()["tau"] >= 1.0


async def test_default_bf16_engine_with_adaptive_suffix_speculation():
    eng = NativeEngine(max_seq_len=512)  # bf16, suffix drafts, adaptive k
    try:
        first = await complete(eng, LIST, SamplingParams(max_tokens=24))
        second = await complete(eng, LIST, SamplingParams(max_tokens=24))
        assert first.text and first.finish_reason in ("stop", "length")
        assert eng._policy is not None and eng._policy.costs(8) > 0
        # the suffix corpus now holds the first answer: the repeat is drafted from it
        assert second.metrics.draft_tokens > 0
        assert not eng.metrics().lossy
    finally:
        await eng.aclose()


async def test_draft_model_speculation_with_sampling():
    eng = NativeEngine(dtype="fp32", drafter="draft", draft_model=6, draft_tokens=3,
                       max_seq_len=512)
    plain = NativeEngine(dtype="fp32", drafter=None, max_seq_len=512)
    try:
        greedy = SamplingParams(max_tokens=12)
        drafted = await complete(eng, CODE, greedy)
        assert drafted.token_ids == (await complete(plain, CODE, greedy)).token_ids
        sampled = await complete(eng, CHAT, SamplingParams(max_tokens=12, temperature=0.7, seed=5))
        assert sampled.metrics.draft_tokens > 0 and sampled.usage.completion_tokens >= 1
    finally:
        await eng.aclose()
        await plain.aclose()


async def test_lossy_threshold_is_reported():
    eng = NativeEngine(dtype="fp32", drafter="ngram", draft_tokens=3,
                       acceptance_threshold=0.5, max_seq_len=512)
    try:
        out = await complete(eng, LIST, SamplingParams(max_tokens=8, temperature=0.8, seed=3))
        assert out.metrics.lossy and eng.metrics().lossy
    finally:
        await eng.aclose()
