"""Compiled CPU helpers for the native engine's step (AVX2 + FMA, C via ctypes).

On a CPU without native bf16 matmul, a 135M-parameter decode step is dominated by torch's
per-op dispatch and by widening bf16 weights. These few C functions replace the hot ops: the
bf16-weight matmul (and its twin reading GGUF blocks, see `agentrt.engine.packed`), RMSNorm,
the SiLU gate, RoPE + KV-cache store and causal attention over a paged cache, and
`decode_layers_paged`, which runs a whole step's layers through them in one call;
``csrc/int8_ops.c`` adds the integer matmul of int8-quantised activations against the GGUF
blocks (`CpuOps.int8_linear`; with AVX512-VNNI kernels where the CPU has them). The C units
(`_SOURCES`, each with its header) are compiled once with gcc (``_GCC_FLAGS``) into one library
in the agentrt home, cached by the content of every source and header and by the flags;
where that is impossible (no AVX2, no gcc, ``AGENTRT_CPU_KERNEL=0``) `cpu_ops` returns None and
plain torch ops run instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .gemm_paths import CpuFeatures, GemmPaths

if TYPE_CHECKING:
    from .packed import InterleavedMatrix, PackedMatrix

log = logging.getLogger(__name__)


# The structures passed to C, field for field as declared in csrc/layers.h (Matrix, Layer) and
# csrc/kv_cache.h (Seq); tests/engine/test_c_layout.py compares their layout with the C side.
class _Matrix(ctypes.Structure):
    _fields_ = [("dense", ctypes.c_void_p), ("packed", ctypes.c_void_p), ("kind", ctypes.c_int),
                ("int8", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p),
                ("bqkv", ctypes.c_void_p), ("qkv", _Matrix), ("o", _Matrix),
                ("gate_up", _Matrix), ("down", _Matrix), ("k_cache", ctypes.c_void_p),
                ("v_cache", ctypes.c_void_p)]


class _Seq(ctypes.Structure):
    _fields_ = [("row0", ctypes.c_int64), ("n", ctypes.c_int64), ("start", ctypes.c_int64),
                ("blocks", ctypes.c_void_p)]


@dataclass(frozen=True)
class LayerShape:
    """The sizes `CpuOps.decode_layers_paged` needs (hidden, MLP width, heads, kv heads, head dim)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float


_GCC_FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-pthread", "-shared", "-fPIC")
_PACKED_KINDS = {"q4_1": 0, "q8_0": 1}
CACHE_DTYPE = torch.float16
"""What the kernels store keys and values as: half the bytes attention streams per step."""
_SOURCES = ("matmul.c", "matmul512.c", "bf16_dot.c", "norms.c", "kv_cache.c", "attention.c",
            "layers.c", "int8_ops.c", "team.c")
"""The C units under ``engine/csrc/`` built into the one library: the bf16 and GGUF-block float
matmuls (and the bf16 one's many-row path on AVX512F, and its bf16-activation twin on
AVX512-BF16), RMSNorm and the SiLU gate, RoPE + KV-cache store, paged attention, the fused layer
step, the int8 matmuls and the worker team. The headers beside them (``*.h``) go with them."""


