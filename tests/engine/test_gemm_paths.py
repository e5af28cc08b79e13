"""The matmul paths chosen at start-up (`GemmPaths`): what each CPU gets and what it falls back
to; the AVX512F tiles of the exact matmul against the AVX2 ones (same bits, alone and in the
pulled model's forwards); ``precision="bf16"``'s kernel (row-independent, close to the float64
product of the rounded activations) and its forwards (batched == alone, close to exact, exact
where the CPU lacks the path)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from agentrt.engine import models
from agentrt.engine.cpu_ops import cpu_ops
from agentrt.engine.gemm_paths import AVX512_MIN_ROWS, BF16_MIN_ROWS, CpuFeatures, GemmPaths
from agentrt.engine.llama import SeqRows, SequenceCache, Transformer
from per_op_forward import per_op_forward

ALL = CpuFeatures(avx2=True, avx512f=True, avx512_vnni=True, avx512_bf16=True)


@pytest.fixture(scope="module")
def ops():
    found = cpu_ops()
    if found is None:
        pytest.skip("no AVX2 / C compiler here: the plain torch path is in use")
    before = found.paths
    yield found
    found.use_paths(before)


@pytest.fixture(scope="module")
def model():
    path = models.ensure("smollm2-135m", "bf16")
    loaded = Transformer.from_pretrained(path, "bf16", max_seq_len=256)
    if loaded.ops is None:
        pytest.skip("no AVX2 / C compiler here: the plain torch path is in use")
    return loaded


def test_each_cpu_gets_the_fastest_path_it_has():
    assert GemmPaths.choose(ALL, {}) == GemmPaths("avx512", "vnni", "avx512bf16")
    assert GemmPaths.choose(CpuFeatures(avx2=True), {}) == GemmPaths("avx2", "avx2", None)
    no_bf16 = CpuFeatures(avx2=True, avx512f=True, avx512_vnni=True)
    assert GemmPaths.choose(no_bf16, {}) == GemmPaths("avx512", "vnni", None)


def test_the_environment_caps_the_paths():
    assert GemmPaths.choose(ALL, {"AGENTRT_GEMM_ISA": "avx2"}) == GemmPaths("avx2", "avx2", None)
    assert GemmPaths.choose(ALL, {"AGENTRT_INT8_VNNI": "0"}).int8 == "avx2"
    with pytest.raises(ValueError, match="AGENTRT_GEMM_ISA"):
        GemmPaths.choose(ALL, {"AGENTRT_GEMM_ISA": "amx"})


def test_the_kernels_start_on_what_the_cpu_has_and_fall_back_when_told(ops):
    cpu = CpuFeatures.detect()
    assert ops.paths == GemmPaths.choose(cpu).apply(ops)
    assert (ops.use_bf16_avx512() == AVX512_MIN_ROWS) == (ops.paths.exact == "avx512")
    fallback = ops.use_paths(GemmPaths.choose(cpu, {"AGENTRT_GEMM_ISA": "avx2"}))
    assert fallback == GemmPaths("avx2", "avx2", None)
    assert ops.use_bf16_avx512() == 0 and not ops.use_vnni()
    ops.use_paths(GemmPaths.choose(cpu))
    code = ("from agentrt.engine.cpu_ops import cpu_ops; p = cpu_ops().paths; "
            "print(p.exact, p.int8, p.bf16)")
    env = {**os.environ, "AGENTRT_GEMM_ISA": "avx2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=300).stdout.split()
    assert out == ["avx2", "avx2", "None"]


def _both(ops, call):
    """``call()`` on the AVX2 tiles, then on the AVX512F ones (where the CPU has them)."""
    ops.use_bf16_avx512(0)
    first = call()
    if not ops.use_bf16_avx512(1):
        pytest.skip("no AVX512F here: the AVX2 tiles are the only ones")
    try:
        return first, call()
    finally:
        ops.use_paths(ops.paths)


@pytest.mark.parametrize("m,n,k", [(13, 24, 64), (16, 960, 576), (37, 576, 1536), (100, 8, 32),
                                   (515, 3072, 576), (64, 20, 64)])
def test_avx512_tiles_give_the_bits_of_the_avx2_ones(ops, m, n, k):
    gen = torch.Generator().manual_seed(m * n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen).bfloat16()
    residual = torch.randn(m, n, generator=gen)
    avx2, avx512 = _both(ops, lambda: ops.linear(x, w, residual))
    assert torch.equal(avx2, avx512)


def test_the_pulled_model_computes_the_same_bits_on_either_path(ops, model):
    ids = torch.randint(100, 20000, (1, 150), generator=torch.Generator().manual_seed(1))

    def run() -> torch.Tensor:  # a long and a short prefill chunk, then single steps
        cache = SequenceCache(model, max_len=160)
        with torch.inference_mode():
            parts = [cache(ids[:, :120], 0), cache(ids[:, 120:140], 120)]
            parts += [cache(ids[:, i:i + 1], i) for i in range(140, 150)]
        return torch.cat(parts, dim=1)

    avx2, avx512 = _both(ops, run)
    assert torch.equal(avx2, avx512)
    assert torch.equal(avx2.argmax(-1), avx512.argmax(-1))


def _bf16_or_skip(ops) -> None:
    if not ops.paths.bf16:
        pytest.skip("no AVX512-BF16 here: precision='bf16' computes exactly")


@pytest.mark.parametrize("m,n,k", [(1, 576, 576), (70, 48, 64), (129, 3072, 576), (12, 576, 1536)])
def test_bf16_dot_rows_are_independent_and_close_to_the_rounded_product(ops, m, n, k):
    _bf16_or_skip(ops)
    gen = torch.Generator().manual_seed(m + n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen).bfloat16()
    y = ops.bf16_dot_linear(x, w)
    alone = torch.cat([ops.bf16_dot_linear(x[i:i + 1], w) for i in range(m)])
    assert torch.equal(y, alone)
    want = x.bfloat16().double() @ w.double().T  # the products are exact: only sums round
    assert (y.double() - want).abs().max() <= 1e-5 * want.abs().max()


def test_bf16_precision_is_row_independent_and_close_to_exact(ops, model):
    _bf16_or_skip(ops)
    ids = torch.randint(100, 20000, (3, 140), generator=torch.Generator().manual_seed(2))
    try:
        model.precision = "bf16"
        assert model.bf16_rows == BF16_MIN_ROWS
        with torch.inference_mode():
            batch = SequenceCache(model, batch=3, max_len=140)(ids, 0)
            alone = [SequenceCache(model, max_len=140)(ids[i:i + 1], 0)[0] for i in range(3)]
            halves = SequenceCache(model, max_len=140)
            chunked = torch.cat([halves(ids[:1, :70], 0), halves(ids[:1, 70:], 70)], dim=1)[0]
            pool = model.new_pool(3, 64)
            per_op = per_op_forward(model, ids[0], [SeqRows(0, 140, torch.arange(3, dtype=torch.int32))],
                                    pool)
        for i in range(3):
            assert torch.equal(batch[i], alone[i]), "a row must not depend on its batch"
        assert torch.equal(chunked, alone[0]), "chunks of 64+ rows must not change a bit"
        assert torch.equal(per_op, alone[0]), "one C call must equal one call per op"
        model.precision = "exact"
        with torch.inference_mode():
            exact = SequenceCache(model, max_len=140)(ids[:1], 0)[0]
        assert not torch.equal(exact, alone[0])
        p, q = exact.log_softmax(-1), alone[0].log_softmax(-1)
        assert (p.exp() * (p - q)).sum(-1).mean() < 2e-3
        assert (exact.argmax(-1) == alone[0].argmax(-1)).float().mean() > 0.9
    finally:
        model.precision = "exact"


def test_bf16_precision_without_the_path_computes_exactly(ops, model):
    ids = torch.randint(100, 20000, (1, 80), generator=torch.Generator().manual_seed(4))

    def run(precision: str) -> torch.Tensor:
        model.precision = precision
        with torch.inference_mode():
            return SequenceCache(model, max_len=80)(ids, 0)

    try:
        ops.use_paths(GemmPaths(ops.paths.exact, ops.paths.int8, None))
        assert model.bf16_rows == 0 or model.precision != "bf16"
        assert torch.equal(run("bf16"), run("exact"))
    finally:
        model.precision = "exact"
        ops.use_paths(GemmPaths.choose(CpuFeatures.detect()))
