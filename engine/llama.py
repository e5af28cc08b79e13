"""A lean Llama-family decoder in plain torch over a paged KV cache.

Covers Llama / Mistral / Qwen2 / Qwen3 style checkpoints: RMSNorm, rotary embeddings (default,
linear and llama3 scaling), grouped-query attention, SiLU-gated MLP, optional q/k/v bias (Qwen2),
optional q/k norms (Qwen3) and tied embeddings. Weights load from ``*.safetensors`` +
``config.json`` in a Hugging Face directory.

There is one forward and one KV cache. ``forward(tokens[n], seqs, pool)`` runs one step: the
rows of one or more sequences (`SeqRows`: start position, row count, block table), their keys
and values written into the blocks of a `KVPool`, each row attending to its own sequence up to
its own position. Nothing else is stored, so rolling back rejected tokens is just running the
next step from a smaller start. A single sequence is one block table: `SequenceCache` holds a
few sequences' block tables and runs ``tokens[B, n]`` at a start position.

Precision: weights keep the checkpoint's dtype. On CUDA (and for fp32 weights) activations use
the weight dtype. On CPU with bf16 weights activations are float32, keys and values float16,
and every layer runs in the compiled kernels (`CpuOps.decode_layers_paged`); elsewhere each
`Block` runs on torch ops.
"""

from __future__ import annotations

import copy
import ctypes
import json
import logging
import math
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import packed as packed_weights
from .cpu_ops import CACHE_DTYPE, CpuOps, LayerShape, cpu_ops
from .gemm_paths import BF16_MIN_ROWS
from .kv_cache import DEFAULT_BLOCK_SIZE, KVPool
from .native_config import PRECISIONS
from .packed import InterleavedMatrix, PackedMatrix

log = logging.getLogger(__name__)

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class LlamaConfig:
    """The architecture fields the forward needs, read from a Hugging Face ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    model_type: str = "llama"

    @classmethod
    def from_dict(cls, cfg: dict) -> "LlamaConfig":
        """Build from a ``config.json`` dict (transformers 4.x and 5.x spellings)."""
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        scaling = None if rope_type in (None, "default") else {**rope, "rope_type": rope_type}
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        heads = cfg["num_attention_heads"]
        model_type = cfg.get("model_type", "llama")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type == "qwen2"),
            qk_norm=model_type == "qwen3",
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            model_type=model_type,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "LlamaConfig":
        return cls.from_dict(json.loads((Path(path) / "config.json").read_text()))


# ------------------------------------------------------------------------------------ pieces

def rope_frequencies(cfg: LlamaConfig, max_seq_len: int, device=None) -> Tensor:
    """Unit complex rotations ``[max_seq_len, head_dim // 2]`` (complex64), one per position and
    frequency, with linear or llama3 scaling applied."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type")
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    elif kind is not None:
        raise NotImplementedError(f"rope scaling {kind!r} is not supported")
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64).to(device)


def _llama3_inv_freq(inv_freq: Tensor, s: dict) -> Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    mid = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    is_mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_mid, mid, scaled)


def interleave_halves(rows: Tensor, head_dim: int) -> Tensor:
    """Reorder each head's rows from "rotate half" order (x_i pairs with x_{i+d/2}) to adjacent
    pairs, so RoPE becomes one complex multiply. q·k is unchanged when q and k both use it."""
    half = head_dim // 2
    order = torch.stack([torch.arange(half), torch.arange(half) + half], dim=-1).flatten()
    return rows.unflatten(0, (-1, head_dim))[:, order].flatten(0, 1)


