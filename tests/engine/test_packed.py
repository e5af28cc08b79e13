"""GGUF blocks as weights (`agentrt.engine.packed`): the reference dequantisation against the
`gguf` package's, the CPU kernel against the bf16 kernel bit for bit, row matching on a real
GGUF file written here, and the pulled model decoding identically with and without blocks."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from agentrt.engine import packed
from agentrt.engine.packed import BLOCK_BYTES, PackedMatrix
from random_models import random_blocks

gguf = pytest.importorskip("gguf")


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_dequantize_matches_the_gguf_reference(kind):
    blocks = random_blocks(kind, 24, 96)
    ours = PackedMatrix(kind, blocks, 96).dequantize()
    qtype = getattr(gguf.GGMLQuantizationType, kind.upper())
    theirs = gguf.quants.dequantize(blocks.numpy(), qtype)
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(theirs)))


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="unsupported"):
        PackedMatrix("q5_k", torch.zeros(2, 20, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="do not hold"):
        PackedMatrix("q4_1", torch.zeros(2, 21, dtype=torch.uint8), 32)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_kernel_equals_the_bf16_kernel_bit_for_bit(kind):
    from agentrt.engine.cpu_ops import cpu_ops

    ops = cpu_ops()
    if ops is None:
        pytest.skip("no AVX2 / C compiler here")
    matrix = PackedMatrix(kind, random_blocks(kind, 40, 128, seed=1), 128)
    dense = matrix.dequantize()
    gen = torch.Generator().manual_seed(2)
    for rows in (1, 2, 3, 5, 8, 9, 13):
        x = torch.randn(rows, 128, generator=gen)
        residual = torch.randn(rows, 40, generator=gen)
        assert torch.equal(ops.packed_linear(x, matrix, True), ops.linear(x, dense.bfloat16()))
        assert torch.equal(ops.packed_linear(x, matrix, True, residual),
                           ops.linear(x, dense.bfloat16(), residual))
        exact = ops.packed_linear(x, matrix, False)
        assert (exact - x @ dense.T).abs().max() < 1e-4


def test_from_gguf_matches_permuted_rows_and_round_trips(tmp_path):
    q = random_blocks("q4_1", 16, 64, seed=3)
    emb = random_blocks("q8_0", 10, 64, seed=4)
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, blocks, qtype in (("blk.0.attn_q.weight", q, gguf.GGMLQuantizationType.Q4_1),
                                ("token_embd.weight", emb, gguf.GGMLQuantizationType.Q8_0)):
        writer.add_tensor(name, blocks.numpy(), raw_shape=tuple(blocks.shape), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    perm = torch.randperm(16, generator=torch.Generator().manual_seed(5))
    state = {
        "model.layers.0.self_attn.q_proj.weight": PackedMatrix("q4_1", q, 64).dequantize()[perm],
        "model.embed_tokens.weight": PackedMatrix("q8_0", emb, 64).dequantize(),
        "model.layers.0.mlp.up_proj.weight": torch.zeros(8, 64),  # not in the file
    }
    found = packed.from_gguf(path, state)
    assert sorted(found) == ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"]
    for name, matrix in found.items():
        assert torch.equal(matrix.dequantize(), state[name])

    packed.save(found, tmp_path / packed.PACKED_FILE)
    loaded = packed.load(tmp_path / packed.PACKED_FILE)
    assert {n: (m.kind, m.in_features) for n, m in loaded.items()} == \
        {n: (m.kind, m.in_features) for n, m in found.items()}
    assert all(torch.equal(loaded[n].blocks, found[n].blocks) for n in found)
    assert packed.load(tmp_path / "missing.safetensors") == {}


def test_pulled_model_decodes_identically_with_and_without_blocks():
    from agentrt.engine import models
    from agentrt.engine.llama import SequenceCache, Transformer

    path = models.ensure("smollm2-135m", "bf16")
    model = Transformer.from_pretrained(path, "bf16", "cpu", max_seq_len=128)
    if model.ops is None:
        pytest.skip("no AVX2 / C compiler here: blocks are only read by the CPU kernel")
    blocks = packed.load(path / packed.PACKED_FILE)
    assert blocks, "models pull writes the GGUF blocks next to the bf16 weights"
    assert model.packed_head is not None
    assert all(len(layer.packed) == 4 for layer in model.layers)

    ids = torch.randint(0, model.vocab_size, (1, 24), generator=torch.Generator().manual_seed(6))

    def run() -> torch.Tensor:  # a prefill, single steps, and 2- and 3-token verify steps
        cache = SequenceCache(model)
        with torch.inference_mode():
            return torch.cat([cache(ids[:, :16], 0), *[cache(ids[:, i:i + 1], i) for i in (16, 17, 18)],
                              cache(ids[:, 19:21], 19), cache(ids[:, 21:24], 21)], dim=1)

    with_blocks = run()
    for layer in model.layers:
        layer.packed = {}
    model.packed_head = None
    assert torch.equal(with_blocks, run())
    # and the loader refuses blocks that do not reproduce the weights
    wrong = {name: PackedMatrix(m.kind, torch.roll(m.blocks, 1, dims=0), m.in_features)
             for name, m in blocks.items()}
    assert model.use_packed(wrong) == 0


def test_the_packed_rows_choice_picks_a_path_once_and_keeps_the_logits():
    """`choose_packed_rows` times the blocks against the dense copies and keeps its answer for
    the process; either answer decodes the same bits; int8 precision is left alone."""
    from agentrt.engine import llama, models
    from agentrt.engine.llama import SequenceCache, Transformer

    path = models.ensure("smollm2-135m", "bf16")
    model = Transformer.from_pretrained(path, "bf16", "cpu", max_seq_len=128)
    if model.ops is None:
        pytest.skip("no AVX2 / C compiler here: blocks are only read by the CPU kernel")
    ids = torch.randint(0, model.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))

    def steps() -> torch.Tensor:  # one-row steps and a 3-row one: where the choice applies
        cache = SequenceCache(model)
        with torch.inference_mode():
            cache(ids[:, :16], 0, "last")
            return torch.cat([cache(ids[:, 16:17], 16), cache(ids[:, 17:20], 17)], dim=1)

    outputs = {}
    for rows in (3, 0):
        model.packed_max_rows = rows
        outputs[rows] = steps()
    assert torch.equal(outputs[3], outputs[0])
    llama._PACKED_ROWS_CHOICE.clear()
    chosen = model.choose_packed_rows(context=1000, repeats=3)  # more than max_seq_len: cut to it
    assert chosen in (0, 3) and model.packed_max_rows == chosen and len(llama._PACKED_ROWS_CHOICE) == 1
    model.packed_max_rows = 3 - chosen
    assert model.choose_packed_rows() == chosen  # the kept answer, not a new measurement
    model.precision = "int8"
    model.packed_max_rows = 3
    assert model.choose_packed_rows() == 3


# ---- int8 activations against the blocks (`CpuOps.int8_linear`): not the float product, but
# an exact arithmetic of its own, rebuilt here step by step in torch (see csrc/int8_ops.c)

def quantize_reference(x: torch.Tensor):
    """Per block of 32: scale max|x| / 127, codes round-half-even(x * (1 / scale)), and
    scale * sum(codes), all in float32 as the kernel computes them."""
    rows, width = x.shape
    blocks = x.view(rows, width // 32, 32)
    d = blocks.abs().amax(-1) / torch.full((rows, width // 32), 127.0)
    inv = torch.where(d != 0, torch.ones_like(d) / d, torch.zeros_like(d))
    q = torch.round(blocks * inv[..., None])
    sx = d * q.sum(-1)
    return q.to(torch.int8).view(rows, width), d, sx


def int8_reference(x: torch.Tensor, matrix: PackedMatrix, residual=None) -> torch.Tensor:
    """The kernel's output, float step by float step (integer sums are exact)."""
    q, d, sx = quantize_reference(x)
    rows, nb = d.shape
    raw = matrix.blocks.view(matrix.out_features, nb, BLOCK_BYTES[matrix.kind]).long()
    dw = matrix.blocks.view(matrix.out_features, nb, -1)[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    if matrix.kind == "q4_1":
        mw = matrix.blocks.view(matrix.out_features, nb, -1)[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
        codes = torch.cat([raw[..., 4:] & 0x0F, raw[..., 4:] >> 4], dim=-1)
    else:
        codes = matrix.blocks.view(matrix.out_features, nb, -1)[..., 2:].contiguous().view(torch.int8).long()
    sums = (codes[None] * q.view(rows, 1, nb, 32).long()).sum(-1).float()   # [M, N, nb], exact
    acc = torch.zeros(rows, matrix.out_features)
    for b in range(nb):
        acc = acc + (dw[None, :, b] * d[:, None, b]) * sums[..., b]
        if matrix.kind == "q4_1":
            acc = acc + mw[None, :, b] * sx[:, None, b]
    return acc if residual is None else acc + residual


def _ops():
    from agentrt.engine.cpu_ops import cpu_ops

    ops = cpu_ops()
    if ops is None:
        pytest.skip("no AVX2 / C compiler here")
    return ops


def quantize_q8_rows(ops, x: torch.Tensor):
    """The C step of `CpuOps.int8_linear` that quantises ``x[M, K]`` (float32, K % 32 == 0):
    int8 codes ``[M, K]``, block scales and scaled block sums ``[M, K / 32]``."""
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    fn = ops.lib.quantize_q8_rows
    fn.argtypes, fn.restype = [ptr, i64, i64, ptr, ptr, ptr], None
    rows, width = x.shape
    q = torch.empty(rows, width, dtype=torch.int8)
    d, sx = torch.empty(rows, width // 32), torch.empty(rows, width // 32)
    fn(x.data_ptr(), rows, width, q.data_ptr(), d.data_ptr(), sx.data_ptr())
    return q, d, sx


def q8_blocks_linear(ops, q, d, sx, w) -> torch.Tensor:
    """The C step of `CpuOps.int8_linear` that multiplies codes from `quantize_q8_rows` with
    interleaved blocks ``w``."""
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    fn = ops.lib.q8_blocks_linear
    fn.argtypes, fn.restype = [ptr, ptr, ptr, ptr, i32, ptr, ptr, i64, i64, i64, i32], None
    y = torch.empty(q.shape[0], w.out_features)
    fn(q.data_ptr(), d.data_ptr(), sx.data_ptr(), w.blocks.data_ptr(), {"q4_1": 0, "q8_0": 1}[w.kind],
       y.data_ptr(), None, q.shape[0], w.out_features, w.in_features, torch.get_num_threads())
    return y


def test_quantized_activations_match_the_reference():
    ops = _ops()
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(5, 96, generator=gen) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 5.0])[:, None]
    x[1, 32:64] = 0.0                       # a block of zeros: scale 0, codes 0
    x[2, :32] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5, 1.5] + [0.25] * 26)  # ties to even
    q, d, sx = quantize_q8_rows(ops, x)
    want_q, want_d, want_sx = quantize_reference(x)
    assert torch.equal(q, want_q) and torch.equal(d, want_d) and torch.equal(sx, want_sx)
    assert q[2, :6].tolist() == [127, 2, -4, 0, 0, 2] and d[1, 1] == 0 and not q[1, 32:64].any()
    assert q.abs().max() <= 127


