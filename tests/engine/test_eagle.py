"""The learned draft head (engine/eagle, drafters/eagle.py) on the real SmolLM2-135M: feature
capture in the forward, the head's directory format, refusal of a head made for another target,
the training prompt mix kept apart from every evaluation prompt, the tiny training recipe (and
its resumption), and drafting with the head: greedy output identical to plain decoding on the
benchmark prompts, alone and batched, exact and int8; sampled drafts keep the target's
distribution."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from agentrt.engine import NativeEngine, SamplingParams, complete, models
from agentrt.engine.drafters.base import DraftSampling
from agentrt.engine.drafters.eagle import EagleDrafter
from agentrt.engine.eagle import DraftHead, HeadConfig, TargetMismatchError
from agentrt.engine.eagle.data import FeatureRecorder, generate_samples, record_features
from agentrt.engine.eagle.training_prompts import (PromptOverlapError, check_no_overlap,
                                                   heldout_texts, training_prompts)
from agentrt.engine.eagle.train import RECIPES, train
from agentrt.engine.llama import LlamaConfig, SeqRows, Transformer
from agentrt.kernels import probs_from_logits, stochastic_verify

PROMPT_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts"
PROMPTS = [json.loads(line) for name in ("agent_code", "chat", "copy_heavy")
           for line in (PROMPT_DIR / f"{name}.jsonl").read_text().splitlines() if line.strip()]
LAYERS = (2, 15, 27)


@pytest.fixture(scope="module")
def target() -> Transformer:
    return Transformer.from_pretrained(models.ensure("smollm2-135m", "bf16"), "bf16")


@pytest.fixture(scope="module")
def tiny_head(tmp_path_factory) -> Path:
    """The tiny recipe's head, made once for the module by the command line."""
    from agentrt.cli import main

    out = tmp_path_factory.mktemp("head") / "eagle"
    assert main(["draft", "train", "--model", "smollm2-135m", "--recipe", "tiny", "--out", str(out)]) == 0
    return out


def run(engine, prompts, params, batched: bool) -> list[list[int]]:
    async def go():
        if batched:
            done = await asyncio.gather(*(complete(engine, p["messages"], params) for p in prompts))
        else:
            done = [await complete(engine, p["messages"], params) for p in prompts]
        return [list(c.token_ids) for c in done]

    return asyncio.run(go())


# ------------------------------------------------------------------------------- capture

def test_capture_returns_the_residual_stream_entering_the_layers(target):
    """Logits are unchanged by capturing; the features are the stream entering each layer (the
    CPU kernels run the layers in slices and agree with the torch path to rounding)."""
    tokens = torch.arange(100, 148)

    def forward(model, capture=()):
        pool = model.new_pool(2, 64)
        return model(tokens, [SeqRows(0, tokens.numel(), torch.arange(2, dtype=torch.int32))],
                     pool, None, capture)

    plain = forward(target)
    logits, features = forward(target, LAYERS)
    assert torch.equal(plain, logits)
    assert features.shape == (tokens.numel(), 3 * target.cfg.hidden_size)
    torch_path = Transformer.from_pretrained(models.ensure("smollm2-135m", "bf16"), "bf16",
                                             cpu_kernel=False)
    _, reference = forward(torch_path, LAYERS)
    assert torch.allclose(features, reference, rtol=1e-2, atol=5e-2)
    only_low = forward(target, (2,))[1]
    assert torch.equal(only_low, features[:, :target.cfg.hidden_size])
    with pytest.raises(ValueError, match="ascending layer indices"):
        forward(target, (15, 2))


