"""Weights kept in their GGUF blocks, for checkpoints that were dequantised from a GGUF file.

SmolLM2's checkpoint comes from a Q4_1 GGUF (token embedding: Q8_0), so every weight of the
bf16 / fp32 directory is ``d * q + m`` (Q4_1) or ``d * q`` (Q8_0) of its block, in float32,
cast to the directory's dtype. Decoding one token on CPU streams every weight once, so the
speed is set by bytes per weight: 2 in bf16, 0.625 in Q4_1, 1.06 in Q8_0. `PackedMatrix` keeps
the blocks as they are; the CPU kernel (`CpuOps.packed_linear`) widens them to exactly the
checkpoint's values while it multiplies. Nothing is approximated: `Transformer` only uses the
blocks of a matrix after checking that they reproduce its dense weights bit for bit.

At pull time `from_gguf` matches each GGUF tensor to the checkpoint tensor it became (rows
can be permuted: llama.cpp stores q/k rows in another RoPE order) and `save` writes the blocks,
in the checkpoint's names and row order, next to the dense weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

BLOCK = 32
BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}
PACKED_FILE = Path("packed") / "gguf-blocks.safetensors"
"""Where `save` puts the blocks, relative to a model directory."""

# checkpoint (transformers Llama) name -> GGUF name, per layer
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@dataclass(frozen=True, eq=False)
class PackedMatrix:
    """A ``[out_features, in_features]`` matrix as rows of GGUF blocks (``blocks``: uint8
    ``[out_features, in_features // 32 * block bytes]``)."""

    kind: str
    blocks: Tensor
    in_features: int

    def __post_init__(self) -> None:
        if self.kind not in BLOCK_BYTES:
            raise ValueError(f"unsupported block kind {self.kind!r}; known: {sorted(BLOCK_BYTES)}")
        if self.in_features % BLOCK or self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2:
            raise ValueError("blocks must be uint8 [rows, in_features // 32 * block bytes]")
        if self.blocks.shape[1] != self.in_features // BLOCK * BLOCK_BYTES[self.kind]:
            raise ValueError(f"{self.blocks.shape[1]} bytes per row do not hold "
                             f"{self.in_features} {self.kind} weights")

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    def rows(self, index: Tensor | Sequence[int]) -> PackedMatrix:
        """The matrix made of rows ``index`` (a permutation or selection)."""
        return PackedMatrix(self.kind, self.blocks[torch.as_tensor(index)].contiguous(), self.in_features)

    def interleaved(self) -> "InterleavedMatrix":
        """The same blocks with 8 rows interleaved per block, as the int8 kernel reads them
        (`CpuOps.int8_linear`): for each group of 8 rows (the last one padded with zero blocks)
        and each block, the 8 fp16 scales (Q4_1: then the 8 fp16 minimums), then the codes in
        4-byte runs, row after row: Q4_1 bytes 4g..4g+3 of each row's nibbles for g = 0..3,
        Q8_0 codes 4g..4g+3 for g = 0..7."""
        nb, size = self.in_features // BLOCK, BLOCK_BYTES[self.kind]
        groups = -(-self.out_features // 8)
        raw = torch.zeros(groups * 8, nb, size, dtype=torch.uint8)
        raw[:self.out_features] = self.blocks.view(self.out_features, nb, size)
        raw = raw.view(groups, 8, nb, size).transpose(1, 2)          # [G, nb, 8 rows, size]
        heads = 4 if self.kind == "q4_1" else 2
        scales = raw[..., :heads].unflatten(-1, (-1, 2)).transpose(2, 3).flatten(2)
        codes = raw[..., heads:].unflatten(-1, (-1, 4)).transpose(2, 3).flatten(2)
        out = torch.cat([scales, codes], dim=-1).reshape(groups, -1).contiguous()
        return InterleavedMatrix(self.kind, out, self.in_features, self.out_features)

    def dequantize(self) -> Tensor:
        """The float32 weights, computed as the GGUF reference does (product, then sum)."""
        nb = self.in_features // BLOCK
        raw = self.blocks.view(self.out_features, nb, BLOCK_BYTES[self.kind])
        d = raw[..., 0:2].contiguous().view(torch.float16).float()
        if self.kind == "q8_0":
            q = raw[..., 2:].contiguous().view(torch.int8).float()
            return (d * q).reshape(self.out_features, self.in_features)
        m = raw[..., 2:4].contiguous().view(torch.float16).float()
        nibbles = raw[..., 4:]
        q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).float()
        return (d * q + m).reshape(self.out_features, self.in_features)


@dataclass(frozen=True, eq=False)
class InterleavedMatrix:
    """A `PackedMatrix` in the int8 kernel's layout (see `PackedMatrix.interleaved`):
    ``blocks`` is uint8 ``[ceil(out_features / 8), in_features // 32 * 8 * block bytes]``."""

    kind: str
    blocks: Tensor
    in_features: int
    out_features: int


def cat_rows(parts: Sequence[PackedMatrix]) -> PackedMatrix:
    """Stack matrices of the same kind and width along the rows (fused projections)."""
    kinds = {(p.kind, p.in_features) for p in parts}
    if len(kinds) != 1:
        raise ValueError(f"cannot stack matrices of different kinds/widths: {sorted(kinds)}")
    return PackedMatrix(parts[0].kind, torch.cat([p.blocks for p in parts]), parts[0].in_features)


def gguf_name(name: str) -> str | None:
    """The GGUF tensor name of a checkpoint weight (Llama naming), or None."""
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    parts = name.split(".")
    if len(parts) == 6 and parts[:2] == ["model", "layers"] and parts[-1] == "weight":
        short = _LAYER_NAMES.get(f"{parts[3]}.{parts[4]}")
        return None if short is None else f"blk.{parts[2]}.{short}.weight"
    return None


def from_gguf(gguf_path: str | Path, state: dict[str, Tensor]) -> dict[str, PackedMatrix]:
    """Blocks for every float32 checkpoint matrix in ``state`` that a Q4_1 / Q8_0 tensor of the
    GGUF file dequantises to exactly, in the checkpoint's row order (rows matched by content)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    packed: dict[str, PackedMatrix] = {}
    for name, dense in state.items():
        source = tensors.get(gguf_name(name) or "")
        kind = None if source is None else source.tensor_type.name.lower()
        if kind not in BLOCK_BYTES or dense.dim() != 2 or dense.dtype != torch.float32:
            continue
        blocks = torch.from_numpy(source.data.copy()).reshape(dense.shape[0], -1)
        matrix = PackedMatrix(kind, blocks, dense.shape[1])
        values = matrix.dequantize()
        if values.shape != dense.shape:
            continue
        if torch.equal(values, dense):
            packed[name] = matrix
        elif (order := _row_order(values, dense)) is not None:
            packed[name] = matrix.rows(order)
    return packed


def _row_order(values: Tensor, dense: Tensor) -> list[int] | None:
    """The row permutation that turns ``values`` into ``dense``, or None when there is none."""
    where = {row.numpy().tobytes(): i for i, row in enumerate(values)}
    order = [where.get(row.numpy().tobytes()) for row in dense]
    return None if None in order else order


def save(packed: dict[str, PackedMatrix], path: str | Path) -> None:
    """Write blocks as safetensors: ``<name>`` (uint8 blocks) + ``<name>.kind`` (the kind)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {name: m.blocks.contiguous() for name, m in packed.items()}
    meta = {name: f"{m.kind}:{m.in_features}" for name, m in packed.items()}
    save_file(tensors, str(path), metadata=meta)


def load(path: str | Path) -> dict[str, PackedMatrix]:
    """Read what `save` wrote (an empty dict when ``path`` does not exist)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        return {}
    out = {}
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        for name in f.keys():
            kind, width = meta[name].split(":")
            out[name] = PackedMatrix(kind, f.get_tensor(name), int(width))
    return out
