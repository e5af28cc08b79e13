"""Greedy output and logits of the pulled model on each GEMM path and precision, in one process.

``python -m benchmarks.precision_check [--model smollm2-135m] [--prompts 4] [--max-tokens 64]
[--long 512,2048] [--threads 2]``

Settings: ``exact`` on the paths chosen at start-up (`GemmPaths`, AVX512F tiles where the CPU
has them), ``exact`` on the paths ``AGENTRT_GEMM_ISA=avx2`` gives, and ``precision="bf16"``. For
each: greedy output of the first ``--prompts`` prompts of the agent-code and the chat set (the
engine reset before each, so no KV is reused), and the logits of every position of prompts of
``--long`` tokens (one prefill each). Printed: whether the avx2 setting gives the same token
ids and logit bits as the first, and how far bf16 is from exact (greedy prompts identical and
where the first differs; next-token argmax agreement and mean KL(exact || bf16) over every
position of the long prompts).
"""

from __future__ import annotations

import argparse
import asyncio

import torch

from agentrt.engine import NativeEngine, SamplingParams, complete, models
from agentrt.engine.gemm_paths import CpuFeatures, GemmPaths
from agentrt.engine.llama import SequenceCache

from .engine import prefill
from .engine.common import load_prompts


def greedy(engine: NativeEngine, prompts: list[dict], max_tokens: int) -> list[list[int]]:
    async def go():
        out = []
        for p in prompts:
            engine.reset()
            out.append((await complete(engine, p["messages"], SamplingParams(max_tokens=max_tokens))).token_ids)
        return out

    return asyncio.run(go())


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return SequenceCache(model, max_len=len(ids))(torch.tensor([ids]), 0)[0]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--prompts", type=int, default=4, help="per prompt set")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--long", default="512,2048")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    sizes = prefill.lengths(args.long)
    engine = NativeEngine(model=str(models.ensure(args.model, "bf16")), dtype="bf16", drafter=None,
                          threads=args.threads, max_seq_len=max(sizes) + args.max_tokens + 2)
    model, ops = engine.model, engine.model.ops
    if ops is None:
        print("no CPU kernels here: nothing to compare")
        return 1
    chat = [p for _, p in load_prompts(["agent_code", "chat"], args.prompts)]
    long_ids = [engine.tokenizer.encode_chat(p["messages"])
                for _, p in prefill.prompts(engine.tokenizer, sizes, 1)]
    cpu = CpuFeatures.detect()
    settings = {"exact": (GemmPaths.choose(cpu), "exact"),
                "exact, AGENTRT_GEMM_ISA=avx2": (GemmPaths.choose(cpu, {"AGENTRT_GEMM_ISA": "avx2"}), "exact"),
                "bf16": (GemmPaths.choose(cpu), "bf16")}
    results = {}
    try:
        for name, (paths, precision) in settings.items():
            used = ops.use_paths(paths)
            model.precision = precision
            results[name] = (greedy(engine, chat, args.max_tokens), [logits(model, ids) for ids in long_ids])
            print(f"{name}: {used.describe()}, bf16 rows from {model.bf16_rows or 'never'}")
    finally:
        model.precision = "exact"
        ops.use_paths(GemmPaths.choose(cpu))
        engine.close()
    (ref_tokens, ref_logits), *_ = results.values()
    for name, (tokens, long_logits) in list(results.items())[1:]:
        same = sum(a == b for a, b in zip(ref_tokens, tokens))
        diffs = [first_difference(a, b) for a, b in zip(ref_tokens, tokens)]
        print(f"\n{name} against exact: greedy identical on {same}/{len(tokens)} prompts "
              f"(first differing output position per prompt: {diffs})")
        for n, a, b in zip(sizes, ref_logits, long_logits):
            p, q = a.log_softmax(-1), b.log_softmax(-1)
            kl = (p.exp() * (p - q)).sum(-1).mean().item()
            agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
            rel = ((a - b).abs().max() / a.abs().max()).item()
            print(f"  {n}-token prompt: logits same bits {torch.equal(a, b)}, argmax agreement "
                  f"{agree:.2%}, mean KL {kl:.2e} nats, max |diff| / max |logit| {rel:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