def test_features_recorded_while_generating_equal_one_prefill_pass(target):
    """The recorder's features (prompt prefill + every decode step, batched with another
    request) are bit for bit those of one prefill pass over prompt + reply."""
    recorder = FeatureRecorder(LAYERS)
    engine = NativeEngine(drafter=recorder, draft_tokens=1, prefix_cache=False)
    samples = {}
    try:
        prompts = [PROMPTS[0]["messages"], PROMPTS[9]["messages"]]
        generate_samples(engine, recorder, prompts, 12, 0.5, 0,
                         lambda i, s: samples.__setitem__(i, s))
    finally:
        engine.close()
    for sample in samples.values():
        features, labels = record_features(target, sample.tokens.tolist(), LAYERS)
        assert torch.equal(sample.features, features[:-1])
        assert sample.labels[sample.prompt_len - 1:-1].tolist() == sample.tokens[sample.prompt_len:].tolist()
    greedy = samples[0]  # prompt 0 is answered greedily: its labels are the target's argmax
    _, labels = record_features(target, greedy.tokens.tolist(), LAYERS)
    assert torch.equal(labels[greedy.prompt_len - 1:-1], greedy.labels[greedy.prompt_len - 1:-1])


# -------------------------------------------------------------------------------- format

def test_head_directory_has_the_shared_layout(tiny_head):
    config = json.loads((tiny_head / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and config["tie_word_embeddings"] is False
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": list(LAYERS),
                                      "use_aux_hidden_state": True}
    assert config["agentrt"]["target"] == "smollm2-135m" and config["agentrt"]["format_version"] == 1
    H, V, Vd = 576, 49152, config["draft_vocab_size"]
    expected = {"fc.weight": [H, 3 * H], "midlayer.input_layernorm.weight": [H],
                "midlayer.hidden_norm.weight": [H], "midlayer.self_attn.q_proj.weight": [576, 2 * H],
                "midlayer.self_attn.k_proj.weight": [192, 2 * H],
                "midlayer.self_attn.v_proj.weight": [192, 2 * H],
                "midlayer.self_attn.o_proj.weight": [H, 576],
                "midlayer.post_attention_layernorm.weight": [H],
                "midlayer.mlp.gate_proj.weight": [1536, H], "midlayer.mlp.up_proj.weight": [1536, H],
                "midlayer.mlp.down_proj.weight": [H, 1536], "norm.weight": [H],
                "lm_head.weight": [Vd, H], "d2t": [Vd], "t2d": [V]}
    with safe_open(str(tiny_head / "model.safetensors"), "pt") as f:
        shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
        d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
    assert shapes == expected
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool
    ids = torch.arange(Vd) + d2t  # target_id = draft_id + d2t[draft_id]
    assert torch.equal(t2d.nonzero().flatten(), ids) and int(t2d.sum()) == Vd
    head = DraftHead.load(tiny_head)
    again = DraftHead.load(head.save(tiny_head.parent / "copy"))
    for (name, a), (_, b) in zip(head.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_native_and_vllm_layout_code_read_each_others_heads(tiny_head, tmp_path):
    """One format: the trained head passes the layout check vLLM runs are gated on, and a head
    written by the layout writer alone (random weights) loads and drafts in the native engine."""
    import sys

    from agentrt.engine.eagle3_layout import check_head

    target_dir = models.ensure("smollm2-135m", "bf16")
    assert check_head(tiny_head, target_dir)["agentrt"]["recipe"] == "tiny"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from eagle3_heads import random_head

    foreign = DraftHead.load(random_head(tmp_path / "random", target_dir, draft_vocab_size=512))
    assert foreign.config.draft_vocab_size == 512 and foreign.config.aux_layers == LAYERS
    engine = NativeEngine(drafter="eagle", draft_head=tmp_path / "random", max_seq_len=1024)
    plain = NativeEngine(drafter=None, max_seq_len=1024)
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0)
        assert run(engine, PROMPTS[:1], params, False) == run(plain, PROMPTS[:1], params, False)
    finally:
        engine.close()
        plain.close()


def test_head_for_another_target_is_refused_naming_both(tiny_head, tmp_path):
    config = HeadConfig.from_json(json.loads((tiny_head / "config.json").read_text()))
    other = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12,
                        num_heads=12, num_kv_heads=4, head_dim=64)
    small = HeadConfig.for_target("tiny-llama", other, 64)
    DraftHead(small).save(tmp_path / "other")
    with pytest.raises(TargetMismatchError) as err:
        NativeEngine(drafter="eagle", draft_head=tmp_path / "other")
    message = str(err.value)
    for fact in ("'tiny-llama'", "hidden size 768", "vocabulary 32000", "'smollm2-135m'",
                 "hidden size 576", "vocabulary 49152"):
        assert fact in message
    from agentrt.engine.eagle import check_target

    with pytest.raises(TargetMismatchError, match="trained for 'smollm2-135m'"):
        check_target(config, "other-model", LlamaConfig.from_dir(models.ensure("smollm2-135m")))