@pytest.fixture(params=["avx2", "vnni"])
def int8_isa(request):
    """The int8 group kernels in use for the test (AVX2, or AVX512-VNNI where the CPU has it),
    restored afterwards."""
    ops = _ops()
    before = ops.use_vnni()
    if ops.use_vnni(request.param == "vnni") != (request.param == "vnni"):
        pytest.skip("this CPU has no AVX512-VNNI")
    yield ops
    ops.use_vnni(before)


@pytest.mark.parametrize("kind,out_features,in_features", [
    ("q4_1", 40, 128), ("q8_0", 40, 128), ("q4_1", 21, 128), ("q4_1", 16, 1536), ("q8_0", 8, 576)])
def test_int8_kernel_matches_its_reference_bit_for_bit(kind, out_features, in_features, int8_isa):
    ops = int8_isa
    matrix = PackedMatrix(kind, random_blocks(kind, out_features, in_features, seed=9), in_features)
    fast = matrix.interleaved()
    assert fast.blocks.shape == (-(-out_features // 8), in_features // 32 * 8 * BLOCK_BYTES[kind])
    dense = matrix.dequantize()
    gen = torch.Generator().manual_seed(10)
    for rows in (1, 2, 3, 5, 7, 8, 9, 13, 32):
        x = torch.randn(rows, in_features, generator=gen)
        residual = torch.randn(rows, out_features, generator=gen)
        got = ops.int8_linear(x, fast)
        assert torch.equal(got, int8_reference(x, matrix))
        assert torch.equal(ops.int8_linear(x, fast, residual), int8_reference(x, matrix, residual))
        assert torch.equal(q8_blocks_linear(ops, *quantize_q8_rows(ops, x), fast), got)
        # each row alone gives the same result as in the batch
        assert torch.equal(ops.int8_linear(x[-1:].clone(), fast)[0], got[-1])
        # and int8 activations stay close to the float product
        exact = x @ dense.T
        assert (got - exact).abs().max() < 0.02 * exact.abs().max()


def test_int8_kernel_refuses_bad_shapes():
    ops = _ops()
    matrix = PackedMatrix("q4_1", random_blocks("q4_1", 4, 64), 64).interleaved()
    with pytest.raises(ValueError, match="float32 x"):
        ops.int8_linear(torch.zeros(2, 96), matrix)
    with pytest.raises(ValueError, match="float32 x"):
        ops.int8_linear(torch.zeros(2, 64, dtype=torch.float64), matrix)


def test_int8_precision_on_the_pulled_model():
    """precision="int8" on SmolLM2: every matrix and the head get interleaved blocks; a row's
    logits do not depend on the rows batched with it (so greedy speculative == greedy plain);
    the one-call step equals the one-call-per-op path; the logits stay close to exact
    ones on a real prompt; and switching back gives the exact logits again."""
    import json
    from pathlib import Path

    from agentrt.engine import models
    from agentrt.engine.llama import SeqRows, SequenceCache, Transformer
    from agentrt.engine.tokenizer import ChatTokenizer
    from per_op_forward import per_op_forward

    path = models.ensure("smollm2-135m", "bf16")
    model = Transformer.from_pretrained(path, "bf16", "cpu", max_seq_len=256, precision="int8")
    if model.ops is None:
        pytest.skip("no AVX2 / C compiler here: int8 precision needs the CPU kernels")
    assert model.precision == "int8" and model.int8_head is not None
    assert all(len(layer.int8) == 4 for layer in model.layers)
    with pytest.raises(ValueError, match="precision"):
        model.precision = "int4"

    prompt = json.loads((Path(__file__).resolve().parents[2] / "benchmarks" / "prompts" /
                         "agent_code.jsonl").read_text().splitlines()[0])
    ids = torch.tensor([ChatTokenizer(path).encode_chat(prompt["messages"])[:96]])

    def chunks(size: int, forward=None) -> torch.Tensor:
        cache = SequenceCache(model)
        with torch.inference_mode():
            if forward is None:
                return torch.cat([cache(ids[:, a:a + size], a) for a in range(0, 96, size)], dim=1)
            return torch.cat([forward(model, ids[0, a:a + size], [SeqRows(a, size, cache.tables[0])],
                                      cache.pool) for a in range(0, 96, size)])[None]

    by_32 = chunks(32)
    assert torch.equal(chunks(8), by_32)                                 # 8-row steps
    cache = SequenceCache(model)
    with torch.inference_mode():
        cache(ids[:, :88], 0)
        singles = torch.cat([cache(ids[:, i:i + 1], i) for i in range(88, 96)], dim=1)
    assert torch.equal(singles, by_32[:, 88:])                           # single steps
    assert torch.equal(chunks(32, per_op_forward), by_32)                # one call per op

    model.precision = "exact"
    assert model.int8_head is None and not any(layer.int8 for layer in model.layers)
    exact = chunks(32)
    top1 = (exact.argmax(-1) == by_32.argmax(-1)).float().mean()
    log_p, log_q = exact.log_softmax(-1), by_32.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
    assert top1 >= 0.9 and kl < 0.02, (top1, kl)
    assert not torch.equal(exact, by_32)
