"""Small models and GGUF blocks with random weights for kernel and forward-path tests (no
checkpoint needed)."""

from __future__ import annotations

import numpy as np
import torch

from agentrt.engine.llama import LlamaConfig, Transformer
from agentrt.engine.packed import BLOCK_BYTES


def qwen_like(max_seq_len: int = 128) -> Transformer:
    """A Qwen2-style model (q/k/v bias, 2 query heads per kv head), random bf16 weights, seeded."""
    cfg = LlamaConfig(vocab_size=300, hidden_size=128, intermediate_size=256, num_layers=3,
                      num_heads=4, num_kv_heads=2, head_dim=32, attention_bias=True)
    model = Transformer(cfg, torch.bfloat16, max_seq_len=max_seq_len)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    return model


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Valid random blocks: finite fp16 scales (and minimums), random codes."""
    gen = np.random.default_rng(seed)
    nb = cols // 32
    raw = gen.integers(0, 256, size=(rows, nb, BLOCK_BYTES[kind]), dtype=np.uint8)
    raw[..., 0:2] = gen.normal(0, 0.02, size=(rows, nb)).astype(np.float16)[..., None].view(np.uint8)
    if kind == "q4_1":
        raw[..., 2:4] = gen.normal(0, 0.1, size=(rows, nb)).astype(np.float16)[..., None].view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))