def test_missing_head_names_the_command_that_makes_one(tmp_path):
    with pytest.raises(FileNotFoundError, match="agentrt draft train"):
        NativeEngine(drafter="eagle", draft_head=tmp_path / "nothing")


# ----------------------------------------------------------------------- the prompt mix

def test_training_prompts_do_not_overlap_any_evaluation_prompt():
    heldout = heldout_texts()
    where = {w.split(":")[0] for w, _ in heldout}
    assert {"benchmarks/prompts/agent_code.jsonl", "benchmarks/prompts/chat.jsonl",
            "benchmarks/oolong/trajectories.py", "benchmarks/oolong/root_prompt.py",
            "tests/engine/test_eagle.py"} <= where
    for recipe in RECIPES.values():
        prompts = training_prompts(recipe.prompts, recipe.seed, recipe.mix)
        assert check_no_overlap(prompts, heldout) == len(heldout)
    kinds = {kind for kind, _ in training_prompts(200)}
    assert kinds == {"agent", "chat", "code"}


@pytest.mark.parametrize("source", ["agent_code", "oolong"])
def test_overlap_check_fails_on_an_evaluation_prompt(source):
    prompts = training_prompts(20)
    heldout = heldout_texts()
    if source == "agent_code":
        leaked = PROMPTS[0]["messages"][1]  # a benchmark user turn, verbatim
    else:
        text = next(t for w, t in heldout if w.startswith("benchmarks/oolong/root_prompt.py")
                    and len(t.split()) > 12)
        leaked = {"role": "user", "content": "Please help. " + text}
    with pytest.raises(PromptOverlapError, match="overlaps the held-out text"):
        check_no_overlap([*prompts, ("agent", [leaked])], heldout)


# ---------------------------------------------------------------------------- training

def test_tiny_training_resumes_from_its_checkpoint(tmp_path):
    messages = []
    out = train("smollm2-135m", "tiny", tmp_path, progress=False, stop_after=2, log=messages.append)
    assert (out / ".work" / "checkpoint.pt").is_file() and not (out / "config.json").exists()
    samples = sorted((out / ".work" / "samples").glob("*.pt"))
    assert len(samples) == RECIPES["tiny"].prompts
    stamps = [s.stat().st_mtime_ns for s in samples]
    messages.clear()
    train("smollm2-135m", "tiny", tmp_path, progress=False, log=messages.append)
    assert any("resumed at step 2 of 4" in m for m in messages)
    assert [s.stat().st_mtime_ns for s in samples] == stamps, "replies were generated again"
    head = DraftHead.load(out)
    assert head.config.recipe == "tiny" and head.config.data["prompts"] == RECIPES["tiny"].prompts
    # other training settings keep the replies and train afresh; other reply settings do not
    messages.clear()
    longer = dataclasses.replace(RECIPES["tiny"], steps=5)
    train("smollm2-135m", longer, tmp_path, progress=False, log=messages.append)
    assert not any("resumed" in m for m in messages) and any("trained 5 steps" in m for m in messages)
    assert [s.stat().st_mtime_ns for s in samples] == stamps, "replies were generated again"
    train("smollm2-135m", dataclasses.replace(longer, max_tokens=10), tmp_path, progress=False,
          log=messages.append)
    assert [s.stat().st_mtime_ns for s in samples] != stamps


