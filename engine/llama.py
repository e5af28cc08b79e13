"""A lean Llama-family decoder in plain torch, with a static preallocated KV cache.

Covers Llama / Mistral / Qwen2 / Qwen3 style checkpoints: RMSNorm, rotary embeddings (default,
linear and llama3 scaling), grouped-query attention, SiLU-gated MLP, optional q/k/v bias (Qwen2),
optional q/k norms (Qwen3) and tied embeddings. Weights load from ``*.safetensors`` +
``config.json`` in a Hugging Face directory.

``forward(tokens[B, n], start_pos)`` runs ``n`` new tokens at positions
``start_pos .. start_pos + n - 1``, writing their keys/values into the cache and attending over
everything before them. Nothing else is stored, so rolling back rejected tokens is just calling
the next forward with a smaller ``start_pos``.

Precision: weights keep the checkpoint's dtype. On CUDA (and for fp32 weights) activations use
the weight dtype. On CPU with bf16/fp16 weights, activations and the KV cache are float32 and
every projection goes through `Matmul`, which reads half-precision weights directly (see there).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import packed as packed_weights
from .cpu_ops import CACHE_DTYPE, CpuOps, LayerShape, cpu_ops
from .packed import InterleavedMatrix, PackedMatrix

log = logging.getLogger(__name__)

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PRECISIONS = ("exact", "int8")
"""``exact``: the checkpoint's weights in float32 arithmetic (bit-identical with or without GGUF
blocks); ``int8``: matrices kept in GGUF blocks multiply int8-quantised activations
(`CpuOps.int8_linear`, llama.cpp's arithmetic class), faster and close but not identical."""


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


# --------------------------------------------------------------------------- CPU kernels

class Matmul:
    """``x @ w.T (+ b) (+ residual)`` for one model, where weights and activations may differ in dtype.

    ``compute_dtype`` is the activations' dtype. On CPU with bf16 weights and float32
    activations, up to ``kernel_max_rows`` rows use the AVX2 kernel (`CpuOps.linear`): it
    streams the bf16 weights once and accumulates in float32, so verifying 8 draft tokens costs
    little more than decoding one (torch's bf16 matmul on CPUs without native bf16 costs about
    linearly in rows), and a row's result does not depend on the batch. More rows (long
    prefills) widen the weight to float32 for torch's GEMM. Without the kernel: torch bf16 for
    one row, widened weights for several.
    """

    def __init__(self, weight_dtype: torch.dtype, compute_dtype: torch.dtype,
                 ops: CpuOps | None = None, kernel_max_rows: int = 48, packed_max_rows: int = 3):
        self.weight_dtype, self.compute_dtype = weight_dtype, compute_dtype
        self.mixed = weight_dtype != compute_dtype
        self.ops = ops if (self.mixed and weight_dtype == torch.bfloat16
                           and compute_dtype == torch.float32) else None
        self.kernel_max_rows = kernel_max_rows
        self.packed_max_rows = packed_max_rows

    def __call__(self, x: Tensor, w: Tensor, b: Tensor | None = None,
                 residual: Tensor | None = None, packed: PackedMatrix | None = None,
                 int8: InterleavedMatrix | None = None) -> Tensor:
        """``packed``: the same matrix in GGUF blocks (bit-identical values, see
        `agentrt.engine.packed`); used for up to ``packed_max_rows`` rows, where streaming
        fewer bytes pays more than widening the blocks costs. ``int8``: the blocks interleaved
        for `CpuOps.int8_linear` (``"int8"`` precision), used at every row count (~30 us per
        row of a 3072x576 matrix on one core, against 40-75 for widening to float32 + MKL)."""
        rows, k = x.shape
        if int8 is not None and self.ops is not None:
            y = self.ops.int8_linear(x.contiguous(), int8, residual if b is None else None)
            if b is None:
                return y
            y = y + b
        elif packed is not None and self.ops is not None and rows <= self.packed_max_rows:
            if b is None:
                return self.ops.packed_linear(x.contiguous(), packed, True, residual)
            y = self.ops.packed_linear(x.contiguous(), packed, True) + b
        elif self.ops is not None and rows <= self.kernel_max_rows and k % 8 == 0:
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


class Block(nn.Module):
    """One decoder layer with fused qkv and gate/up projections.

    q and k rows are stored in adjacent-pair RoPE order (`interleave_halves`). Attention uses a
    grouped layout: the ``heads / kv_heads`` query heads sharing a kv head are stacked along the
    query axis, so grouped-query attention needs no key/value expansion.
    """

    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype, device):
        super().__init__()
        self.cfg = cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        kw = dict(dtype=dtype, device=device)
        self.attn_norm = nn.Parameter(torch.ones(cfg.hidden_size, **kw), requires_grad=False)
        self.wqkv = nn.Parameter(torch.empty(q + 2 * kv, cfg.hidden_size, **kw), requires_grad=False)
        self.bqkv = (nn.Parameter(torch.zeros(q + 2 * kv, **kw), requires_grad=False)
                     if cfg.attention_bias else None)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(cfg.head_dim, **kw), requires_grad=False)
            self.k_norm = nn.Parameter(torch.ones(cfg.head_dim, **kw), requires_grad=False)
        self.wo = nn.Parameter(torch.empty(cfg.hidden_size, q, **kw), requires_grad=False)
        self.mlp_norm = nn.Parameter(torch.ones(cfg.hidden_size, **kw), requires_grad=False)
        self.w_gate_up = nn.Parameter(
            torch.empty(2 * cfg.intermediate_size, cfg.hidden_size, **kw), requires_grad=False)
        self.w_down = nn.Parameter(
            torch.empty(cfg.hidden_size, cfg.intermediate_size, **kw), requires_grad=False)

    def forward(self, x: Tensor, freqs: Tensor, start_pos: int, bsz: int, mask: Tensor | None,
                w: dict[str, Tensor | None], k_cache: Tensor, v_cache: Tensor, mm: Matmul) -> Tensor:
        """Run the layer on ``x[B * n, hidden]`` with weights ``w`` (see `Transformer.layer_weights`),
        writing keys/values at ``start_pos`` into the caches ``[B_max, kv_heads, T_max, head_dim]``
        and attending with ``mask[groups * n, start_pos + n]`` (None: see everything)."""
        cfg = self.cfg
        n = x.shape[0] // bsz
        h, kvh, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        qkv = mm(rms_norm(x, w["attn_norm"], eps), w["wqkv"], w["bqkv"])
        qk = qkv[:, :(h + kvh) * hd].view(bsz, n, h + kvh, hd)
        v = qkv[:, (h + kvh) * hd:].view(bsz, n, kvh, hd)
        if w["q_norm"] is not None:
            qk = torch.cat([rms_norm(qk[:, :, :h], w["q_norm"], eps),
                            rms_norm(qk[:, :, h:], w["k_norm"], eps)], dim=2)
        qk = apply_rope(qk, freqs)
        end = start_pos + n
        k_cache[:bsz, :, start_pos:end] = qk[:, :, h:].transpose(1, 2)
        v_cache[:bsz, :, start_pos:end] = v.transpose(1, 2)
        q = qk[:, :, :h]
        attn = _grouped_attention(q, k_cache[:bsz, :, :end].to(q.dtype),
                                  v_cache[:bsz, :, :end].to(q.dtype), mask)
        x = mm(attn.reshape(bsz * n, h * hd).to(x.dtype), w["wo"], residual=x)
        gate_up = mm(rms_norm(x, w["mlp_norm"], eps), w["w_gate_up"])
        inter = cfg.intermediate_size
        return mm(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w["w_down"], residual=x)

    def forward_cpu(self, x: Tensor, rope: Tensor, start_pos: int, mask: Tensor | None,
                    w: dict[str, Tensor | None], k_cache: Tensor, v_cache: Tensor, mm: Matmul,
                    ops: CpuOps) -> Tensor:
        """`forward` for one float32 sequence on CPU, with the fused `CpuOps` helpers
        (``rope``: `Transformer.rope` viewed as real (cos, sin) pairs)."""
        cfg = self.cfg
        n = x.shape[0]
        h, kvh, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        p, q8 = w["packed"] or {}, w["int8"] or {}
        qkv = mm(ops.rms_norm(x, w["attn_norm"], eps), w["wqkv"], w["bqkv"],
                 packed=p.get("wqkv"), int8=q8.get("wqkv")).contiguous()
        ops.rope_store(qkv, rope, start_pos, h, kvh, hd, k_cache, v_cache)
        if n <= 32:
            attn = ops.attend(qkv, k_cache, v_cache, start_pos, h, kvh, hd)
        else:  # long prefill chunks: torch's attention is the faster one there
            end = start_pos + n
            q = qkv[:, :h * hd].view(1, n, h, hd)
            attn = _grouped_attention(q, k_cache[:1, :, :end].to(q.dtype),
                                      v_cache[:1, :, :end].to(q.dtype), mask)
            attn = attn.reshape(n, h * hd)
        x = mm(attn, w["wo"], residual=x, packed=p.get("wo"), int8=q8.get("wo"))
        gate_up = mm(ops.rms_norm(x, w["mlp_norm"], eps), w["w_gate_up"],
                     packed=p.get("w_gate_up"), int8=q8.get("w_gate_up"))
        return mm(ops.silu_mul(gate_up), w["w_down"], residual=x, packed=p.get("w_down"),
                  int8=q8.get("w_down"))


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


_MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")
_VECTORS = ("attn_norm", "bqkv", "q_norm", "k_norm", "mlp_norm")


class Transformer(nn.Module):
    """A Llama-family causal LM with a static KV cache (see the module docstring).

    ``compute_dtype`` (default: float32 on CPU, else the weight dtype) is the dtype of
    activations and of the KV cache. ``cpu_kernel=False`` disables the AVX2 bf16 matmul.
    ``precision`` (see `PRECISIONS`): ``"int8"`` takes effect for the matrices that have GGUF
    blocks (`use_packed`) on the fused CPU path; elsewhere the model computes exactly.
    """

    def __init__(self, cfg: LlamaConfig, dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device = "cpu", max_seq_len: int = 4096, max_batch: int = 1,
                 compute_dtype: torch.dtype | None = None, cpu_kernel: bool = True,
                 precision: str = "exact"):
        super().__init__()
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        if compute_dtype is None:
            compute_dtype = torch.float32 if self.device.type == "cpu" else dtype
        self.compute_dtype = compute_dtype
        kw = dict(dtype=dtype, device=self.device)
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, **kw), requires_grad=False)
        self.layers = nn.ModuleList(Block(cfg, dtype, self.device) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size, **kw), requires_grad=False)
        self.lm_head = (self.embed if cfg.tie_word_embeddings else
                        nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, **kw), requires_grad=False))
        on_cpu = self.device.type == "cpu" and compute_dtype == torch.float32
        ops = cpu_ops() if cpu_kernel and on_cpu else None
        self.matmul = Matmul(dtype, compute_dtype, ops)
        self._precision = precision
        # the kernels serve bf16 checkpoints (float16 KV cache); float32 ones stay on torch ops
        self.ops = ops if ops is not None and dtype == torch.bfloat16 and _fits_cpu_ops(cfg) else None
        self.layer_weights: list[dict[str, Tensor | None]] = []
        self.rope = torch.empty(0, dtype=torch.complex64)
        self.rope_pairs = torch.empty(0)
        self.caches: list[tuple[Tensor, Tensor]] = []
        self._plan: tuple[tuple, object] | None = None
        self.fused_layers = True
        """Run steps of up to 32 rows through all layers in one `CpuOps.decode_layers` call
        (identical results; False: one call per op, for comparison)."""
        self.max_batch = max_batch
        self.max_seq_len = 0
        self.allocate_cache(max_batch, max_seq_len)
        self.refresh_weights()

    # ------------------------------------------------------------------------- construction

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: str | torch.dtype = "bf16",
                        device: str | torch.device = "cpu", max_seq_len: int = 4096,
                        max_batch: int = 1, compute_dtype: torch.dtype | None = None,
                        cpu_kernel: bool = True, precision: str = "exact") -> "Transformer":
        """Load ``config.json`` + ``*.safetensors`` from a Hugging Face model directory
        (``precision``: see `PRECISIONS`; ``"int8"`` needs the GGUF blocks that `models.pull`
        keeps, and logs a warning and computes exactly without them)."""
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
        model = cls(cfg, torch_dtype, device, max_seq_len, max_batch, compute_dtype, cpu_kernel,
                    precision)
        model.load_hf_state(tensors)
        used = 0
        if model.ops is not None and model.matmul.ops is not None:
            used = model.use_packed(packed_weights.load(path / packed_weights.PACKED_FILE))
        if precision == "int8" and not used:
            log.warning("precision='int8' needs GGUF blocks and the CPU kernels (none for %s); "
                        "computing exactly", path)
        return model.eval()

    @property
    def precision(self) -> str:
        """``"exact"`` or ``"int8"`` (see `PRECISIONS`); settable between forwards."""
        return self._precision

    @precision.setter
    def precision(self, value: str) -> None:
        if value not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {value!r}")
        self._precision = value
        self._set_int8_weights()

    def _set_int8_weights(self) -> None:
        """In ``"int8"`` precision, every matrix with GGUF blocks also gets them interleaved
        for `CpuOps.int8_linear` (``w["int8"]``, `int8_head`); in ``"exact"``, none does."""
        int8 = self._precision == "int8"
        for w in self.layer_weights:
            w["int8"] = ({name: m.interleaved() for name, m in w["packed"].items()}
                         if int8 and w["packed"] else None)
        self.int8_head = (self.packed_head.interleaved()
                          if int8 and self.packed_head is not None else None)

    def load_hf_state(self, tensors: dict[str, Tensor]) -> None:
        """Copy weights named as in transformers' ``LlamaForCausalLM`` into the fused layout
        (q/k rows, biases and norms in adjacent-pair RoPE order)."""
        hd = self.cfg.head_dim

        def take(name: str) -> Tensor:
            try:
                return tensors[name]
            except KeyError:
                raise KeyError(f"checkpoint has no tensor {name!r}") from None

        def put(param: Tensor, value: Tensor) -> None:
            if param.shape != value.shape:
                raise ValueError(f"shape mismatch: {tuple(value.shape)} vs {tuple(param.shape)}")
            param.copy_(value.to(param.dtype))

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
        self.refresh_weights()

    def refresh_weights(self) -> None:
        """Rebuild the per-layer weight tables after the parameters changed: matrices as
        stored, vectors (norms, biases) in the compute dtype."""
        def vec(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.to(self.compute_dtype)

        self.layer_weights = [
            {**{name: getattr(layer, name) for name in _MATRICES},
             **{name: vec(getattr(layer, name)) for name in _VECTORS},
             "packed": None, "int8": None}
            for layer in self.layers
        ]
        self.packed_head = self.int8_head = None
        self.final_norm = vec(self.norm)

    def use_packed(self, packed: dict[str, PackedMatrix]) -> int:
        """Decode with GGUF blocks (see `agentrt.engine.packed`) where they reproduce this
        model's weights bit for bit; returns how many matrices use them. Only the fused CPU
        path (bf16 weights, float32 activations) reads them."""
        if not packed or self.ops is None or self.matmul.ops is None:
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
        for i, (layer, w) in enumerate(zip(self.layers, self.layer_weights)):
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
            w["packed"] = {name: m for name, m in checked.items() if m is not None}
            used += len(w["packed"])
        head = "model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"
        self.packed_head = exact(packed.get(head), self.lm_head)
        self._set_int8_weights()
        return used + (self.packed_head is not None)

    def allocate_cache(self, max_batch: int, max_seq_len: int) -> None:
        """(Re)allocate the KV cache for ``max_batch`` sequences of ``max_seq_len`` tokens."""
        if max_seq_len > self.rope.shape[0]:
            self.rope = rope_frequencies(self.cfg, max_seq_len, self.device)
            self.rope_pairs = torch.view_as_real(self.rope).contiguous()
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        shape = (max_batch, self.cfg.num_kv_heads, max_seq_len, self.cfg.head_dim)
        self.caches = [
            (torch.zeros(shape, dtype=self.cache_dtype, device=self.device),
             torch.zeros(shape, dtype=self.cache_dtype, device=self.device))
            for _ in range(self.cfg.num_layers)
        ]

    def truncated(self, num_layers: int) -> "Transformer":
        """A layer-skip drafter: the first ``num_layers`` layers, sharing this model's weights
        (embeddings, final norm and head included), with a KV cache of its own."""
        if not 0 < num_layers <= self.cfg.num_layers:
            raise ValueError(f"num_layers must be in 1..{self.cfg.num_layers}, got {num_layers}")
        clone = Transformer.__new__(Transformer)
        nn.Module.__init__(clone)
        clone.cfg = LlamaConfig(**{**self.cfg.__dict__, "num_layers": num_layers})
        clone.dtype, clone.device, clone.compute_dtype = self.dtype, self.device, self.compute_dtype
        clone.embed, clone.norm, clone.lm_head = self.embed, self.norm, self.lm_head
        clone.layers = nn.ModuleList(self.layers[:num_layers])
        clone.matmul, clone.ops = self.matmul, self.ops
        clone.layer_weights = self.layer_weights[:num_layers]
        clone.final_norm, clone.packed_head = self.final_norm, self.packed_head
        clone._precision, clone.int8_head = self._precision, self.int8_head
        clone.rope, clone.rope_pairs = self.rope, self.rope_pairs
        clone.caches = []
        clone._plan, clone.fused_layers = None, self.fused_layers
        clone.max_seq_len = 0
        clone.allocate_cache(self.max_batch, self.max_seq_len)
        return clone.eval()

    # ------------------------------------------------------------------------------ forward

    @property
    def cache_dtype(self) -> torch.dtype:
        """What keys and values are stored as: float16 with the CPU kernels (`CACHE_DTYPE`:
        half the bytes attention streams), else the activations' dtype."""
        return CACHE_DTYPE if self.ops is not None else self.compute_dtype

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def forward(self, tokens: Tensor, start_pos: int, logits_for: str | int = "all") -> Tensor:
        """Logits ``[B, m, V]`` (float32) for ``tokens[B, n]`` placed at ``start_pos``.

        ``logits_for``: ``"all"`` (m = n), ``"last"`` (m = 1), or an int m (the last m
        positions): the head only runs where logits are needed.
        """
        bsz, n = tokens.shape
        end = start_pos + n
        if end > self.max_seq_len:
            raise ValueError(f"sequence of {end} tokens exceeds max_seq_len={self.max_seq_len}")
        if bsz > self.max_batch:
            raise ValueError(f"batch of {bsz} exceeds max_batch={self.max_batch}")
        x = F.embedding(tokens.reshape(-1), self.embed).to(self.compute_dtype)
        ops = self.ops if bsz == 1 else None
        if ops is not None and n <= 32 and self.matmul.ops is not None and self.fused_layers:
            x = x.contiguous()
            cfg = self.cfg
            shape = LayerShape(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                               cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)
            ops.decode_layers(x, start_pos, self._layer_plan(), shape, self.max_seq_len,
                              self.rope_pairs, self.matmul.packed_max_rows)
            return self._logits(x, bsz, n, logits_for, ops)
        mask = None
        if n > 1:
            groups = self.cfg.num_heads // self.cfg.num_kv_heads
            key_pos = torch.arange(end, device=self.device)
            query_pos = torch.arange(start_pos, end, device=self.device)
            mask = (key_pos[None, :] <= query_pos[:, None]).repeat(groups, 1)
        layers = zip(self.layers, self.layer_weights, self.caches)
        if ops is not None:
            for layer, w, (k_cache, v_cache) in layers:
                x = layer.forward_cpu(x, self.rope_pairs, start_pos, mask, w, k_cache, v_cache,
                                      self.matmul, ops)
        else:
            freqs = self.rope[start_pos:end, None, :]
            for layer, w, (k_cache, v_cache) in layers:
                x = layer(x, freqs, start_pos, bsz, mask, w, k_cache, v_cache, self.matmul)
        return self._logits(x, bsz, n, logits_for, ops)

    def _logits(self, x: Tensor, bsz: int, n: int, logits_for: str | int,
                ops: CpuOps | None) -> Tensor:
        """Final norm and head over the positions ``logits_for`` asks for."""
        keep = n if logits_for == "all" else (1 if logits_for == "last" else int(logits_for))
        x = x.view(bsz, n, -1)[:, n - keep:].reshape(bsz * keep, -1)
        if ops is not None:
            x = ops.rms_norm(x.contiguous(), self.final_norm, self.cfg.rms_norm_eps)
        else:
            x = rms_norm(x, self.final_norm, self.cfg.rms_norm_eps)
        logits = self.matmul(x, self.lm_head, packed=self.packed_head if ops is not None else None,
                             int8=self.int8_head if ops is not None else None)
        return logits.view(bsz, keep, -1).float()

    def layer_shape(self) -> LayerShape:
        cfg = self.cfg
        return LayerShape(cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                          cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps)

    def forward_batch(self, tokens: Tensor, seqs: list["SeqRows"], pool,
                      logit_rows: Tensor | None = None) -> Tensor:
        """A ragged batch step over a paged KV cache: see the module function `forward_batch`."""
        return forward_batch(self, tokens, seqs, pool, logit_rows)

    def _pool_plan(self, pool):
        """`CpuOps.layer_plan` over a `KVPool`'s block pools (rebuilt when weights change)."""
        parts = (pool, self.layer_weights, *(w["packed"] for w in self.layer_weights),
                 *(w["int8"] for w in self.layer_weights))
        cached = getattr(self, "_paged_plan", None)
        if (cached is None or len(cached[0]) != len(parts)
                or any(a is not b for a, b in zip(cached[0], parts))):
            cached = (parts, self.ops.layer_plan(self.layer_weights, pool.caches))
            self._paged_plan = cached
        return cached[1]

    def _layer_plan(self):
        """`CpuOps.layer_plan` for the current weights, blocks and caches (rebuilt when any of
        them was replaced; the kept references also keep the pointed-to tensors alive)."""
        parts = (self.layer_weights, self.caches, *(w["packed"] for w in self.layer_weights),
                 *(w["int8"] for w in self.layer_weights))
        if (self._plan is None or len(self._plan[0]) != len(parts)
                or any(a is not b for a, b in zip(self._plan[0], parts))):
            self._plan = (parts, self.ops.layer_plan(self.layer_weights, self.caches))
        return self._plan[1]


@dataclass(frozen=True)
class SeqRows:
    """One sequence's rows in a ragged batch step: ``n`` rows at positions ``start ..
    start + n - 1``, its keys and values in the pool blocks of ``blocks`` (int32, position t in
    block ``blocks[t // block_size]``)."""

    start: int
    n: int
    blocks: Tensor


def forward_batch(model: "Transformer", tokens: Tensor, seqs: list[SeqRows], pool,
                  logit_rows: Tensor | None = None) -> Tensor:
    """Logits ``[len(logit_rows), V]`` (float32) of a ragged batch step.

    ``tokens[n]`` holds every sequence's new tokens one sequence after another (``seqs`` in the
    same order); their keys and values are written into ``pool`` (a `KVPool`) and each row
    attends to its own sequence's positions up to its own. ``logit_rows`` picks the rows whose
    logits are needed (default: all). With the CPU kernels (bf16 weights, float32 activations)
    every row's result depends only on its own sequence's tokens: the batch, the chunking of a
    prompt and which blocks hold the keys change no bit. `Transformer.fused_layers` picks one
    C call for all layers or one call per op (identical results, tested); without the kernels
    the same step runs on torch ops (equal to float rounding)."""
    n = tokens.shape[0]
    if sum(s.n for s in seqs) != n:
        raise ValueError(f"{n} tokens for sequences of {sum(s.n for s in seqs)} rows")
    for s in seqs:
        if s.start + s.n > model.max_seq_len or s.blocks.numel() * pool.block_size < s.start + s.n:
            raise ValueError(f"rows up to position {s.start + s.n} exceed max_seq_len or the "
                             f"sequence's {s.blocks.numel()} blocks")
    x = F.embedding(tokens, model.embed).to(model.compute_dtype)
    ops = model.ops  # float32 activations on CPU: the C helpers (matmuls too for bf16 weights)
    if ops is not None:
        x = x.contiguous()
        rows, row0 = [], 0
        for s in seqs:
            rows.append((row0, s.n, s.start, s.blocks))
            row0 += s.n
        table = ops.seq_table(rows)
        if model.fused_layers and model.matmul.ops is not None:
            ops.decode_layers_paged(x, table, model._pool_plan(pool), model.layer_shape(),
                                    pool.block_size, model.rope_pairs, model.matmul.packed_max_rows)
        else:
            for w, (k, v) in zip(model.layer_weights, pool.caches):
                x = _paged_layer_ops(model, x, table, w, k, v)
    else:
        for layer, w, (k, v) in zip(model.layers, model.layer_weights, pool.caches):
            x = _paged_layer_torch(model, layer, x, seqs, w, k, v)
    if logit_rows is not None:
        x = x[logit_rows]
    if x.shape[0] == 0:
        return torch.empty(0, model.vocab_size)
    if ops is not None:
        x = ops.rms_norm(x.contiguous(), model.final_norm, model.cfg.rms_norm_eps)
        return _rows_linear(model, x, model.lm_head, model.packed_head, model.int8_head).float()
    x = rms_norm(x, model.final_norm, model.cfg.rms_norm_eps)
    return model.matmul(x, model.lm_head).float()


def _rows_linear(model: "Transformer", x: Tensor, w: Tensor, packed: PackedMatrix | None,
                 int8: InterleavedMatrix | None = None, residual: Tensor | None = None) -> Tensor:
    """``x @ w.T (+ residual)`` with the row-independent kernels only (as ``matrix_apply`` in
    C): the int8 kernel where ``int8`` blocks are given (``"int8"`` precision), else GGUF blocks
    for up to ``packed_max_rows`` rows, else the bf16 kernel, whatever the number of rows (no
    float32 GEMM, whose row results may depend on the batch)."""
    ops = model.matmul.ops
    if ops is None:  # float32 weights: torch's matmul
        return model.matmul(x, w, residual=residual)
    if int8 is not None:
        return ops.int8_linear(x, int8, residual)
    if packed is not None and x.shape[0] <= model.matmul.packed_max_rows:
        return ops.packed_linear(x, packed, True, residual)
    return ops.linear(x, w, residual)


def _paged_layer_ops(model: "Transformer", x: Tensor, table, w: dict, k_pool: Tensor,
                     v_pool: Tensor) -> Tensor:
    """One layer of a ragged batch step, one C kernel call per op (the reference the one-call
    `decode_layers_paged` is tested against)."""
    cfg, ops = model.cfg, model.ops
    h, kvh, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    p, q8 = w["packed"] or {}, w["int8"] or {}

    def linear(inp: Tensor, name: str, residual: Tensor | None = None) -> Tensor:
        return _rows_linear(model, inp, w[name], p.get(name), q8.get(name), residual)

    qkv = linear(ops.rms_norm(x, w["attn_norm"], eps), "wqkv")
    if w["bqkv"] is not None:
        qkv = qkv + w["bqkv"]
    qkv = qkv.contiguous()
    ops.rope_store_paged(qkv, model.rope_pairs, table, h, kvh, hd, k_pool, v_pool)
    attn = ops.attend_paged(qkv, k_pool, v_pool, table, h, kvh, hd)
    mid = linear(attn, "wo", residual=x)
    gate_up = linear(ops.rms_norm(mid, w["mlp_norm"], eps), "w_gate_up")
    return linear(ops.silu_mul(gate_up), "w_down", residual=mid)


def _paged_layer_torch(model: "Transformer", layer: "Block", x: Tensor, seqs: list[SeqRows],
                       w: dict, k_pool: Tensor, v_pool: Tensor) -> Tensor:
    """One layer of a ragged batch step on torch ops (no CPU kernels: other dtypes, CUDA)."""
    cfg = model.cfg
    h, kvh, hd, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    bs = k_pool.shape[2]
    mm = model.matmul
    qkv = mm(rms_norm(x, w["attn_norm"], eps), w["wqkv"], w["bqkv"])
    outs, row0 = [], 0
    for s in seqs:
        part = qkv[row0:row0 + s.n]
        row0 += s.n
        qk = part[:, :(h + kvh) * hd].view(1, s.n, h + kvh, hd)
        v = part[:, (h + kvh) * hd:].view(s.n, kvh, hd)
        if w["q_norm"] is not None:
            qk = torch.cat([rms_norm(qk[:, :, :h], w["q_norm"], eps),
                            rms_norm(qk[:, :, h:], w["k_norm"], eps)], dim=2)
        qk = apply_rope(qk, model.rope[s.start:s.start + s.n, None, :])
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
    x = mm(attn, w["wo"], residual=x)
    gate_up = mm(rms_norm(x, w["mlp_norm"], eps), w["w_gate_up"])
    inter = cfg.intermediate_size
    return mm(F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w["w_down"], residual=x)


def _fits_cpu_ops(cfg: LlamaConfig) -> bool:
    """Whether the fused CPU helpers cover this architecture (else plain torch ops run)."""
    return (not cfg.qk_norm and cfg.head_dim % 32 == 0 and cfg.hidden_size % 8 == 0
            and cfg.intermediate_size % 8 == 0)
