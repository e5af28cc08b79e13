"""The reference the one-call C step (`CpuOps.decode_layers_paged`) is tested against: the same
kernels called one op at a time from Python, through ctypes on the compiled library."""

from __future__ import annotations

import ctypes
import math

import torch
import torch.nn.functional as F

from agentrt.engine.cpu_ops import CpuOps
from agentrt.engine.kv_cache import KVPool
from agentrt.engine.llama import SeqRows, Transformer, kernel_linear

_PTR, _I64, _F32, _I32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


def _c(ops: CpuOps, name: str, argtypes: list):
    fn = getattr(ops.lib, name)
    fn.argtypes, fn.restype = argtypes, None
    return fn


def silu_mul(ops: CpuOps, gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up[M, 2 I]`` (float32)."""
    rows, width = gate_up.shape
    y = torch.empty(rows, width // 2)
    _c(ops, "silu_mul", [_PTR, _PTR, _I64, _I64])(gate_up.data_ptr(), y.data_ptr(), rows, width // 2)
    return y


def rope_store_paged(ops: CpuOps, qkv: torch.Tensor, rope: torch.Tensor, table: ctypes.Array,
                     heads: int, kv_heads: int, dim: int, k_pool: torch.Tensor,
                     v_pool: torch.Tensor) -> None:
    """Rotate q and k of ``qkv`` in place and store k, v in the block pools (float16)."""
    assert k_pool.dtype == v_pool.dtype == torch.float16
    _c(ops, "rope_store_paged", [_PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64])(
        qkv.data_ptr(), rope.data_ptr(), ctypes.addressof(table), len(table), heads, kv_heads, dim,
        k_pool.data_ptr(), v_pool.data_ptr(), k_pool.shape[2])


def attend_paged(ops: CpuOps, qkv: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 table: ctypes.Array, heads: int, kv_heads: int, dim: int) -> torch.Tensor:
    """Causal attention of every row of ``qkv`` over its own sequence in the block pools."""
    assert k_pool.dtype == v_pool.dtype == torch.float16 and dim % 32 == 0
    out = torch.empty(qkv.shape[0], heads * dim)
    _c(ops, "attend_paged", [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64,
                             _F32, _I32])(
        qkv.data_ptr(), qkv.stride(0), k_pool.data_ptr(), v_pool.data_ptr(), out.data_ptr(),
        ctypes.addressof(table), len(table), heads, kv_heads, dim, k_pool.shape[2],
        1.0 / math.sqrt(dim), torch.get_num_threads())
    return out


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
                                 layer.int8.get(name), model.packed_max_rows, residual,
                                 model.bf16_rows)

        qkv = linear(ops.rms_norm(x, layer.attn_norm, eps), "wqkv")
        if layer.bqkv is not None:
            qkv = qkv + layer.bqkv
        qkv = qkv.contiguous()
        rope_store_paged(ops, qkv, model.rope_pairs, table, h, kvh, hd, k_pool, v_pool)
        attn = attend_paged(ops, qkv, k_pool, v_pool, table, h, kvh, hd)
        mid = linear(attn, "wo", residual=x)
        gate_up = linear(ops.rms_norm(mid, layer.mlp_norm, eps), "w_gate_up")
        x = linear(silu_mul(ops, gate_up), "w_down", residual=mid)
    return model.head(x)