# ----------------------------------------------------------------------------- drafting

@pytest.fixture(scope="module")
def plain_outputs():
    engine = NativeEngine(drafter=None)
    cache: dict = {}

    def outputs(prompts, max_tokens):
        key = (tuple(p["id"] for p in prompts), max_tokens)
        if key not in cache:
            cache[key] = run(engine, prompts, SamplingParams(max_tokens=max_tokens), batched=True)
        return cache[key]

    yield outputs
    engine.close()


@pytest.mark.parametrize("drafter", ["eagle", "hybrid"])
def test_greedy_with_the_head_equals_plain_alone_and_batched(tiny_head, plain_outputs, drafter):
    prompts = PROMPTS[::4]
    engine = NativeEngine(drafter=drafter, draft_head=tiny_head, draft_tokens=4)
    try:
        want = plain_outputs(prompts, 16)
        assert run(engine, prompts, SamplingParams(max_tokens=16), batched=False) == want
        assert run(engine, prompts, SamplingParams(max_tokens=16), batched=True) == want
        assert engine.metrics().drafts > 0, "nothing was drafted: the test would prove nothing"
    finally:
        engine.close()


def test_greedy_with_the_head_equals_plain_in_int8(tiny_head):
    plain = NativeEngine(drafter=None, precision="int8")
    if plain.model.int8_head is None:
        plain.close()
        pytest.skip("no AVX2 / C compiler here: int8 precision runs exactly")
    engine = NativeEngine(drafter="eagle", draft_head=tiny_head, precision="int8")
    try:
        prompts, params = PROMPTS[1::6], SamplingParams(max_tokens=16)
        assert run(engine, prompts, params, batched=True) == run(plain, prompts, params, batched=True)
        assert engine.metrics().drafts > 0
    finally:
        engine.close()
        plain.close()


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("drafter", ["eagle", "hybrid"])
def test_greedy_with_the_head_equals_plain_on_every_benchmark_prompt(tiny_head, plain_outputs, drafter):
    engine = NativeEngine(drafter=drafter, draft_head=tiny_head)
    try:
        want = plain_outputs(PROMPTS, 48)
        assert run(engine, PROMPTS, SamplingParams(max_tokens=48), batched=False) == want
        assert run(engine, PROMPTS, SamplingParams(max_tokens=48), batched=True) == want
    finally:
        engine.close()


def test_sampled_head_drafts_keep_the_target_distribution():
    """The head's draft distribution covers only its draft vocabulary (q = 0 elsewhere) and sums
    to 1; rejection sampling against it emits the target's distribution p."""
    cfg = LlamaConfig(vocab_size=12, hidden_size=64, intermediate_size=128, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=16)
    head = DraftHead(HeadConfig.for_target("toy", cfg, 5))
    head.set_vocabulary([1, 3, 4, 8, 11])
    torch.manual_seed(0)
    embed = torch.randn(12, 64)
    drafter = EagleDrafter(head, embed)
    gen = torch.Generator().manual_seed(1)
    state = drafter.begin([1, 2, 3], DraftSampling(temperature=0.9, generator=gen))
    state.add_features(0, torch.randn(2, 3 * 64))
    draft = state.draft(2)
    q = draft.probs
    assert q.shape == (2, 12) and len(draft.tokens) == 2
    assert torch.allclose(q.sum(-1), torch.ones(2))
    outside = [t for t in range(12) if t not in (1, 3, 4, 8, 11)]
    assert q[:, outside].abs().max() == 0
    assert set(draft.tokens) <= {1, 3, 4, 8, 11}
    n = 40_000
    p = probs_from_logits(torch.randn(3, 12, generator=gen), 1.0)
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=gen)
                          for i in range(2)], dim=1)
    accepted, nxt = stochastic_verify(drafts, q.expand(n, 2, 12), p.expand(n, 3, 12),
                                      torch.rand(n, 2, generator=gen), torch.rand(n, generator=gen))
    first = torch.where(accepted > 0, drafts[:, 0], nxt)
    empirical = torch.bincount(first, minlength=12).double() / n
    tv = 0.5 * (empirical - p[0].double()).abs().sum().item()
    assert tv < math.sqrt(12 / n), f"total variation {tv:.4f} from the target"


