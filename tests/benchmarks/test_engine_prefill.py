"""The engine benchmark's ``--prefill`` tables (`benchmarks.engine.prefill`) on made-up runs, and
its command line importing without the concurrency suite's dependencies."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentrt.engine.llama import LlamaConfig
from benchmarks.engine import prefill
from benchmarks.engine.runs import Run
from benchmarks.engine.systems import Row

CFG = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16)


def _run(system: str, index: int, speeds: dict[int, list[float]]) -> Run:
    rows = [Row(system, f"prefill-{n}", f"{n}-{i}", n, 1, n / s, 0.0, n / s)
            for n, per in speeds.items() for i, s in enumerate(per)]
    return Run(system, index, 1000 + index, 0.0, rows)


def test_lengths_are_checked():
    assert prefill.lengths("512, 2048") == [512, 2048]
    with pytest.raises(ValueError, match="at least 16"):
        prefill.lengths("8")


def test_flops_per_token_count_the_matmuls_and_the_attention():
    gemm, attention = prefill.flops_per_token(CFG, 10)
    assert gemm == 2 * 2 * (64 * (64 + 2 * 32) + 64 * 64 + 2 * 64 * 128 + 128 * 64)
    assert attention == 4 * 64 * 10 * 2


def test_a_steady_anchor_gives_ratios_and_shares_of_the_peaks():
    runs = [_run("llamacpp", 0, {512: [100.0, 90.0]}), _run("plain", 1, {512: [300.0, 310.0]}),
            _run("llamacpp", 2, {512: [102.0]})]
    gflops = {"kernel-bf16-avx512": 50.0, "torch-fp32": 80.0, "machine": 80.0}
    summary = prefill.summarise(runs, [512], CFG, gflops, tolerance=0.1)
    plain = summary["lengths"][512]["systems"]["plain"]
    assert summary["anchor_ok"] and plain["x_llamacpp"] == pytest.approx(310 / 101)
    assert plain["path"] == "kernel-bf16-avx512"
    assert plain["of_path_peak"] == pytest.approx(310 * prefill.flops_per_token(CFG, 255.5)[0] / 50e9)
    meta = {"time": "t", "model": "m", "dtype": "bf16", "threads": 2, "load_before": "0",
            "load_after": "0", "runs": [{"system": r.system} for r in runs],
            "gemm_gflops": gflops, "isas": {}, "anchor_tolerance": 0.1,
            "system_info": {"llamacpp": {"system_info": "AVX512 = 1"}}}
    text = prefill.markdown(summary, meta)
    assert "| 512 | plain | 310 | 310 | 3.07 |" in text and "AVX512 = 1" in text


def test_an_unsteady_anchor_gives_bounds_only():
    runs = [_run("llamacpp", 0, {512: [100.0]}), _run("plain", 1, {512: [300.0]}),
            _run("llamacpp", 2, {512: [150.0]})]
    summary = prefill.summarise(runs, [512], CFG, {}, tolerance=0.1)
    plain = summary["lengths"][512]["systems"]["plain"]
    assert not summary["anchor_ok"] and "x_llamacpp" not in plain
    assert plain["x_llamacpp_bounds"] == pytest.approx((2.0, 3.0))


def test_the_command_line_imports_without_the_concurrency_suites_dependencies():
    code = ("import sys; sys.modules['pydantic'] = None; import benchmarks.engine.cli; "
            "assert not [m for m in sys.modules if m.startswith('agentrt.demo')]")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
