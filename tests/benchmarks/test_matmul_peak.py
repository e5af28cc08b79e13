"""The matmul peak benchmark: every path runs on the model's shapes and the best one is named."""

from __future__ import annotations

import torch

from agentrt.engine.cpu_ops import cpu_ops
from benchmarks.matmul_peak import library_isas, markdown, paths, run, synthetic_shapes


def test_every_path_gives_the_product_and_the_best_is_marked():
    shapes = synthetic_shapes()
    assert [s.dense.shape[1] for s in shapes] == [576, 576, 576, 1536]
    ops = cpu_ops()
    shape = shapes[1]
    x = torch.randn(5, shape.dense.shape[1])
    want = x @ shape.dense.float().T
    for name, runner in paths(ops, shape).items():
        got = runner(x.bfloat16() if name == "torch-bf16" else x).float()
        rounded = name in ("torch-bf16", "kernel-bf16dot") or "int8" in name  # not float32 x
        tolerance = 0.05 if rounded else 1e-4
        assert (got - want).abs().max() <= tolerance * want.abs().max(), name
    with torch.inference_mode():
        records = run(shapes[:2], ops, [16], repeats=1)
    assert [r["rows"] for r in records] == [16, 16]
    assert all(r["best"] == max(r["gflops"], key=r["gflops"].get) for r in records)
    table = markdown(records, library_isas(), {"threads": 2, "repeats": 1, "load_before": "0",
                                               "load_after": "0", "fma_peak": {"avx2": 1.5}})
    assert "| wqkv 960x576 | 16 |" in table and "oneDNN" in table and "avx2 1.5 GFLOP/s" in table



def test_fma_peak_is_within_what_a_core_can_do():
    """One thread's figure is positive and at most two FMA pipes of its width at 6 GHz: a loop
    whose chains the compiler merged, or a miscount of lanes, reads higher."""
    from benchmarks.fma_peak import fma_peak

    peak = fma_peak(1, repeats=2)
    assert "avx2" in peak
    for name, lanes in (("avx2", 8), ("avx512", 16)):
        if name in peak:
            assert 0 < peak[name] <= 2 * 2 * lanes * 6.0, (name, peak[name])