# ------------------------------------------------------------------- command line, bench

def test_draft_eval_prints_acceptance_per_position(tiny_head, capsys):
    from agentrt.cli import main

    assert main(["draft", "eval", "--head", str(tiny_head), "--prompts", "2",
                 "--draft-tokens", "3", "--max-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "2 held-out prompts, 3 drafted tokens per step" in out
    assert "mean accepted length" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2", "3"] and int(rows[0][1]) > 0


def test_engine_benchmark_runs_the_head_systems(tiny_head, tmp_path):
    from benchmarks.engine import cli

    options = json.dumps({"draft_head": str(tiny_head)})
    code = cli.main(["--systems", "plain,eagle,hybrid", "--sets", "chat", "--limit", "1",
                     "--max-tokens", "8", "--drafter-config", options, "--out", str(tmp_path)])
    assert code == 0
    (result,) = tmp_path.glob("engine-*.json")
    rows = json.loads(result.read_text())["rows"]
    texts = {r["system"]: r["text"] for r in rows}
    assert set(texts) == {"plain", "eagle", "hybrid"}
    assert texts["eagle"] == texts["plain"] == texts["hybrid"]


def test_hybrid_takes_the_draft_with_more_expected_tokens_per_second():
    """The suffix lookup's draft when its match-length bucket is accepted more often per unit
    of cost than the head's drafts (at their cost for the sequence's length), or when it
    matched 4+ tokens that are mostly accepted; else the head's."""
    from agentrt.engine.draft_policy import AdaptiveK, StepCosts
    from agentrt.engine.drafters.hybrid import HybridDrafter
    from agentrt.engine.drafting import choose_drafts, draft_models
    from agentrt.engine.step_plan import DecodeRows

    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=4,
                      num_heads=2, num_kv_heads=1, head_dim=16)
    head = DraftHead(HeadConfig.for_target("toy", cfg, 40))
    head.set_vocabulary(range(40))
    torch.manual_seed(0)
    drafter = HybridDrafter(EagleDrafter(head, torch.randn(40, 32)))
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 5, 6, 7, 8, 9, 10]  # ends in a long repeat
    state = drafter.begin(prompt)
    state.add_features(0, torch.randn(len(prompt) - 1, 3 * 32))
    class Seq:  # the fields choose_drafts reads of a request (one token out: it may draft)
        params, produced, computed, priority = SamplingParams(max_tokens=50), 1, len(prompt) - 1, 0

    seq = Seq()
    seq.state = state
    lookup = state.lookup_draft(8)
    assert lookup.match_len >= 4 and lookup.tokens[:2] == [11, 12]

    def plan(lookup_hits: float, head_hits: float, lookup_accepted: tuple[int, ...] = (),
             computed: int = len(prompt) - 1) -> list[int]:
        seq.computed = computed
        # a head step costs 1 ms up to 1000 positions, 50 ms beyond
        policy = AdaptiveK(StepCosts({1: 0.01, 8: 0.012, 16: 0.02}), max_k=8,
                           draft_cost_per_token=lambda context: 0.001 if context < 1000 else 0.05)
        for i in range(30):
            accepted = lookup_accepted[i % len(lookup_accepted)] if lookup_accepted else round(8 * lookup_hits)
            policy.observe(8, accepted, AdaptiveK.bucket_of(lookup.match_len))
            policy.observe(8, round(8 * head_hits), 0)
        (choice,) = choose_drafts([seq], drafter, policy, 8, 4096).values()
        rows = DecodeRows(seq, choice.tokens, choice.draft, choice.model_k)
        draft_models(drafter, [rows])
        drafted, draft = rows.drafted, rows.draft
        assert draft.match_len == (lookup.match_len if drafted[:1] == [11] else 0)
        return drafted

    assert plan(lookup_hits=1.0, head_hits=0.5)[:2] == [11, 12]
    # a long match accepted most of the time drafts even where the head's rate looks higher
    # (its first token accepted 2 times in 3, never the third: by rates alone, the head)
    assert plan(0.0, head_hits=1.0, lookup_accepted=(2, 2, 0))[:2] == [11, 12]
    from_head = plan(lookup_hits=0.0, head_hits=1.0)
    assert from_head and from_head == state.model_draft(len(from_head)).tokens
    # the lookup's first token accepted 1 time in 3: the head's drafts at a short context, the
    # lookup's at a long one, where each head step costs more than the whole verify forward
    assert plan(0.0, head_hits=1.0, lookup_accepted=(2, 0, 0)) == from_head
    assert plan(0.0, head_hits=1.0, lookup_accepted=(2, 0, 0), computed=2000)[:2] == [11, 12]


