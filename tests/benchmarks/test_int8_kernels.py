"""The int8 kernel benchmark's comparison: both kernel sets on the same matrices, same bits."""

from __future__ import annotations

import pytest

from agentrt.engine.cpu_ops import cpu_ops
from agentrt.engine.packed import PackedMatrix
from benchmarks.int8_kernels import matmul_times
from random_models import random_blocks


def test_matmul_times_runs_both_kernel_sets_and_compares_their_bits():
    ops = cpu_ops()
    if ops is None or not ops.use_vnni(True):
        pytest.skip("no AVX512-VNNI here")
    matrices = [(PackedMatrix(kind, random_blocks(kind, 24, 64, seed=i), 64).interleaved(), 64)
                for i, kind in enumerate(("q4_1", "q8_0"))]
    for rows in (1, 9):
        times, same = matmul_times(ops, matrices, rows, repeats=2)
        assert same and set(times) == {False, True} and all(0 < t < 1 for t in times.values())
    assert ops.use_vnni()  # VNNI is timed last; main() restores the caller's choice
