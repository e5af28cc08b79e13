"""`train`: make a draft head for a target model, in resumable stages.

Stages:

1. the training prompt mix (`prompts.training_prompts`), checked against every held-out prompt
   set (`prompts.check_no_overlap`);
2. the target's replies on the batched native engine, the features of its three feature layers
   recorded as it runs (`data.generate_samples`), and the draft vocabulary (the label tokens
   covering `Recipe.coverage` of all labels);
3. training with training-time test (`DraftHead.train_forward`, `Recipe.ttt_steps` steps ahead),
   AdamW with warm-up and cosine decay; the head starts from the target's output head and
   final norm, with ``fc`` passing the highest feature layer through.

The work directory (``<out>/.work``) keeps what each stage made, so an interrupted run resumes
where it stopped (``samples/`` grows reply by reply, ``checkpoint.pt`` every
`Recipe.checkpoint_every` steps); a recipe that changes only how the head is trained keeps the
replies and trains afresh.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..llama import LlamaConfig, Transformer
from ..models import resolve
from .data import FeatureRecorder, Sample, draft_vocabulary, generate_samples
from .head import DraftHead, HeadConfig, default_aux_layers, head_dir
from .training_prompts import check_no_overlap, digest, heldout_texts, training_prompts


@dataclass(frozen=True)
class Recipe:
    """How a head is trained (see `RECIPES`)."""

    name: str
    prompts: int
    """Training prompts (the mix of `prompts.training_prompts`)."""
    max_tokens: int
    """Longest reply generated per prompt."""
    sampled_share: float
    """Share of prompts answered by sampling (the rest greedily)."""
    coverage: float
    """Share of training labels the draft vocabulary covers."""
    steps: int
    """Optimizer steps."""
    batch: int
    """Sequences per step."""
    window: int
    """Longest stretch of a sequence one step trains on (a random window of longer ones)."""
    context: int
    """Prompt positions kept before the reply in a training window (the head attends to them;
    they carry no label)."""
    ttt_steps: int
    """Steps ahead of training-time test."""
    mix: tuple[float, float, float] = (0.5, 0.25, 0.25)
    """Shares of agent, chat and code prompts."""
    lr: float = 1e-3
    warmup: int = 20
    min_vocab: int = 256
    checkpoint_every: int = 25
    max_num_seqs: int = 16
    """Requests the engine batches while generating replies."""
    precision: str = "exact"
    """Precision of the target while it generates the replies (``int8`` is ~1.4x faster)."""
    seed: int = 0


RECIPES: dict[str, Recipe] = {
    "default": Recipe("default", prompts=1600, max_tokens=128, sampled_share=0.25, coverage=0.95,
                      steps=400, batch=8, window=192, context=64, ttt_steps=3, max_num_seqs=64,
                      precision="int8"),
    "tiny": Recipe("tiny", prompts=4, max_tokens=12, sampled_share=0.5, coverage=0.95, steps=4,
                   batch=2, window=48, context=48, ttt_steps=2, mix=(0.0, 0.5, 0.5), warmup=1,
                   min_vocab=64, checkpoint_every=2, max_num_seqs=4),
}


def log_to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def train(model: str = "smollm2-135m", recipe: str | Recipe = "default", out: str | Path | None = None,
          *, threads: int | None = None, progress: bool = True, resume: bool = True,
          log: Callable[[str], None] = log_to_stderr, stop_after: int | None = None) -> Path:
    """Train a draft head for ``model`` with ``recipe`` and write it to ``out`` (default:
    `head.head_dir` of the model); returns that directory. ``resume``: continue from what an
    earlier run left in ``<out>/.work`` (same recipe and prompts), else start over.
    ``stop_after``: stop after that many optimizer steps in total (leaving a checkpoint), for
    tests of resumption."""
    r = RECIPES[recipe] if isinstance(recipe, str) else recipe
    if threads:
        torch.set_num_threads(threads)
    out = Path(out) if out is not None else head_dir(model)
    work = out / ".work"
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()

    prompts = training_prompts(r.prompts, r.seed, r.mix)
    heldout = heldout_texts()
    check_no_overlap(prompts, heldout)
    state = _work_state(r, digest(prompts))
    state_file = work / "state.json"
    before = json.loads(state_file.read_text()) if resume and state_file.is_file() else {}
    if before.get("data") != state["data"]:  # other replies: start over
        for stale in work.iterdir():
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    elif before.get("train") != state["train"]:  # same replies, other training: keep the replies
        for stale in ("checkpoint.pt", "done"):
            (work / stale).unlink(missing_ok=True)
    state_file.write_text(json.dumps(state))
    log(f"draft train: {model}, recipe {r.name}: {len(prompts)} prompts (no overlap with "
        f"{len(heldout)} held-out texts), work dir {work}")

    target, samples = _generate(model, r, prompts, work, progress)
    replies = sum(s.tokens.numel() - s.prompt_len for s in samples)
    tokens = sum(s.tokens.numel() for s in samples)
    vocab = draft_vocabulary(samples, r.coverage, r.min_vocab)
    data = {"prompt_digest": state["data"]["prompt_digest"], "prompts": len(prompts),
            "tokens": tokens, "reply_tokens": replies, "heldout_texts_checked": len(heldout)}
    config = HeadConfig.for_target(model, target.cfg, len(vocab), r.name, data)
    head = _initial_head(config, target, vocab)
    log(f"data: {len(samples)} sequences, {tokens} tokens ({replies} generated); draft "
        f"vocabulary {len(vocab)} tokens ({r.coverage:.0%} of labels)")
    _fit(head, target, samples, r, work, progress, log, stop_after)
    if stop_after is not None and not (work / "done").is_file():
        return out
    head.config = HeadConfig(**{**asdict(config), "data": {
        **data, "train_wall_s": round(time.perf_counter() - started, 1)}})
    head.save(out)
    log(f"wrote {out} in {time.perf_counter() - started:.0f} s")
    return out


_DATA_FIELDS = ("prompts", "max_tokens", "sampled_share", "mix", "precision", "seed")
"""Recipe fields the generated replies depend on (the rest only shape the training)."""


def _work_state(r: Recipe, prompts_digest: str) -> dict:
    """What a work directory was made with: the replies' inputs and the training's."""
    recipe = json.loads(json.dumps(asdict(r)))
    data = {k: recipe.pop(k) for k in _DATA_FIELDS}
    return {"data": {**data, "prompt_digest": prompts_digest}, "train": recipe}


def _generate(model: str, r: Recipe, prompts, work: Path, progress: bool) -> tuple[Transformer, list[Sample]]:
    """Stage 2: the target's replies and features, one file per prompt in
    ``work/samples`` (prompts already there are not run again)."""
    from tqdm import tqdm

    from ..native import NativeEngine

    folder = work / "samples"
    folder.mkdir(exist_ok=True)
    done = {int(f.stem): f for f in folder.glob("*.pt")}
    recorder = FeatureRecorder(default_aux_layers(LlamaConfig.from_dir(resolve(model)).num_layers))
    engine = NativeEngine(model, drafter=recorder, draft_tokens=1, prefix_cache=False,
                          max_num_seqs=r.max_num_seqs, seed=r.seed, max_batch_tokens=1024,
                          precision=r.precision)
    bar = tqdm(total=len(prompts), initial=len(done), desc="replies", unit="prompt",
               disable=not progress, file=sys.stderr)

    def on_done(i: int, sample: Sample) -> None:
        path = folder / f"{i:05d}.pt"
        torch.save(asdict(sample), path.with_suffix(".tmp"))
        path.with_suffix(".tmp").replace(path)
        done[i] = path
        bar.update(1)

    try:
        generate_samples(engine, recorder, [m for _, m in prompts], r.max_tokens,
                         r.sampled_share, r.seed, on_done, skip=set(done))
    finally:
        bar.close()
        engine.close()
    return engine.model, [Sample(**torch.load(done[i])) for i in sorted(done)]


def _initial_head(config: HeadConfig, target: Transformer, vocab: list[int]) -> DraftHead:
    """A head that starts as an early exit: ``fc`` passes the highest feature layer through,
    the layer's output projections start near zero, the output head and final norm are the
    target's (restricted to the draft vocabulary)."""
    torch.manual_seed(0)
    head = DraftHead(config)
    head.set_vocabulary(vocab)
    H = config.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, 2 * config.target_hidden_size:] = torch.eye(H)
        head.midlayer.self_attn.o_proj.weight.mul_(0.1)
        head.midlayer.mlp.down_proj.weight.mul_(0.1)
        head.lm_head.weight.copy_(target.lm_head.detach().float()[head.target_ids()])
        head.norm.weight.copy_(target.norm.detach().float())
    return head


