"""Chain or tree drafts for the learned head: which pays on this CPU (an estimate).

``python -m benchmarks.tree_drafts [--head DIR] [--sets agent_code,chat] [--precision exact]
[--threads 2] [--max-tokens 128]``

The engine verifies chains. Whether a draft tree would pay depends on two things this script
measures, side by side, in one process:

- **acceptance**: the target answers every prompt of the sets greedily (its replies and the
  features of its three feature layers recorded as it runs, exactly as the head sees them);
  the head then drafts, teacher-forced along the target's own path (`DraftHead.train_forward`:
  at depth j it reads its own outputs, the same computation as drafting j tokens ahead), and a
  tree of widths ``(w0, w1, ...)`` accepts depth j when the target's token is among the head's
  top ``w_j`` there. Chains are the trees of width 1.
- **cost**: one target forward over 1..N new tokens after a long prompt (what verifying a
  draft of N - 1 tokens costs; a tree's mask would not change that on the CPU kernels) and
  one head step over 1..M rows (drafting one depth of a tree), each the best of repeats.

The estimated speedup of a shape over plain decoding is
``(1 + mean accepted) * verify(1) / (verify(nodes + 1) + sum of head steps)``; the engine's
own overhead per step is left out (the engine benchmark measures the real chain). Greedy only.

It also prints what no drafter can beat on this machine (`perfect_chains`): the same estimate
for chains of k whose every token is accepted, with a head step per drafted token and with
free drafts (a lookup that always matches).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from agentrt.engine.drafters.base import best_time

from .engine.common import load_prompts

SHAPES: tuple[tuple[int, ...], ...] = (
    (1,), (1, 1), (1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1, 1, 1),
    (2, 1, 1, 1), (3, 1, 1, 1), (4, 1, 1, 1), (2, 2, 1, 1), (3, 2, 1, 1), (2, 2, 2, 2),
)
"""Draft shapes compared: the top-k width at each depth (all 1: a chain)."""


@dataclass
class ShapeEstimate:
    shape: tuple[int, ...]
    nodes: int
    mean_accepted: float
    """Drafted tokens accepted per step (the target's own token not counted)."""
    step_s: float
    """Verify forward over ``nodes + 1`` tokens plus the head steps."""
    speedup: float


def nodes_per_depth(shape: Sequence[int]) -> list[int]:
    """How many draft tokens a tree of ``shape`` holds at each depth."""
    out, n = [], 1
    for width in shape:
        n *= width
        out.append(n)
    return out


def accepted_lengths(ranks: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Tokens a ``shape`` tree gets accepted from every anchor: ``ranks[a, j]`` is the rank of
    the target's token among the head's predictions at depth j from anchor a (-1: past the end
    of the reply, which ends the draft); depth j is accepted when its rank is below
    ``shape[j]`` and every shallower depth was accepted."""
    widths = torch.tensor(list(shape))
    depth = min(len(shape), ranks.shape[1])
    hit = (ranks[:, :depth] >= 0) & (ranks[:, :depth] < widths[:depth])
    return hit.int().cumprod(dim=1).sum(dim=1)


def head_topk(head, embed: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor,
              prompt_len: int, depth: int, k: int) -> torch.Tensor:
    """``[anchors, depth, k]`` target ids: the head's top ``k`` at depth j of a draft from each
    anchor of one reply, teacher-forced along ``tokens`` (-1 past the end). Anchor a is the last
    position whose features the target has given when the head drafts (the token after it is
    the target's own); depth j predicts the token at ``a + j + 2``. Anchors run from the
    prompt's last position."""
    n = features.shape[0]  # rows with a next token: positions 0 .. L-2
    anchors = torch.arange(prompt_len - 1, n - 1)
    top = torch.full((anchors.numel(), depth, k), -1, dtype=torch.long)
    target_ids = head.target_ids()
    with torch.inference_mode():
        outs = head.train_forward(features.float()[None],
                                  F.embedding(tokens[1:n + 1], embed).float()[None],
                                  torch.arange(n), depth)
        for j, out in enumerate(outs):
            ok = anchors + j + 2 <= n  # the token at a + j + 2 exists (position L - 1 at most)
            if ok.any():
                logits = head.logits(out[0, anchors[ok] + j]).float()
                top[ok.nonzero()[:, 0], j] = target_ids[logits.topk(k, dim=-1).indices]
    return top


def ranks_along(top: torch.Tensor, tokens: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """``ranks[a, j]`` for `accepted_lengths`: where the target's token stands in ``top`` (see
    `head_topk`), ``k`` when it is not there, -1 past the end."""
    anchors, depth, k = top.shape
    a = torch.arange(anchors)[:, None] + prompt_len - 1
    wanted = tokens[(a + torch.arange(depth)[None, :] + 2).clamp(max=tokens.numel() - 1)]
    match = top == wanted[..., None]
    ranks = torch.where(match.any(-1), match.int().argmax(-1), k)
    return torch.where(top[..., 0] >= 0, ranks, -1)


def verify_costs(model, layers: Sequence[int], context: int, sizes: Sequence[int], repeats: int
                 ) -> dict[int, float]:
    """Seconds of one target forward over ``n`` new tokens after ``context`` cached ones, with
    logits for every row and the head's features captured, for each ``n`` in ``sizes``."""
    from agentrt.engine.llama import SeqRows

    block = 64
    pool = model.new_pool(-(-(context + max(sizes)) // block), block)
    table = torch.arange(pool.num_blocks, dtype=torch.int32)
    ids = torch.randint(100, 20000, (context + max(sizes),))
    out = {}
    with torch.inference_mode():
        model(ids[:context], [SeqRows(0, context, table)], pool, capture=layers)
        for n in sizes:
            part = ids[context:context + n]
            out[n] = best_time(lambda: model(part, [SeqRows(context, n, table)], pool,
                                           logit_rows=torch.arange(n), capture=layers), repeats)
    return out


def head_costs(head, embed: torch.Tensor, sizes: Sequence[int], context: int, repeats: int
               ) -> dict[int, float]:
    """Seconds of one head step (extend + logits + top-k) over ``m`` rows after ``context``
    cached positions, for each ``m`` in ``sizes``."""
    from agentrt.engine.eagle.head import HeadCache

    c = head.config
    out = {}
    with torch.inference_mode():
        cache = HeadCache.empty(c, context + max(sizes) + 8)
        h = torch.zeros(context, c.hidden_size)
        head.extend(cache, h, embed[:context].float())

        def step(m: int) -> None:
            cache.length = context
            o = head.extend(cache, torch.zeros(m, c.hidden_size), embed[:m].float())
            head.logits(o).topk(4, dim=-1)

        for m in sizes:
            out[m] = best_time(lambda: step(m), repeats)
    return out


def estimate(ranks: torch.Tensor, verify: dict[int, float], head_step: dict[int, float],
             shapes: Sequence[tuple[int, ...]]) -> list[ShapeEstimate]:
    """Every shape's mean accepted length, step cost and estimated speedup over plain."""
    rows = []
    for shape in shapes:
        per_depth = nodes_per_depth(shape)
        nodes = sum(per_depth)
        drafting = sum(head_step[m] for m in [1, *per_depth[:-1]])
        step = verify[nodes + 1] + drafting
        accepted = float(accepted_lengths(ranks, shape).float().mean())
        rows.append(ShapeEstimate(shape, nodes, accepted, step, (1 + accepted) * verify[1] / step))
    return rows


def perfect_chains(verify: dict[int, float], head_step: float) -> list[tuple[int, float, float]]:
    """``(k, speedup with a head step per token, speedup with free drafts)`` for every chain of
    k measured (``verify`` has k + 1), each draft token accepted: an upper bound for any
    drafter of that cost."""
    return [(n - 1, n * verify[1] / (verify[n] + (n - 1) * head_step), n * verify[1] / verify[n])
            for n in sorted(verify) if n > 1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tree_drafts", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--head", help="head directory (default: the model cache's)")
    parser.add_argument("--sets", default="agent_code,chat")
    parser.add_argument("--limit", type=int, default=None, help="prompts per set")
    parser.add_argument("--precision", default="exact", choices=("exact", "int8"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7, help="timings: best of this many")
    parser.add_argument("--out", help="write the estimates here as JSON")
    args = parser.parse_args(argv)

    from agentrt.engine.eagle.data import FeatureRecorder, generate_samples
    from agentrt.engine.eagle.head import DraftHead, head_dir
    from agentrt.engine.native import NativeEngine

    torch.set_num_threads(args.threads)
    head = DraftHead.load(args.head or head_dir(args.model)).prepare_drafting()  # as the engine drafts
    recorder = FeatureRecorder(head.config.aux_layers)
    engine = NativeEngine(args.model, drafter=recorder, draft_tokens=1, prefix_cache=False,
                          precision=args.precision, threads=args.threads)
    prompts = load_prompts(args.sets.split(","), args.limit)
    samples: dict[int, object] = {}
    print(f"tree drafts: {len(prompts)} prompts, greedy replies of up to {args.max_tokens} "
          f"tokens ({args.precision})", file=sys.stderr)
    try:
        generate_samples(engine, recorder, [row["messages"] for _, row in prompts], args.max_tokens,
                         0.0, 0, lambda i, s: samples.__setitem__(i, s))
    finally:
        engine.close()
    model, embed = engine.model, engine.model.embed.detach()
    depth = max(len(s) for s in SHAPES)
    by_set: dict[str, list[torch.Tensor]] = {}
    for i, (name, _) in enumerate(prompts):
        s = samples[i]
        top = head_topk(head, embed, s.tokens, s.features, s.prompt_len, depth, max(map(max, SHAPES)))
        by_set.setdefault(name, []).append(ranks_along(top, s.tokens, s.prompt_len))
    sizes = sorted({sum(nodes_per_depth(s)) + 1 for s in SHAPES} | {1})
    context = max(s.tokens.numel() for s in samples.values())
    verify = verify_costs(model, head.config.aux_layers, context, sizes, args.repeats)
    steps = sorted({m for s in SHAPES for m in [1, *nodes_per_depth(s)[:-1]]})
    head_step = head_costs(head, embed, steps, context, args.repeats)

    report = {"head": str(args.head or head_dir(args.model)), "precision": args.precision,
              "threads": args.threads, "context": context,
              "verify_ms": {n: round(t * 1e3, 3) for n, t in verify.items()},
              "head_step_ms": {m: round(t * 1e3, 3) for m, t in head_step.items()}, "sets": {}}
    print(f"\nverify forward ms by tokens (context {context}): "
          + ", ".join(f"{n}: {t * 1e3:.1f}" for n, t in verify.items()))
    print("head step ms by rows: " + ", ".join(f"{m}: {t * 1e3:.2f}" for m, t in head_step.items()))
    bounds = perfect_chains(verify, head_step[1])
    report["perfect_chains"] = [{"k": k, "head": round(h, 3), "free": round(f, 3)} for k, h, f in bounds]
    print("every draft accepted (a bound for any drafter), chain of k: x plain with a head step "
          "per token / with free drafts: " + ", ".join(f"{k}: {h:.2f}x / {f:.2f}x" for k, h, f in bounds))
    print(f"best: head drafts {max(h for _, h, _ in bounds):.2f}x, free drafts "
          f"{max(f for _, _, f in bounds):.2f}x")
    for name, parts in by_set.items():
        ranks = torch.cat(parts)
        rows = estimate(ranks, verify, head_step, SHAPES)
        best = max(rows, key=lambda r: r.speedup)
        print(f"\n{name}: {ranks.shape[0]} draft anchors")
        print("shape         nodes  accepted/step  step ms  est. speedup")
        for r in rows:
            mark = "  <- best" if r is best else ""
            print(f"{'x'.join(map(str, r.shape)):12s} {r.nodes:6d} {r.mean_accepted:14.2f} "
                  f"{r.step_s * 1e3:8.1f} {r.speedup:12.2f}x{mark}")
        report["sets"][name] = [{"shape": list(r.shape), "nodes": r.nodes,
                                 "mean_accepted": round(r.mean_accepted, 3),
                                 "step_ms": round(r.step_s * 1e3, 3), "speedup": round(r.speedup, 3)}
                                for r in rows]
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
