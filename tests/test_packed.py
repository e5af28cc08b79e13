"""GGUF blocks as weights (`agentrt.engine.packed`): the reference dequantisation against the
`gguf` package's, the CPU kernel against the bf16 kernel bit for bit, row matching on a real
GGUF file written here, and the pulled model decoding identically with and without blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from agentrt.engine import packed
from agentrt.engine.packed import BLOCK_BYTES, PackedMatrix

gguf = pytest.importorskip("gguf")


def random_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Valid random blocks: finite fp16 scales (and minimums), random codes."""
    gen = np.random.default_rng(seed)
    nb = cols // 32
    raw = gen.integers(0, 256, size=(rows, nb, BLOCK_BYTES[kind]), dtype=np.uint8)
    raw[..., 0:2] = gen.normal(0, 0.02, size=(rows, nb)).astype(np.float16)[..., None].view(np.uint8)
    if kind == "q4_1":
        raw[..., 2:4] = gen.normal(0, 0.1, size=(rows, nb)).astype(np.float16)[..., None].view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


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
    from agentrt.engine.llama import Transformer

    path = models.ensure("smollm2-135m", "bf16")
    model = Transformer.from_pretrained(path, "bf16", "cpu", max_seq_len=128)
    if model.ops is None:
        pytest.skip("no AVX2 / C compiler here: blocks are only read by the CPU kernel")
    blocks = packed.load(path / packed.PACKED_FILE)
    assert blocks, "models pull writes the GGUF blocks next to the bf16 weights"
    assert model.packed_head is not None
    assert all(len(w["packed"]) == 4 for w in model.layer_weights)

    ids = torch.randint(0, model.vocab_size, (1, 24), generator=torch.Generator().manual_seed(6))

    def run() -> torch.Tensor:  # a prefill, single steps, and 2- and 3-token verify steps
        with torch.inference_mode():
            return torch.cat([model(ids[:, :16], 0), *[model(ids[:, i:i + 1], i) for i in (16, 17, 18)],
                              model(ids[:, 19:21], 19), model(ids[:, 21:24], 21)], dim=1)

    with_blocks = run()
    for w in model.layer_weights:
        w["packed"] = None
    model.packed_head = None
    assert torch.equal(with_blocks, run())
    # and the loader refuses blocks that do not reproduce the weights
    wrong = {name: PackedMatrix(m.kind, torch.roll(m.blocks, 1, dims=0), m.in_features)
             for name, m in blocks.items()}
    assert model.use_packed(wrong) == 0
