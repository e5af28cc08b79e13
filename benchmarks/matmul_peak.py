"""The machine's matmul peak on the model's own matrix shapes, path by path.

``python -m benchmarks.matmul_peak [--model smollm2-135m | --synthetic] [--rows 512,2048,8192]
[--threads 2] [--repeats 3] [--json PATH]``

For each matrix one layer multiplies in a prefill (the fused qkv, the output projection, the
fused gate/up and down projections; weights ``[N, K]``) and each row count, every GEMM path this
process can run is timed on the same activations, calls interleaved so that the machine's load
hits every path alike, best of ``--repeats``: torch float32 (MKL), torch bfloat16 (oneDNN; bf16
activations and output), and the project's kernels (`CpuOps`): the exact bf16-weight kernel on
AVX2 and on AVX512F (the same bits), its bf16-activation twin on AVX512-BF16
(``precision="bf16"``) and the int8 kernel against the GGUF blocks (AVX2 and AVX512-VNNI). Each
figure is ``2 M N K / seconds`` in GFLOP/s (the int8 kernel's integer operations counted the
same way, its activation quantisation included); the best path per shape is the machine's
measured peak there. Which instruction set MKL and oneDNN run is read from their verbose output.
The header also gives the float32 FMA peak of a loop on registers (`benchmarks.fma_peak`): the
ceiling of every float32 path, the exact kernels included.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .engine.common import load_average
from .fma_peak import fma_peak

ROWS = (512, 2048, 8192)
MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")


@dataclass(frozen=True)
class Shape:
    """One matrix of a layer: its name, dense bf16 weight and int8 blocks (or None)."""

    name: str
    dense: Tensor
    int8: object | None

    @property
    def label(self) -> str:
        n, k = self.dense.shape
        return f"{self.name} {n}x{k}"


def model_shapes(model) -> list[Shape]:
    """The first layer's matrices of a loaded `Transformer` (int8 blocks where it has them)."""
    layer = model.layers[0]
    return [Shape(name, getattr(layer, name), layer.int8.get(name)) for name in MATRICES]