def apply_rope(x: Tensor, freqs: Tensor) -> Tensor:
    """Rotate adjacent pairs of ``x[..., n, heads, head_dim]`` by ``freqs[n, 1, head_dim // 2]``
    (in float32; the result has x's dtype)."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * freqs).flatten(-2).type_as(x)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm computed in float32, scaled in the weight's dtype (as transformers does)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(weight.dtype) * weight


# ------------------------------------------------------------------------------ matmuls

class Matmul:
    """``x @ w.T (+ b) (+ residual)`` on torch ops, where weights and activations may differ in
    dtype (the torch path: float32 checkpoints, CUDA, architectures the fused kernels do not
    cover).

    ``compute_dtype`` is the activations' dtype. On CPU with bf16 weights and float32
    activations, up to ``kernel_max_rows`` rows use the AVX2 kernel (`CpuOps.linear`), which
    streams the bf16 weights once and accumulates in float32; more rows widen the weight to
    float32 for torch's GEMM. Without the kernel: torch bf16 for one row, widened weights for
    several.
    """

    def __init__(self, weight_dtype: torch.dtype, compute_dtype: torch.dtype,
                 ops: CpuOps | None = None, kernel_max_rows: int = 48):
        self.weight_dtype, self.compute_dtype = weight_dtype, compute_dtype
        self.mixed = weight_dtype != compute_dtype
        self.ops = ops if (self.mixed and weight_dtype == torch.bfloat16
                           and compute_dtype == torch.float32) else None
        self.kernel_max_rows = kernel_max_rows

    def __call__(self, x: Tensor, w: Tensor, b: Tensor | None = None,
                 residual: Tensor | None = None) -> Tensor:
        rows, k = x.shape
        if self.ops is not None and rows <= self.kernel_max_rows and k % 8 == 0:
            if b is None:
                return self.ops.linear(x.contiguous(), w, residual)
            y = self.ops.linear(x.contiguous(), w) + b
        elif not self.mixed:
            y = F.linear(x, w, b)
        elif rows == 1:
            y = F.linear(x.to(w.dtype), w).to(self.compute_dtype)
            y = y if b is None else y + b
        else:
            y = F.linear(x, w.to(self.compute_dtype), b)
        return y if residual is None else residual + y


def kernel_linear(ops: CpuOps, x: Tensor, dense: Tensor, packed: PackedMatrix | None,
                  int8: InterleavedMatrix | None, packed_max_rows: int,
                  residual: Tensor | None = None, bf16_rows: int = 0) -> Tensor:
    """``x @ W^T (+ residual)`` with the row-independent CPU kernels only, as ``matrix_apply``
    does it in C: the int8 kernel where ``int8`` blocks are given (``"int8"`` precision), else
    bf16 activations from ``bf16_rows`` rows on (``"bf16"`` precision; 0: never), else the GGUF
    blocks for up to ``packed_max_rows`` rows, else the bf16 kernel, whatever the number of
    rows (no float32 GEMM, whose row results may depend on the batch)."""
    if int8 is not None:
        return ops.int8_linear(x, int8, residual)
    if bf16_rows and x.shape[0] >= bf16_rows and ops.paths.bf16:
        return ops.bf16_dot_linear(x, dense, residual)
    if packed is not None and x.shape[0] <= packed_max_rows:
        return ops.packed_linear(x, packed, True, residual)
    return ops.linear(x, dense, residual)


# ------------------------------------------------------------------------------- the model

@dataclass(frozen=True)
class SeqRows:
    """One sequence's rows in a step: ``n`` rows at positions ``start .. start + n - 1``, its
    keys and values in the pool blocks of ``blocks`` (int32, position t in block
    ``blocks[t // block_size]``)."""

    start: int
    n: int
    blocks: Tensor


class Block(nn.Module):
    """One decoder layer with fused qkv and gate/up projections; it holds every weight it reads.

    Matrices keep the checkpoint dtype; norms and the qkv bias are held in the compute dtype
    (the checkpoint's values, exactly). ``packed``: the same matrices in GGUF blocks where they
    reproduce them bit for bit (`Transformer.use_packed`); ``int8``: those blocks interleaved
    for `CpuOps.int8_linear` (``"int8"`` precision). q and k rows are stored in adjacent-pair
    RoPE order (`interleave_halves`). Attention uses a grouped layout: the ``heads / kv_heads``
    query heads sharing a kv head are stacked along the query axis, so grouped-query attention
    needs no key/value expansion.
    """

    MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")

    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype, compute_dtype: torch.dtype, device):
        super().__init__()
        self.cfg = cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        mat = dict(dtype=dtype, device=device)
        vec = dict(dtype=compute_dtype, device=device)

        def param(t: Tensor) -> nn.Parameter:
            return nn.Parameter(t, requires_grad=False)

        self.attn_norm = param(torch.ones(cfg.hidden_size, **vec))
        self.wqkv = param(torch.empty(q + 2 * kv, cfg.hidden_size, **mat))
        self.bqkv = param(torch.zeros(q + 2 * kv, **vec)) if cfg.attention_bias else None
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = param(torch.ones(cfg.head_dim, **vec))
            self.k_norm = param(torch.ones(cfg.head_dim, **vec))
        self.wo = param(torch.empty(cfg.hidden_size, q, **mat))
        self.mlp_norm = param(torch.ones(cfg.hidden_size, **vec))
        self.w_gate_up = param(torch.empty(2 * cfg.intermediate_size, cfg.hidden_size, **mat))
        self.w_down = param(torch.empty(cfg.hidden_size, cfg.intermediate_size, **mat))
        self.packed: dict[str, PackedMatrix] = {}
        self.int8: dict[str, InterleavedMatrix] = {}

    def forward(self, x: Tensor, seqs: Sequence[SeqRows], k_pool: Tensor, v_pool: Tensor,
                rope: Tensor, mm: Matmul) -> Tensor:
        """The layer on torch ops for the rows ``x[n, hidden]`` of ``seqs``: keys and values
        written into the block pools ``[blocks, kv_heads, block_size, head_dim]``, each row
        attending to its own sequence up to its own position (``rope``: `Transformer.rope`)."""
        cfg = self.cfg
        h, kvh, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        bs = k_pool.shape[2]
        qkv = mm(rms_norm(x, self.attn_norm, eps), self.wqkv, self.bqkv)
        outs, row0 = [], 0
        for s in seqs:
            part = qkv[row0:row0 + s.n]
            row0 += s.n
            qk = part[:, :(h + kvh) * hd].view(1, s.n, h + kvh, hd)
            v = part[:, (h + kvh) * hd:].view(s.n, kvh, hd)
            if self.q_norm is not None:
                qk = torch.cat([rms_norm(qk[:, :, :h], self.q_norm, eps),
                                rms_norm(qk[:, :, h:], self.k_norm, eps)], dim=2)
            qk = apply_rope(qk, rope[s.start:s.start + s.n, None, :])
            end = s.start + s.n
            pos = torch.arange(s.start, end, device=x.device)
            table = s.blocks.to(device=x.device, dtype=torch.long)
            k_pool[table[pos // bs], :, pos % bs] = qk[0, :, h:].to(k_pool.dtype)
            v_pool[table[pos // bs], :, pos % bs] = v.to(v_pool.dtype)
            used = table[:-(-end // bs)]
            keys = k_pool[used].transpose(0, 1).reshape(kvh, -1, hd)[None, :, :end]
            values = v_pool[used].transpose(0, 1).reshape(kvh, -1, hd)[None, :, :end]
            mask = None
            if s.n > 1:
                groups = h // kvh
                mask = (torch.arange(end, device=x.device)[None, :] <= pos[:, None]).repeat(groups, 1)
            attn = _grouped_attention(qk[:, :, :h].to(k_pool.dtype), keys, values, mask)
            outs.append(attn.reshape(s.n, h * hd))
        attn = torch.cat(outs).to(x.dtype)
        x = mm(attn, self.wo, residual=x)
        gate_up = mm(rms_norm(x, self.mlp_norm, eps), self.w_gate_up)
        inter = cfg.intermediate_size
        return mm(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], self.w_down, residual=x)


def _grouped_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None) -> Tensor:
    """Causal GQA attention of ``q[B, n, heads, D]`` over ``keys/values[B, kv_heads, T, D]``,
    returned as ``[B, n, heads, D]``. The query heads that share a kv head are stacked along the
    query axis (``mask`` is ``[groups * n, T]``), so keys and values are never expanded."""
    bsz, n, heads, dim = q.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    q = q.view(bsz, n, kv_heads, groups, dim).permute(0, 2, 3, 1, 4).reshape(bsz, kv_heads, groups * n, dim)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    return out.view(bsz, kv_heads, groups, n, dim).permute(0, 3, 1, 2, 4)


class Transformer(nn.Module):
    """A Llama-family causal LM over a paged KV cache (see the module docstring).

    ``compute_dtype`` (default: float32 on CPU, else the weight dtype) is the dtype of
    activations. ``cpu_kernel=False`` disables the CPU kernels. ``precision`` (see
    `PRECISIONS`): ``"int8"`` takes effect for the matrices that have GGUF blocks
    (`use_packed`) on the CPU kernels, ``"bf16"`` for steps of `bf16_rows` rows or more on CPU
    kernels with the bf16 path; elsewhere the model computes exactly. ``max_seq_len``
    bounds the positions a sequence may reach. ``share``: build the first
    ``cfg.num_layers`` layers and the head of that model instead of new weights (see
    `truncated`).
    """

    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device = "cpu", max_seq_len: int = 4096,
                 compute_dtype: torch.dtype | None = None, cpu_kernel: bool = True,
                 precision: str = "exact", *, share: "Transformer | None" = None):
        super().__init__()
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        if compute_dtype is None:
            compute_dtype = torch.float32 if self.device.type == "cpu" else dtype
        self.compute_dtype = compute_dtype
        self.cpu_kernel = cpu_kernel
        if share is None:
            mat = dict(dtype=dtype, device=self.device)
            self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, **mat),
                                      requires_grad=False)
            self.layers = nn.ModuleList(Block(cfg, dtype, compute_dtype, self.device)
                                        for _ in range(cfg.num_layers))
            self.norm = nn.Parameter(torch.ones(cfg.hidden_size, dtype=compute_dtype,
                                                device=self.device), requires_grad=False)
            self.lm_head = (self.embed if cfg.tie_word_embeddings else nn.Parameter(
                torch.empty(cfg.vocab_size, cfg.hidden_size, **mat), requires_grad=False))
            self.packed_head: PackedMatrix | None = None
            self.int8_head: InterleavedMatrix | None = None
        else:
            self.embed, self.norm, self.lm_head = share.embed, share.norm, share.lm_head
            self.layers = nn.ModuleList(share.layers[:cfg.num_layers])
            self.packed_head, self.int8_head = share.packed_head, share.int8_head
        on_cpu = self.device.type == "cpu" and compute_dtype == torch.float32
        ops = cpu_ops() if cpu_kernel and on_cpu else None
        self.matmul = Matmul(dtype, compute_dtype, ops)
        # the fused kernels serve bf16 checkpoints (float16 KV cache); float32 ones stay on torch ops
        self.ops = ops if ops is not None and dtype == torch.bfloat16 and _fits_cpu_ops(cfg) else None
        self.packed_max_rows = 3
        """Up to this many rows a matrix with GGUF blocks multiplies from the blocks (fewer
        bytes to stream); more rows use the dense bf16 kernel (same results). 3 or 0, which
        `choose_packed_rows` measures."""
        self.max_seq_len = max_seq_len
        self.rope = rope_frequencies(cfg, max_seq_len, self.device)
        self.rope_pairs = torch.view_as_real(self.rope).contiguous()
        self._plans: weakref.WeakKeyDictionary[KVPool, tuple] = weakref.WeakKeyDictionary()
        self._precision = precision
        self._set_int8_weights()

    # ------------------------------------------------------------------------- construction

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: str | torch.dtype = "bf16",
                        device: str | torch.device = "cpu", max_seq_len: int = 4096,
                        compute_dtype: torch.dtype | None = None, cpu_kernel: bool = True,
                        precision: str = "exact") -> "Transformer":
        """Load ``config.json`` + ``*.safetensors`` from a Hugging Face model directory
        (``precision``: see `PRECISIONS`; ``"int8"`` needs the GGUF blocks that `models.pull`
        keeps, ``"bf16"`` a CPU with AVX512-BF16: without them it logs a warning and computes
        exactly)."""
        from safetensors import safe_open

        path = Path(path)
        cfg = LlamaConfig.from_dir(path)
        torch_dtype = TORCH_DTYPES[dtype] if isinstance(dtype, str) else dtype
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path}")
        tensors: dict[str, Tensor] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        if "lm_head.weight" not in tensors and not cfg.tie_word_embeddings:
            cfg = LlamaConfig(**{**cfg.__dict__, "tie_word_embeddings": True})
        model = cls(cfg, torch_dtype, device, max_seq_len, compute_dtype, cpu_kernel, precision)
        model.load_hf_state(tensors)
        used = 0
        if model.ops is not None:
            used = model.use_packed(packed_weights.load(path / packed_weights.PACKED_FILE))
        if precision == "int8" and not used:
            log.warning("precision='int8' needs GGUF blocks and the CPU kernels (none for %s); "
                        "computing exactly", path)
        if precision == "bf16" and not model.bf16_rows:
            log.warning("precision='bf16' needs the CPU kernels and AVX512-BF16 (%s); computing "
                        "exactly", "off" if model.ops is None else model.ops.paths.describe())
        return model.eval()

    def choose_packed_rows(self, context: int = 256, repeats: int = 5) -> int:
        """Set `packed_max_rows` to whichever is faster here for a one-row exact step: matrices
        multiplied from their GGUF blocks (0.72 bytes a weight, compute-bound: cheaper with
        more cores) or from the dense bf16 copies (2 bytes, memory-bound: cheaper where
        bandwidth per core is high). One-row forwards after ``context`` tokens, the two
        settings interleaved, median of ``repeats``; the logits are the same either way.
        Measured once per process for a model shape and thread count; a no-op without the
        blocks, the CPU kernels or in int8 precision (one-row steps are exact in bf16 precision)."""
        context = min(context, self.max_seq_len - 2)
        if (self.ops is None or self._precision == "int8" or context < 1
                or not any(layer.packed for layer in self.layers)):
            return self.packed_max_rows
        key = (repr(self.cfg), torch.get_num_threads())
        if key not in _PACKED_ROWS_CHOICE:
            cache = SequenceCache(self, max_len=context + 2)
            tokens = torch.arange(context + 1, dtype=torch.long, device=self.device) % self.vocab_size
            times: dict[int, list[float]] = {3: [], 0: []}
            with torch.inference_mode():
                cache(tokens[None, :context], 0, "last")
                for _ in range(repeats):
                    for rows, seconds in times.items():
                        self.packed_max_rows = rows
                        start = time.perf_counter()
                        cache(tokens[None, context:], context, "last")
                        seconds.append(time.perf_counter() - start)
            _PACKED_ROWS_CHOICE[key] = min(times, key=lambda r: sorted(times[r])[repeats // 2])
        self.packed_max_rows = _PACKED_ROWS_CHOICE[key]
        return self.packed_max_rows

    def truncated(self, num_layers: int) -> "Transformer":
        """A layer-skip drafter: the first ``num_layers`` layers and the head of this model,
        sharing its weights (and GGUF blocks and precision)."""
        if not 0 < num_layers <= self.cfg.num_layers:
            raise ValueError(f"num_layers must be in 1..{self.cfg.num_layers}, got {num_layers}")
        cfg = LlamaConfig(**{**self.cfg.__dict__, "num_layers": num_layers})
        return Transformer(cfg, self.dtype, self.device, self.max_seq_len, self.compute_dtype,
                           self.cpu_kernel, self._precision, share=self).eval()

    def int8_twin(self) -> "Transformer":
        """This model in ``"int8"`` precision, sharing its weights and GGUF blocks (only the
        int8 layout of the blocks is its own): a cheap drafter for this model in exact
        precision, close to it token for token. Needs the GGUF blocks and the CPU kernels."""
        if self.ops is None or not any(layer.packed for layer in self.layers):
            raise ValueError("an int8 twin needs the model's GGUF blocks (a model pulled with "
                             "`agentrt models pull` has them) and the CPU kernels")
        twin = self.truncated(self.cfg.num_layers)
        twin.layers = nn.ModuleList(copy.copy(layer) for layer in self.layers)
        for layer in twin.layers:
            layer.int8 = {}
        twin.int8_head = None
        twin.precision = "int8"
        return twin

    @property
    def precision(self) -> str:
        """``"exact"``, ``"int8"`` or ``"bf16"`` (see `PRECISIONS`); settable between forwards."""
        return self._precision

    @precision.setter
    def precision(self, value: str) -> None:
        if value not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {value!r}")
        self._precision = value
        self._set_int8_weights()

    @property
    def bf16_rows(self) -> int:
        """From how many rows of a step on the matmuls take bf16 activations: `BF16_MIN_ROWS`
        in ``"bf16"`` precision where the CPU kernels have the bf16 path, else 0 (never)."""
        if self._precision != "bf16" or self.ops is None or not self.ops.paths.bf16:
            return 0
        return BF16_MIN_ROWS

    def _set_int8_weights(self) -> None:
        """In ``"int8"`` precision, every matrix with GGUF blocks also has them interleaved
        for `CpuOps.int8_linear` (`Block.int8`, `int8_head`); in ``"exact"``, none does."""
        int8 = self._precision == "int8"
        for layer in self.layers:
            if not int8 and layer.int8:
                layer.int8 = {}
            elif int8 and layer.packed.keys() != layer.int8.keys():
                layer.int8 = {name: m.interleaved() for name, m in layer.packed.items()}
        if not int8 or self.packed_head is None:
            self.int8_head = None
        elif self.int8_head is None:
            self.int8_head = self.packed_head.interleaved()

    def load_hf_state(self, tensors: dict[str, Tensor]) -> None:
        """Copy weights named as in transformers' ``LlamaForCausalLM`` into the fused layout
        (q/k rows, biases and norms in adjacent-pair RoPE order), each rounded to the
        checkpoint dtype first."""
        hd = self.cfg.head_dim

        def take(name: str) -> Tensor:
            try:
                return tensors[name]
            except KeyError:
                raise KeyError(f"checkpoint has no tensor {name!r}") from None

        def put(param: Tensor, value: Tensor) -> None:
            if param.shape != value.shape:
                raise ValueError(f"shape mismatch: {tuple(value.shape)} vs {tuple(param.shape)}")
            param.copy_(value.to(self.dtype))

        def qkv(prefix: str, suffix: str) -> Tensor:
            q, k, v = (take(prefix + f"self_attn.{x}_proj.{suffix}") for x in "qkv")
            return torch.cat([interleave_halves(q, hd), interleave_halves(k, hd), v])

        with torch.no_grad():
            put(self.embed, take("model.embed_tokens.weight"))
            put(self.norm, take("model.norm.weight"))
            if not self.cfg.tie_word_embeddings:
                put(self.lm_head, take("lm_head.weight"))
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                put(layer.attn_norm, take(p + "input_layernorm.weight"))
                put(layer.mlp_norm, take(p + "post_attention_layernorm.weight"))
                put(layer.wqkv, qkv(p, "weight"))
                if layer.bqkv is not None:
                    put(layer.bqkv, qkv(p, "bias"))
                if layer.q_norm is not None:
                    put(layer.q_norm, interleave_halves(take(p + "self_attn.q_norm.weight"), hd))
                    put(layer.k_norm, interleave_halves(take(p + "self_attn.k_norm.weight"), hd))
                put(layer.wo, take(p + "self_attn.o_proj.weight"))
                put(layer.w_gate_up, torch.cat([take(p + "mlp.gate_proj.weight"),
                                                take(p + "mlp.up_proj.weight")]))
                put(layer.w_down, take(p + "mlp.down_proj.weight"))

    def use_packed(self, packed: dict[str, PackedMatrix]) -> int:
        """Decode with GGUF blocks (see `agentrt.engine.packed`) where they reproduce this
        model's weights bit for bit; returns how many matrices use them. Only the CPU kernels
        (bf16 weights, float32 activations) read them."""
        if not packed or self.ops is None:
            return 0
        hd = self.cfg.head_dim

        def exact(matrix: PackedMatrix | None, dense: Tensor) -> PackedMatrix | None:
            """``matrix`` if 64 of its rows, spread over it, equal ``dense``'s bit for bit
            (the blocks were checked whole against the float32 weights when they were made;
            this catches a wrong row order or a different checkpoint)."""
            if matrix is None or dense.shape != (matrix.out_features, matrix.in_features):
                return None
            rows = torch.linspace(0, matrix.out_features - 1, 64).long().unique()
            ok = torch.equal(matrix.rows(rows).dequantize().to(dense.dtype), dense[rows])
            return matrix if ok else None

        used = 0
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            q, k, v = (packed.get(p + f"self_attn.{x}_proj.weight") for x in "qkv")
            gate, up = packed.get(p + "mlp.gate_proj.weight"), packed.get(p + "mlp.up_proj.weight")
            fused = {
                "wqkv": None if any(m is None for m in (q, k, v)) else packed_weights.cat_rows([
                    q.rows(interleave_halves(torch.arange(q.out_features), hd)),
                    k.rows(interleave_halves(torch.arange(k.out_features), hd)), v]),
                "wo": packed.get(p + "self_attn.o_proj.weight"),
                "w_gate_up": (None if gate is None or up is None
                              else packed_weights.cat_rows([gate, up])),
                "w_down": packed.get(p + "mlp.down_proj.weight"),
            }
            checked = {name: exact(m, getattr(layer, name)) for name, m in fused.items()}
            layer.packed = {name: m for name, m in checked.items() if m is not None}
            layer.int8 = {}
            used += len(layer.packed)
        head = "model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"
        self.packed_head, self.int8_head = exact(packed.get(head), self.lm_head), None
        self._set_int8_weights()
        return used + (self.packed_head is not None)

    # ------------------------------------------------------------------------------ forward

    @property
    def cache_dtype(self) -> torch.dtype:
        """What keys and values are stored as: float16 with the CPU kernels (`CACHE_DTYPE`:
        half the bytes attention streams), else the activations' dtype."""
        return CACHE_DTYPE if self.ops is not None else self.compute_dtype

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def new_pool(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> KVPool:
        """A KV cache for this model: ``num_blocks`` blocks of ``block_size`` positions, in the
        cache dtype and on the device its forward uses."""
        cfg = self.cfg
        return KVPool(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_blocks, block_size,
                      self.cache_dtype, self.device)

    def layer_shape(self) -> LayerShape:
        cfg = self.cfg
        return LayerShape(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                          cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, tokens: Tensor, seqs: Sequence[SeqRows], pool: KVPool,
                logit_rows: Tensor | None = None, capture: Sequence[int] = ()
                ) -> Tensor | tuple[Tensor, Tensor]:
        """Logits ``[len(logit_rows), V]`` (float32) of one step over a paged KV cache.

        ``tokens[n]`` holds every sequence's new tokens one sequence after another (``seqs``
        in the same order); their keys and values are written into ``pool`` (a `KVPool` made
        by `new_pool`) and each row attends to its own sequence's positions up to its own.
        ``logit_rows`` picks the rows whose logits are needed (default: all). With the CPU
        kernels (bf16 weights, float32 activations) all layers run in one C call
        (`CpuOps.decode_layers_paged`) and every row's result depends only on its own
        sequence's tokens: the batch, the chunking of a prompt and which blocks hold the keys
        change no bit. Elsewhere every `Block` runs on torch ops (equal to float rounding).

        ``capture`` (ascending layer indices): also return the residual stream entering each of
        those layers, ``(logits, features[n, len(capture) * hidden])`` (a draft head's input);
        the layers then run in slices, with the same results."""
        n = tokens.shape[0]
        if sum(s.n for s in seqs) != n:
            raise ValueError(f"{n} tokens for sequences of {sum(s.n for s in seqs)} rows")
        if len(pool.caches) != len(self.layers):
            raise ValueError(f"a KV pool of {len(pool.caches)} layers for a model of "
                             f"{len(self.layers)}")
        for s in seqs:
            if s.start + s.n > self.max_seq_len or s.blocks.numel() * pool.block_size < s.start + s.n:
                raise ValueError(f"rows up to position {s.start + s.n} exceed max_seq_len="
                                 f"{self.max_seq_len} or the sequence's {s.blocks.numel()} blocks")
        x = F.embedding(tokens, self.embed).to(self.compute_dtype)
        if list(capture) != sorted(set(capture)) or any(not 0 <= i < len(self.layers) for i in capture):
            raise ValueError(f"capture must be ascending layer indices below {len(self.layers)}, "
                             f"got {list(capture)}")
        features: list[Tensor] = []
        if self.ops is not None:
            x = x.contiguous()
            rows, row0 = [], 0
            for s in seqs:
                rows.append((row0, s.n, s.start, s.blocks))
                row0 += s.n
            table, plan, done = self.ops.seq_table(rows), self._plan(pool), 0
            for stop in [*capture, len(self.layers)]:
                if stop > done:
                    self.ops.decode_layers_paged(x, table, _plan_slice(plan, done, stop),
                                                 self.layer_shape(), pool.block_size,
                                                 self.rope_pairs, self.packed_max_rows,
                                                 self.bf16_rows)
                    done = stop
                if stop < len(self.layers):
                    features.append(x.clone())
        else:
            for i, (layer, (k, v)) in enumerate(zip(self.layers, pool.caches)):
                if i in capture:
                    features.append(x.clone())
                x = layer(x, seqs, k, v, self.rope, self.matmul)
        if logit_rows is not None:  # not x[logit_rows]: torch runs that indexing on its own
            x = x.index_select(0, logit_rows)  # OpenMP threads, which then spin beside the kernels
        if capture:
            return self.head(x), torch.cat(features, dim=-1)
        return self.head(x)

    def head(self, x: Tensor) -> Tensor:
        """Final norm and output head over the hidden rows ``x[m, hidden]``: logits
        ``[m, V]`` in float32."""
        if x.shape[0] == 0:
            return torch.empty(0, self.vocab_size, device=self.device)
        eps = self.cfg.rms_norm_eps
        if self.ops is not None:
            x = self.ops.rms_norm(x.contiguous(), self.norm, eps)
            return kernel_linear(self.ops, x, self.lm_head, self.packed_head, self.int8_head,
                                 self.packed_max_rows, bf16_rows=self.bf16_rows).float()
        return self.matmul(rms_norm(x, self.norm, eps), self.lm_head).float()

    def _plan(self, pool: KVPool):
        """`CpuOps.layer_plan` over ``pool``'s block pools, kept per pool and rebuilt when a
        layer's GGUF or int8 blocks were replaced (the kept references also keep the pointed-to
        tensors alive)."""
        parts = tuple(table for layer in self.layers for table in (layer.packed, layer.int8))
        cached = self._plans.get(pool)
        if cached is None or any(a is not b for a, b in zip(cached[0], parts, strict=True)):
            cached = (parts, self.ops.layer_plan(list(self.layers), pool.caches))
            self._plans[pool] = cached
        return cached[1]


_PACKED_ROWS_CHOICE: dict[tuple, int] = {}
"""`Transformer.choose_packed_rows`'s answers in this process, by model shape and threads."""


class SequenceCache:
    """Keys and values of up to ``batch`` independent sequences of up to ``max_len`` positions,
    each one block table of a `KVPool` (blocks ``b * per_seq ..`` for sequence b), with the
    forward of a sequence at a start position: the model's one forward, for the draft model,
    step-cost measurements and tests. Rolling back is just running from an earlier ``start``.
    """

    def __init__(self, model: Transformer, batch: int = 1, max_len: int | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE):
        max_len = model.max_seq_len if max_len is None else min(max_len, model.max_seq_len)
        self.model = model
        self.max_len = max_len
        per_seq = -(-max_len // block_size)
        self.pool = model.new_pool(batch * per_seq, block_size)
        self.tables = [torch.arange(b * per_seq, (b + 1) * per_seq, dtype=torch.int32)
                       for b in range(batch)]

    def __call__(self, tokens: Tensor, start: int, logits_for: str | int = "all") -> Tensor:
        """Logits ``[B, m, V]`` (float32) for ``tokens[B, n]``, row b placed at positions
        ``start .. start + n - 1`` of sequence b. ``logits_for``: ``"all"`` (m = n),
        ``"last"`` (m = 1), or an int m (the last m positions): the head only runs there."""
        bsz, n = tokens.shape
        if bsz > len(self.tables):
            raise ValueError(f"batch of {bsz} exceeds the cache's {len(self.tables)} sequences")
        if start + n > self.max_len:
            raise ValueError(f"sequence of {start + n} tokens exceeds max_len={self.max_len}")
        keep = n if logits_for == "all" else (1 if logits_for == "last" else int(logits_for))
        seqs = [SeqRows(start, n, self.tables[b]) for b in range(bsz)]
        rows = None if keep == n else torch.tensor(
            [b * n + i for b in range(bsz) for i in range(n - keep, n)], device=tokens.device)
        return self.model(tokens.reshape(-1), seqs, self.pool, rows).view(bsz, keep, -1)


def _plan_slice(plan: ctypes.Array, start: int, stop: int) -> ctypes.Array:
    """Entries ``start:stop`` of a layer plan, viewed in place (``plan`` must outlive it)."""
    entry = type(plan)._type_
    return (entry * (stop - start)).from_address(ctypes.addressof(plan) + start * ctypes.sizeof(entry))


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (CUDA; nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fits_cpu_ops(cfg: LlamaConfig) -> bool:
    """Whether the fused CPU helpers cover this architecture (else plain torch ops run)."""
    return (not cfg.qk_norm and cfg.head_dim % 32 == 0 and cfg.hidden_size % 8 == 0
            and cfg.intermediate_size % 8 == 0)