class CpuOps:
    """The compiled CPU helpers (AVX2 + FMA, built once with gcc and cached under the agentrt
    home): the bf16 and GGUF-block matmuls and fused float32 RMSNorm, SiLU-gate, RoPE + cache
    store and causal attention. Each call replaces several small torch ops whose dispatch
    overhead dominates a 135M-parameter decode step on CPU."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        """The library itself: its other functions are the steps of `decode_layers_paged`
        (RoPE + cache store, paged attention, the SiLU gate) and of `int8_linear`."""
        i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
        self._linear = self._fn(lib.bf16_linear, [ptr, ptr, ptr, ptr, i64, i64, i64, i32])
        self._rms_norm = self._fn(lib.rms_norm, [ptr, ptr, ptr, i64, i64, f32])
        self._packed_linear = self._fn(lib.packed_linear,
                                       [ptr, ptr, i32, i32, ptr, ptr, i64, i64, i64, i32])
        self._int8_linear = self._fn(lib.int8_linear, [ptr, ptr, i32, ptr, ptr, i64, i64, i64, i32])
        self._decode_layers_paged = self._fn(lib.decode_layers_paged,
                                             [ptr, i64, ptr, i64, ptr, i64, i64, i64, i64, i64, i64,
                                              i64, ptr, f32, f32, i32, i32, i32])
        self._bf16_dot_linear = self._fn(lib.bf16_dot_linear, [ptr, ptr, ptr, ptr, i64, i64, i64, i32])
        self._bf16_dot = self._fn(lib.bf16_dot_supported, [])
        self._bf16_dot.restype = i32
        self._vnni = self._fn(lib.int8_vnni, [i32])
        self._vnni.restype = i32
        self._avx512 = self._fn(lib.bf16_avx512, [i32])
        self._avx512.restype = i32
        self.paths = self.use_paths(GemmPaths.choose(CpuFeatures.detect()))
        """The matmul paths in use (`GemmPaths`), chosen from what the CPU has."""
        log.info("CPU kernels loaded; %s", self.paths.describe())

    def use_paths(self, paths: GemmPaths) -> GemmPaths:
        """Run the matmuls on ``paths`` from now on (a path the CPU lacks falls back to AVX2);
        returns, and keeps as `paths`, what runs. Not to be called during a forward."""
        self.paths = paths.apply(self)
        return self.paths

    def use_vnni(self, enabled: bool | None = None) -> bool:
        """Whether `int8_linear` and the int8 step run the AVX512-VNNI kernels (where the CPU
        has them; see `GemmPaths` for the start-up choice): set when ``enabled`` is given, then
        returned. Both give the same bits; not to be switched during a matmul."""
        return bool(self._vnni(-1 if enabled is None else int(enabled)))

    def use_bf16_avx512(self, min_rows: int | None = None) -> int:
        """From how many activation rows on `linear` (and the exact step's matmuls) run the
        AVX512F tiles where the CPU has them, instead of the AVX2 ones (0: never): set when
        ``min_rows`` is given, then returned. Both give the same bits; not to be switched
        during a matmul."""
        return int(self._avx512(-1 if min_rows is None else max(0, int(min_rows))))

    @staticmethod
    def _fn(fn, argtypes):
        fn.argtypes, fn.restype = argtypes, None
        return fn

    def linear(self, x: Tensor, w: Tensor, residual: Tensor | None = None) -> Tensor:
        """``x[M, K] (float32) @ w[N, K]^T (bf16) (+ residual)``, float32 out."""
        y = torch.empty(x.shape[0], w.shape[0])
        self._linear(x.data_ptr(), w.data_ptr(), y.data_ptr(),
                     None if residual is None else residual.data_ptr(),
                     x.shape[0], w.shape[0], x.shape[1], torch.get_num_threads())
        return y

    def bf16_dot_linear(self, x: Tensor, w: Tensor, residual: Tensor | None = None) -> Tensor:
        """``bf16(x[M, K]) @ w[N, K]^T (+ residual)``: x rounded to bfloat16, float32 sums of
        the bf16 products (AVX512-BF16; ``precision="bf16"``'s arithmetic, see
        ``csrc/bf16_dot.c``); where the CPU lacks it, `linear`'s float32 product instead."""
        y = torch.empty(x.shape[0], w.shape[0])
        self._bf16_dot_linear(x.data_ptr(), w.data_ptr(), y.data_ptr(),
                              None if residual is None else residual.data_ptr(),
                              x.shape[0], w.shape[0], x.shape[1], torch.get_num_threads())
        return y

    def bf16_dot_supported(self) -> bool:
        """Whether this CPU runs `bf16_dot_linear` (AVX512F, AVX512BW, AVX512-BF16)."""
        return bool(self._bf16_dot())

    def packed_linear(self, x: Tensor, w: "PackedMatrix", round_bf16: bool,
                      residual: Tensor | None = None) -> Tensor:
        """``x[M, K] (float32) @ W^T (+ residual)`` for W kept in GGUF blocks (`PackedMatrix`),
        its values rounded to bfloat16 first when ``round_bf16``; float32 out."""
        if x.dim() != 2 or x.shape[1] != w.in_features or not x.is_contiguous():
            raise ValueError(f"packed_linear needs contiguous x [M, {w.in_features}], "
                             f"got {tuple(x.shape)}")
        y = torch.empty(x.shape[0], w.out_features)
        self._packed_linear(x.data_ptr(), w.blocks.data_ptr(), _PACKED_KINDS[w.kind],
                            int(round_bf16), y.data_ptr(),
                            None if residual is None else residual.data_ptr(),
                            x.shape[0], w.out_features, w.in_features, torch.get_num_threads())
        return y

    def int8_linear(self, x: Tensor, w: "InterleavedMatrix", residual: Tensor | None = None) -> Tensor:
        """``x[M, K] (float32) @ W^T (+ residual)`` for W in GGUF blocks (interleaved by 8 rows,
        `PackedMatrix.interleaved`), with x quantised to int8
        per block of 32 (`quantize_q8_rows`) and integer dot products (`q8_blocks_linear`): not
        equal to the float product, see ``csrc/int8_ops.c`` for the exact arithmetic."""
        _check_rows(x, w)
        y = torch.empty(x.shape[0], w.out_features)
        self._int8_linear(x.data_ptr(), w.blocks.data_ptr(), _PACKED_KINDS[w.kind], y.data_ptr(),
                          None if residual is None else residual.data_ptr(),
                          x.shape[0], w.out_features, w.in_features, torch.get_num_threads())
        return y

    def rms_norm(self, x: Tensor, w: Tensor, eps: float) -> Tensor:
        y = torch.empty_like(x)
        self._rms_norm(x.data_ptr(), w.data_ptr(), y.data_ptr(), x.shape[0], x.shape[1], eps)
        return y

    @staticmethod
    def layer_plan(layers: Sequence[object], caches: Sequence[tuple[Tensor, Tensor]]) -> ctypes.Array:
        """The pointers `decode_layers_paged` reads, one entry per layer. Each of ``layers`` (a
        model's `Block`) holds bf16 matrices ``wqkv, wo, w_gate_up, w_down``, float32 norms
        ``attn_norm, mlp_norm``, an optional float32 ``bqkv``, and dicts ``packed`` (GGUF
        blocks) and ``int8`` (the blocks interleaved: such a matrix multiplies int8 activations
        at every row count) by matrix name; ``caches`` are its k/v block pools
        ``[blocks, KV, block_size, D]``. The tensors must outlive the plan."""
        def matrix(layer, name: str) -> _Matrix:
            dense = getattr(layer, name).data_ptr()
            blocks, fast = layer.packed.get(name), layer.int8.get(name)
            if blocks is None:
                return _Matrix(dense, None, 0, None)
            return _Matrix(dense, blocks.blocks.data_ptr(), _PACKED_KINDS[blocks.kind],
                           None if fast is None else fast.blocks.data_ptr())

        plan = (_Layer * len(layers))()
        for entry, layer, (k, v) in zip(plan, layers, caches, strict=True):
            entry.attn_norm, entry.mlp_norm = layer.attn_norm.data_ptr(), layer.mlp_norm.data_ptr()
            entry.bqkv = None if layer.bqkv is None else layer.bqkv.data_ptr()
            entry.qkv, entry.o = matrix(layer, "wqkv"), matrix(layer, "wo")
            entry.gate_up, entry.down = matrix(layer, "w_gate_up"), matrix(layer, "w_down")
            _check_cache(k, v)
            entry.k_cache, entry.v_cache = k.data_ptr(), v.data_ptr()
        return plan

    # ------------------------------------------------------------- a step over a paged KV cache

    @staticmethod
    def seq_table(seqs: list[tuple[int, int, int, Tensor]]) -> ctypes.Array:
        """The per-sequence descriptors the paged kernels read: ``(first row, rows, start
        position, block table)`` each, the table an int32 tensor that must outlive the call."""
        table = (_Seq * len(seqs))()
        for entry, (row0, n, start, blocks) in zip(table, seqs):
            if blocks.dtype != torch.int32 or not blocks.is_contiguous():
                raise ValueError("block tables must be contiguous int32 tensors")
            entry.row0, entry.n, entry.start, entry.blocks = row0, n, start, blocks.data_ptr()
        return table

    def decode_layers_paged(self, x: Tensor, seqs: ctypes.Array, plan: ctypes.Array,
                            shape: LayerShape, block_size: int, rope: Tensor,
                            packed_max_rows: int, bf16_rows: int = 0) -> None:
        """Run ``x[n, hidden]`` (float32, contiguous; every sequence's rows, updated in place)
        through every layer of ``plan`` (built over block pools): RMSNorm, qkv (+ bias), RoPE +
        cache store, attention, output projection, RMSNorm, SiLU-gated MLP, both residuals.
        The matmuls see all rows at once; RoPE and attention go per sequence. One row of one
        sequence (plain decoding) runs all layers in one parallel region, each thread taking a
        share of every matmul and of the heads, with the same kernels per output (same bits).
        ``bf16_rows`` > 0: a step of at least that many rows multiplies the dense matrices with
        bf16 activations (`bf16_dot_linear`), where `paths` has the bf16 path."""
        if x.dim() != 2 or not x.is_contiguous() or x.dtype != torch.float32 or x.shape[0] < 1:
            raise ValueError(f"decode_layers_paged needs contiguous float32 rows, got "
                             f"{x.dtype} {tuple(x.shape)}")
        self._decode_layers_paged(x.data_ptr(), x.shape[0], ctypes.addressof(seqs), len(seqs),
                                  ctypes.addressof(plan), len(plan), shape.hidden,
                                  shape.intermediate, shape.heads, shape.kv_heads, shape.head_dim,
                                  block_size, rope.data_ptr(), shape.eps,
                                  1.0 / math.sqrt(shape.head_dim), packed_max_rows,
                                  bf16_rows if self.paths.bf16 else 0, torch.get_num_threads())


def _check_cache(*caches: Tensor) -> None:
    """The kernels keep keys and values as float16 (`CACHE_DTYPE`), contiguous."""
    for cache in caches:
        if cache.dtype != CACHE_DTYPE or not cache.is_contiguous():
            raise ValueError(f"KV caches for the CPU kernels must be contiguous {CACHE_DTYPE}, "
                             f"got {cache.dtype}")


def _check_rows(x: Tensor, w: "PackedMatrix | InterleavedMatrix") -> None:
    if x.dim() != 2 or x.shape[1] != w.in_features or not x.is_contiguous() or x.dtype != torch.float32:
        raise ValueError(f"needs contiguous float32 x [M, {w.in_features}], "
                         f"got {x.dtype} {tuple(x.shape)}")


def _c_sources() -> dict[str, str]:
    """The C units of the helpers and every header beside them (``engine/csrc/*.c``, ``*.h``,
    shipped as package data), by file name."""
    folder = resources.files(__package__).joinpath("csrc")
    headers = sorted(entry.name for entry in folder.iterdir() if entry.name.endswith(".h"))
    return {name: folder.joinpath(name).read_text() for name in (*_SOURCES, *headers)}


def _build_cpu_ops() -> CpuOps | None:
    if os.environ.get("AGENTRT_CPU_KERNEL", "1") == "0":
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    from .models import home

    sources = _c_sources()
    digest = hashlib.sha256()
    for name, text in sources.items():
        digest.update(f"{name}\0{text}\0".encode())
    digest.update(" ".join(_GCC_FLAGS).encode())
    target = home() / "kernels" / f"cpu_ops-{digest.hexdigest()[:16]}.so"
    try:
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory() as tmp:
                for name, text in sources.items():
                    (Path(tmp) / name).write_text(text)
                units = [str(Path(tmp) / name) for name in _SOURCES]
                out = Path(tmp) / "cpu_ops.so"
                subprocess.run(["gcc", *_GCC_FLAGS, *units, "-o", str(out), "-lm"],
                               check=True, capture_output=True, timeout=120)
                os.replace(out, target)
        return CpuOps(ctypes.CDLL(str(target)))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("CPU kernels unavailable (%s); using plain torch ops", exc)
        return None


_ops_cache: dict[str, CpuOps | None] = {}


def cpu_ops() -> CpuOps | None:
    """The compiled CPU helpers, or None where they cannot be built (no AVX2, no gcc, or
    ``AGENTRT_CPU_KERNEL=0``)."""
    if "ops" not in _ops_cache:
        _ops_cache["ops"] = _build_cpu_ops()
    return _ops_cache["ops"]