def _fit(head: DraftHead, target: Transformer, samples: list[Sample], r: Recipe, work: Path,
         progress: bool, log, stop_after: int | None) -> None:
    """Stage 4: AdamW over training-time-test losses, checkpointed in ``work``."""
    from tqdm import tqdm

    embed = target.embed.detach()
    to_draft = head.draft_ids(torch.arange(head.config.target_vocab_size))
    optimizer = torch.optim.AdamW(head.parameters(), lr=r.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / r.warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, r.steps) / r.steps))))
    step, rng = 0, random.Random(r.seed)
    checkpoint = work / "checkpoint.pt"
    if (work / "done").is_file():
        head.load_state_dict(torch.load(checkpoint, weights_only=False)["head"])
        return
    if checkpoint.is_file():
        saved = torch.load(checkpoint, weights_only=False)
        head.load_state_dict(saved["head"])
        optimizer.load_state_dict(saved["optimizer"])
        schedule.load_state_dict(saved["schedule"])
        step = saved["step"]
        rng.setstate(saved["rng"])
        log(f"resumed at step {step} of {r.steps}")
    head.train()
    bar = tqdm(total=r.steps, initial=step, desc="train", unit="step", disable=not progress,
               file=sys.stderr)
    try:
        while step < r.steps:
            batch = [samples[rng.randrange(len(samples))] for _ in range(r.batch)]
            with torch.autocast("cpu", dtype=torch.bfloat16):  # ~2.5x faster on CPU
                losses, accuracy = _ttt_loss(head, embed, to_draft, batch, r, rng)
            loss = sum(0.8 ** j * l for j, l in enumerate(losses)) / sum(0.8 ** j for j in range(len(losses)))
            optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{a:.2f}" for a in accuracy))
            finished = step == r.steps
            if finished or step % r.checkpoint_every == 0 or step == stop_after:
                torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(),
                            "schedule": schedule.state_dict(), "step": step,
                            "rng": rng.getstate()}, checkpoint)
            if finished:
                (work / "done").write_text(str(step))
            if stop_after is not None and step >= stop_after:
                break
    finally:
        bar.close()
        head.eval()
    if step == r.steps:
        log(f"trained {step} steps; last loss {loss.item():.3f}, teacher-forced accuracy per "
            f"step ahead {[round(a, 3) for a in accuracy]}")


