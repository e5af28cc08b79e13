"""EAGLE-3 draft heads with random weights, in the shared head-directory layout
(`agentrt.engine.eagle3_layout`), for a target model directory."""

from __future__ import annotations

from pathlib import Path

import torch

from agentrt.engine import eagle3_layout


def random_head(directory: Path, target_dir: str | Path, draft_vocab_size: int = 4096,
                seed: int = 0, dtype: str = "float32") -> Path:
    """Write a head for ``target_dir`` whose weights are seeded noise and whose draft vocabulary
    is ``draft_vocab_size`` target ids picked at random; returns the directory."""
    target = eagle3_layout.target_config(target_dir)
    config = eagle3_layout.head_config(target, draft_vocab_size=draft_vocab_size,
                                       target_name=Path(target_dir).parent.name,
                                       torch_dtype=dtype, recipe="random")
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in eagle3_layout.tensor_shapes(config).items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape)
        elif name not in ("d2t", "t2d"):
            tensors[name] = torch.randn(shape, generator=generator) * 0.02
    ids = torch.randperm(config["vocab_size"], generator=generator)[:draft_vocab_size].sort().values
    tensors["d2t"], tensors["t2d"] = eagle3_layout.vocab_maps(ids, config["vocab_size"])
    return eagle3_layout.write_head(directory, config, tensors)
