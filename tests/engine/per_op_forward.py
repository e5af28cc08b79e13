"""The reference the one-call C step (`CpuOps.decode_layers_paged`) is tested against: the same
kernels called one op at a time from Python."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agentrt.engine.kv_cache import KVPool
from agentrt.engine.llama import SeqRows, Transformer, kernel_linear


def per_op_forward(model: Transformer, tokens: torch.Tensor, seqs: list[SeqRows],
                   pool: KVPool) -> torch.Tensor:
    """`Transformer.forward` with the CPU kernels, one ctypes call per op: logits of every row."""
    ops, cfg = model.ops, model.cfg
    assert ops is not None, "the per-op path needs the CPU kernels"
    h, kvh, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    x = F.embedding(tokens, model.embed).float().contiguous()
    rows, row0 = [], 0
    for s in seqs:
        rows.append((row0, s.n, s.start, s.blocks))
        row0 += s.n
    table = ops.seq_table(rows)
    for layer, (k_pool, v_pool) in zip(model.layers, pool.caches, strict=True):
        def linear(inp: torch.Tensor, name: str, residual: torch.Tensor | None = None,
                   layer=layer) -> torch.Tensor:
            return kernel_linear(ops, inp, getattr(layer, name), layer.packed.get(name),
                                 layer.int8.get(name), model.packed_max_rows, residual)

        qkv = linear(ops.rms_norm(x, layer.attn_norm, eps), "wqkv")
        if layer.bqkv is not None:
            qkv = qkv + layer.bqkv
        qkv = qkv.contiguous()
        ops.rope_store_paged(qkv, model.rope_pairs, table, h, kvh, hd, k_pool, v_pool)
        attn = ops.attend_paged(qkv, k_pool, v_pool, table, h, kvh, hd)
        mid = linear(attn, "wo", residual=x)
        gate_up = linear(ops.rms_norm(mid, layer.mlp_norm, eps), "w_gate_up")
        x = linear(ops.silu_mul(gate_up), "w_down", residual=mid)
    return model.head(x)