def test_training_forward_computes_what_drafting_computes():
    """Training-time test step j at position t equals drafting j tokens after position t - j:
    the head's cache over the target's features up to t - j, then its own outputs."""
    cfg = LlamaConfig(vocab_size=30, hidden_size=32, intermediate_size=64, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=8)
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target("toy", cfg, 30)).eval()
    T = 10
    features, embeds = torch.randn(1, T, 3 * 32), torch.randn(1, T, 32)
    with torch.no_grad():
        steps = head.train_forward(features, embeds, torch.arange(T), 3)
        from agentrt.engine.eagle.head import HeadCache

        for last in (3, 6):  # the target's features reach position `last`
            cache = HeadCache.empty(head.config, 4)
            out = head.extend(cache, head.fuse(features[0, :last + 1]), embeds[0, :last + 1])
            assert torch.allclose(out, steps[0][0, :last + 1], atol=1e-5)
            h = out[-1:]
            for j in (1, 2):  # draft step j sits at position last + j
                h = head.extend(cache, h, embeds[0, last + j:last + j + 1])
                assert torch.allclose(h[0], steps[j][0, last + j], atol=1e-5), (last, j)


def test_a_shared_prefix_reuses_the_head_cache_of_a_finished_request():
    """A request whose prompt prefix was served from the target's prefix cache gets no
    features there; the head then starts from a finished request's cache of that prefix and
    drafts exactly what it drafts with every feature."""
    cfg = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=4,
                      num_heads=2, num_kv_heads=1, head_dim=16)
    torch.manual_seed(0)
    head = DraftHead(HeadConfig.for_target("toy", cfg, 40))
    head.set_vocabulary(range(40))
    drafter = EagleDrafter(head, torch.randn(40, 32))
    shared = list(range(3, 20))
    first, second = shared + [21, 22, 23], shared + [30, 31]
    features = {tuple(first): torch.randn(len(first), 96)}
    features[tuple(second)] = torch.cat([features[tuple(first)][:len(shared)], torch.randn(2, 96)])
    done = drafter.begin(first)
    done.add_features(0, features[tuple(first)][:-1])
    done.draft(2)
    done.end()
    fresh = EagleDrafter(head, drafter.embed).begin(second)
    fresh.add_features(0, features[tuple(second)][:-1])
    reused = drafter.begin(second)
    assert reused.cache.length == len(shared) - 1
    cached = 16  # the target computed only from here on
    reused.add_features(cached, features[tuple(second)][cached:-1])
    with torch.no_grad():
        assert reused.draft(3).tokens == fresh.draft(3).tokens
        assert torch.allclose(reused.last_out, fresh.last_out, atol=1e-5)
    drafter.reset()
    assert drafter.begin(second).cache.length == 0
