"""Which path each kind of CPU matmul takes, chosen once from what the CPU has (`GemmPaths`).

- ``exact`` (bf16 weights, float32 activations and sums; the default precision): the C kernel's
  tiles on AVX512F from `AVX512_MIN_ROWS` activation rows where the CPU has it, else on AVX2.
  Both sum every output in the same order: the same bits.
- ``int8`` (``precision="int8"``): the AVX512-VNNI group kernels where the CPU has them, else
  AVX2; the same bits too.
- ``bf16`` (``precision="bf16"``, opt-in): steps of at least `BF16_MIN_ROWS` rows multiply
  bf16 activations by the bf16 weights on AVX512-BF16 (`CpuOps.bf16_dot_linear`), a different
  arithmetic (see docs/engine.md). None on a CPU without it: such a model computes exactly.

``AGENTRT_GEMM_ISA=avx2`` keeps every kernel on AVX2 and turns the bf16 path off, as on a CPU
without AVX512; ``AGENTRT_INT8_VNNI=0`` keeps the int8 kernels on AVX2.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

import torch

AVX512_MIN_ROWS = 16
"""From this many activation rows on, the exact matmuls run the AVX512F tiles (fewer rows go
row by row past each weight row, as before)."""
BF16_MIN_ROWS = 64
"""From this many rows of a step on, ``precision="bf16"`` multiplies bf16 activations (fewer
rows, e.g. a decode or verify step, run the exact kernels)."""
ISA_CAPS = ("auto", "avx2")


@dataclass(frozen=True)
class CpuFeatures:
    """The instruction sets the GEMM paths need, as this process may use them."""

    avx2: bool = False
    avx512f: bool = False
    avx512_vnni: bool = False
    avx512_bf16: bool = False

    @classmethod
    def detect(cls) -> CpuFeatures:
        """From torch's CPU probe, else from the flags of /proc/cpuinfo."""
        try:
            flags = {k for k, v in torch._C._cpu._get_cpu_capability().items() if v is True}
            names = {"avx2": "avx2", "avx512f": "avx512_f", "avx512_vnni": "avx512_vnni",
                     "avx512_bf16": "avx512_bf16"}
        except (AttributeError, RuntimeError):
            flags = _cpuinfo_flags()
            names = {f.name: f.name for f in fields(cls)}
        return cls(**{field: name in flags for field, name in names.items()})


def _cpuinfo_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f
                         if line.startswith("flags")), set())
    except OSError:
        return set()


@dataclass(frozen=True)
class GemmPaths:
    """The path each kind of matmul takes (see the module docstring)."""

    exact: str
    """``"avx512"`` or ``"avx2"``."""
    int8: str
    """``"vnni"`` or ``"avx2"``."""
    bf16: str | None
    """``"avx512bf16"`` or None."""

    @classmethod
    def choose(cls, cpu: CpuFeatures, env: Mapping[str, str] | None = None) -> GemmPaths:
        """The fastest path of each kind that ``cpu`` runs, within what ``env`` allows."""
        env = os.environ if env is None else env
        cap = env.get("AGENTRT_GEMM_ISA", "auto")
        if cap not in ISA_CAPS:
            raise ValueError(f"AGENTRT_GEMM_ISA must be one of {ISA_CAPS}, got {cap!r}")
        wide = cap == "auto"
        bf16 = "avx512bf16" if wide and cpu.avx512_bf16 else None
        vnni = wide and cpu.avx512_vnni and env.get("AGENTRT_INT8_VNNI", "1") != "0"
        return cls(exact="avx512" if wide and cpu.avx512f else "avx2",
                   int8="vnni" if vnni else "avx2", bf16=bf16)

    def apply(self, ops) -> GemmPaths:
        """Set the kernels of `CpuOps` ``ops`` to these paths; returns what they run (a path
        the library finds unsupported falls back to AVX2)."""
        avx512 = ops.use_bf16_avx512(AVX512_MIN_ROWS if self.exact == "avx512" else 0)
        vnni = ops.use_vnni(self.int8 == "vnni")
        bf16 = self.bf16 if self.bf16 and ops.bf16_dot_supported() else None
        return GemmPaths("avx512" if avx512 else "avx2", "vnni" if vnni else "avx2", bf16)

    def describe(self) -> str:
        return (f"exact matmuls on {self.exact}, int8 on {self.int8}, "
                f"bf16 {self.bf16 or 'unavailable'}")
