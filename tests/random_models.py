"""Small models with random weights for kernel and forward-path tests (no checkpoint needed)."""

from __future__ import annotations

import torch

from agentrt.engine.llama import LlamaConfig, Transformer


def qwen_like(max_seq_len: int = 128) -> Transformer:
    """A Qwen2-style model (q/k/v bias, 2 query heads per kv head), random bf16 weights, seeded."""
    cfg = LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=32, attention_bias=True)
    model = Transformer(cfg, torch.bfloat16, max_seq_len=max_seq_len)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    return model