def synthetic_shapes(hidden: int = 576, intermediate: int = 1536, heads: int = 9,
                     kv_heads: int = 3, head_dim: int = 64) -> list[Shape]:
    """Random weights (and random Q4_1 blocks) of SmolLM2-135M's shapes, for a machine without
    the pulled model."""
    from agentrt.engine.packed import BLOCK_BYTES, PackedMatrix

    gen = torch.Generator().manual_seed(0)
    sizes = {"wqkv": ((heads + 2 * kv_heads) * head_dim, hidden), "wo": (hidden, heads * head_dim),
             "w_gate_up": (2 * intermediate, hidden), "w_down": (hidden, intermediate)}
    shapes = []
    for name, (n, k) in sizes.items():
        blocks = torch.randint(0, 256, (n, k // 32, BLOCK_BYTES["q4_1"]), dtype=torch.uint8,
                               generator=gen)
        scales = (torch.rand(n, k // 32, 2, generator=gen) * 0.01).half()
        blocks[..., :4] = scales.view(torch.uint8).view(n, k // 32, 4)
        packed = PackedMatrix("q4_1", blocks.reshape(n, -1), k)
        shapes.append(Shape(name, packed.dequantize().bfloat16(), packed.interleaved()))
    return shapes


Runner = Callable[[Tensor], object]


def paths(ops, shape: Shape) -> dict[str, Runner]:
    """Every GEMM path for ``shape`` that runs here, by name: ``x[M, K]`` (float32) -> output."""
    w32 = shape.dense.float()
    found: dict[str, Runner] = {
        "torch-fp32": lambda x: F.linear(x, w32),
        "torch-bf16": lambda x: F.linear(x, shape.dense),  # called with bf16 x, see `inputs`
    }
    if ops is None:
        return found

    def exact(x: Tensor) -> Tensor:
        return ops.linear(x, shape.dense)

    found["kernel-bf16-avx2"] = _with(ops.use_bf16_avx512, 0, exact)
    if ops.paths.exact == "avx512":
        found["kernel-bf16-avx512"] = _with(ops.use_bf16_avx512, 1, exact)
    if ops.paths.bf16:
        found["kernel-bf16dot"] = lambda x: ops.bf16_dot_linear(x, shape.dense)
    if shape.int8 is not None:
        found["kernel-int8-avx2"] = _with(ops.use_vnni, False, lambda x: ops.int8_linear(x, shape.int8))
        if ops.use_vnni(True):
            found["kernel-int8-vnni"] = _with(ops.use_vnni, True,
                                              lambda x: ops.int8_linear(x, shape.int8))
    return found


def _with(switch: Callable, value, run: Runner) -> Runner:
    """``run`` with a kernel switch (`CpuOps.use_vnni`, `CpuOps.use_bf16_avx512`) set first."""
    def call(x: Tensor):
        switch(value)
        return run(x)
    return call


def inputs(name: str, x: Tensor) -> Tensor:
    """The activations a path takes: bf16 for torch's bf16 GEMM, float32 otherwise."""
    return x.bfloat16() if name == "torch-bf16" else x


def measure(runners: dict[str, Runner], x: Tensor, repeats: int) -> dict[str, float]:
    """Best seconds per path over ``repeats`` rounds, the paths interleaved in each round."""
    args = {name: inputs(name, x) for name in runners}
    for name, run in runners.items():  # warm-up: oneDNN builds its kernel on the first call
        run(args[name])
    best = dict.fromkeys(runners, float("inf"))
    for _ in range(repeats):
        for name, run in runners.items():
            start = time.perf_counter()
            run(args[name])
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def captured_stdout(call: Callable[[], object]) -> str:
    """What ``call`` writes to the process's file descriptor 1 (C libraries' verbose output)."""
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 1)
        try:
            call()
            libc.fflush(None)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        sink.seek(0)
        return sink.read().decode(errors="replace")


def library_isas() -> dict[str, str]:
    """The instruction sets MKL (float32 GEMM) and oneDNN (bf16 GEMM) dispatch to here."""
    x, w = torch.randn(64, 576), torch.randn(576, 576)
    with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
        mkl = captured_stdout(lambda: F.linear(x, w))
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        dnnl = captured_stdout(lambda: F.linear(x.bfloat16(), w.bfloat16()))
    mkl_isa = re.search(r"architecture (.+?), Lnx", mkl)
    impl = re.search(r"exec,cpu,(?:matmul|inner_product),([^,]+)", dnnl)
    isa = re.search(r"info,cpu,isa:([^\n]+)", dnnl)
    return {"mkl": (f"code path for {mkl_isa.group(1)}" if mkl_isa
                    else "unknown (no MKL verbose output)"),
            "onednn": (f"{impl.group(1) if impl else 'unknown'} "
                       f"({isa.group(1).strip() if isa else 'isa unknown'})"),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability()}


def run(shapes: list[Shape], ops, rows: list[int], repeats: int) -> list[dict]:
    """One record per (shape, rows): GFLOP/s per path and the best path."""
    records = []
    gen = torch.Generator().manual_seed(1)
    for shape in shapes:
        runners = paths(ops, shape)
        n, k = shape.dense.shape
        for m in rows:
            x = torch.randn(m, k, generator=gen)
            seconds = measure(runners, x, repeats)
            gflops = {name: 2 * m * n * k / s / 1e9 for name, s in seconds.items()}
            best = max(gflops, key=gflops.get)
            records.append({"matrix": shape.label, "rows": m, "gflops": gflops, "best": best})
            print(f"{shape.label:18s} {m:5d} rows  " + "  ".join(
                f"{name} {g:6.1f}" for name, g in gflops.items()), file=sys.stderr)
    return records


def markdown(records: list[dict], isas: dict[str, str], header: dict) -> str:
    """The records as a table: GFLOP/s per path, the best marked, one line per shape and rows."""
    names = list(dict.fromkeys(name for r in records for name in r["gflops"]))
    lines = [f"Matmul peak, {header['threads']} threads, best of {header['repeats']}, "
             f"load average {header['load_before']} -> {header['load_after']}",
             f"MKL: {isas['mkl']}; oneDNN: {isas['onednn']}; torch CPU capability: "
             f"{isas['torch_cpu_capability']}",
             *(["float32 FMA peak (registers only, `benchmarks.fma_peak`; the exact path's "
                "ceiling): " + ", ".join(f"{k} {v:.1f}" for k, v in header["fma_peak"].items())
                + " GFLOP/s"] if header.get("fma_peak") else []), "",
             "| matrix | rows | " + " | ".join(names) + " | best |",
             "|---|---|" + "---|" * (len(names) + 1)]
    for r in records:
        cells = [(f"**{r['gflops'][n]:.1f}**" if n == r["best"] else f"{r['gflops'][n]:.1f}")
                 if n in r["gflops"] else "-" for n in names]
        lines.append(f"| {r['matrix']} | {r['rows']} | " + " | ".join(cells) + f" | {r['best']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.matmul_peak",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--synthetic", action="store_true",
                        help="random weights of SmolLM2-135M's shapes (no pulled model needed)")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="also write the records here")
    args = parser.parse_args(argv)

    from agentrt.engine.cpu_ops import cpu_ops

    torch.set_num_threads(args.threads)
    ops = cpu_ops()
    if args.synthetic:
        shapes = synthetic_shapes()
    else:
        from agentrt.engine import models
        from agentrt.engine.llama import Transformer

        model = Transformer.from_pretrained(models.ensure(args.model, "bf16"), precision="int8")
        shapes = model_shapes(model)
    header = {"threads": args.threads, "repeats": args.repeats, "load_before": load_average(),
              "fma_peak": fma_peak(args.threads)}
    isas = library_isas()
    try:
        with torch.inference_mode():
            records = run(shapes, ops, [int(r) for r in args.rows.split(",")], args.repeats)
    finally:
        if ops is not None:
            ops.use_paths(ops.paths)
    header["load_after"] = load_average()
    print(markdown(records, isas, header))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header, "isas": isas, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