def _ttt_loss(head: DraftHead, embed: torch.Tensor, to_draft: torch.Tensor, batch: list[Sample],
              r: Recipe, rng: random.Random) -> tuple[list[torch.Tensor], list[float]]:
    """Losses (and top-1 accuracies) of each training-time-test step over a batch: row t reads
    features at t and the token at t+1, and learns the target's argmax after t+1."""
    windows = []
    for s in batch:
        n = s.tokens.numel() - 1  # rows with a next token
        first = max(0, s.prompt_len - 2)  # the first row with a label (the reply's)
        if n - first <= r.window:  # the whole reply, after up to `context` prompt rows
            start = max(0, first - r.context, n - r.window)
        else:
            start = rng.randrange(first, n - r.window + 1)
        windows.append((s, start, min(n, start + r.window)))
    T = max(stop - start for _, start, stop in windows)
    B = len(batch)
    width = batch[0].features.shape[1]
    feats = torch.zeros(B, T, width)
    nxt = torch.zeros(B, T, dtype=torch.long)
    labels = torch.full((B, T), -1, dtype=torch.long)
    positions = torch.arange(T)
    for b, (s, start, stop) in enumerate(windows):
        m = stop - start
        feats[b, :m] = s.features[start:stop].float()
        nxt[b, :m] = s.tokens[start + 1:stop + 1]
        wanted = s.labels[start + 1:stop + 1]
        labels[b, :m] = torch.where(wanted >= 0, to_draft[wanted.clamp(min=0)], -1)
    outs = head.train_forward(feats, F.embedding(nxt, embed).float(), positions, r.ttt_steps)
    losses, accuracy = [], []
    for j, out in enumerate(outs):
        target = labels.clone()
        target[:, :j] = -1
        logits = head.logits(out).float()
        losses.append(F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-1))
        valid = target >= 0
        accuracy.append(float((logits.argmax(-1)[valid] == target[valid]).float().mean()) if valid.any() else 0.0)
    return losses, accuracy
