"""``--synthetic``: the model's forward speed on random weights of SmolLM2-135M's shape, for a
machine without the pulled model."""

from __future__ import annotations

import json
import time

import torch

from .common import write_results
from .systems import sync_device


def synthetic(args) -> int:
    """Forward speed on random weights shaped like SmolLM2-135M (no model download needed)."""
    from agentrt.engine.draft_policy import StepCosts
    from agentrt.engine.llama import LlamaConfig, SequenceCache, Transformer

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                      tie_word_embeddings=True)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    model = Transformer(cfg, dtype, args.device, max_seq_len=2048).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    with torch.inference_mode():
        costs = StepCosts.measure(model, 17)
        cache = SequenceCache(model, max_len=64 + args.max_tokens)
        tokens = torch.zeros(1, 1, dtype=torch.long, device=args.device)
        cache(torch.zeros(1, 64, dtype=torch.long, device=args.device), 0, "last")
        sync_device(args.device)
        start = time.perf_counter()
        for pos in range(64, 64 + args.max_tokens):
            tokens = cache(tokens, pos, "last").argmax(-1)
        sync_device(args.device)
        plain = args.max_tokens / (time.perf_counter() - start)
    result = {"synthetic": True, "dtype": args.dtype, "device": args.device,
              "plain_decode_tok_s": plain,
              "forward_ms_by_tokens": {n: s * 1e3 for n, s in costs.points}}
    print(json.dumps(result, indent=2))
    write_results(result, f"# Synthetic forward speed\n\n```\n{json.dumps(result, indent=2)}\n```\n",
                  args.out)
    return 0
