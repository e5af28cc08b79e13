"""`NativeConfig`: every option of the native engine, checked when it is built."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the config stays importable without torch
    from .drafters.base import Drafter
    from .llama import Transformer

DRAFTERS = ("suffix", "ngram", "draft", "eagle", "hybrid", "twin", "hybrid-twin")
"""The drafters `NativeConfig.drafter` names: suffix automaton, n-gram prompt lookup, a draft
model (`NativeConfig.draft_model`), a learned draft head (`NativeConfig.draft_head`),
``hybrid`` (per step the suffix lookup or the head, whichever is expected to pay more), and
``twin`` (the target itself in int8 precision, drafting in the request's own KV blocks; exact
precision, GGUF blocks and the CPU kernels needed) and ``hybrid-twin`` (the suffix lookup or
the twin)."""

DTYPES = ("bf16", "fp16", "fp32")
PRECISIONS = ("exact", "int8")
"""``exact``: the checkpoint's weights in float32 arithmetic (bit-identical with or without GGUF
blocks); ``int8``: matrices kept in GGUF blocks multiply int8-quantised activations
(`CpuOps.int8_linear`, llama.cpp's arithmetic class), faster and close but not identical."""

_RENAMED = {"speculation": "drafter", "num_speculative_tokens": "draft_tokens",
            "max_speculative_tokens": "max_draft_tokens"}
"""Former option names, for the error that names their replacement."""


@dataclass(frozen=True)
class NativeConfig:
    """How a `NativeEngine` runs; every field is checked when the config is built (a
    `ValueError` names the field)."""

    dtype: str = "bf16"
    """Weight dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (bf16 on CPU runs the compiled
    kernels; fp32 runs torch ops)."""
    device: str = "cpu"
    """``"cpu"`` or a CUDA device."""
    drafter: str | Drafter | None = "suffix"
    """Who drafts tokens for the target to verify: one of `DRAFTERS`, a `Drafter` instance, or
    None (plain decoding)."""
    draft_model: str | os.PathLike | Transformer | int | None = None
    """For ``drafter="draft"``: a model name or path, a `Transformer`, or an int n (a layer-skip
    drafter made of the target's first n layers; None means 4)."""
    draft_head: str | os.PathLike | None = None
    """For ``drafter="eagle"`` or ``"hybrid"``: the head's directory (None: the one ``agentrt
    draft train`` wrote for the model, ``<cache>/models/<model>/drafters/eagle``)."""
    draft_tokens: str | int = "auto"
    """Drafted tokens verified per step: ``"auto"`` (adaptive k, step costs measured at the first
    request) or a fixed k (0: no drafting)."""
    max_draft_tokens: int = 16
    """The largest k adaptive mode considers."""
    acceptance_threshold: float = 1.0
    """1.0 is exact; below 1.0 accepts more drafts, and is reported as ``lossy`` in the
    metrics."""
    max_seq_len: int = 4096
    """The longest sequence (prompt + output) one request may reach."""
    seed: int | None = None
    """Seeds requests whose params have no seed (a seeded engine is reproducible)."""
    threads: int | None = None
    """Torch CPU threads (None: torch's setting)."""
    prefix_cache: bool = True
    """Reuse cached keys/values of prompt prefixes seen before (any request's)."""
    prefill_chunk: int = 512
    """The most prompt tokens one request feeds in one step."""
    kv_cache_bytes: int = 512 * 2**20
    """The KV cache budget (512 MiB hold ~23k tokens of SmolLM2-135M in float16); requests wait
    when it is full, and one that could never fit is refused."""
    block_size: int = 64
    """Positions per KV block (the prefix cache shares whole blocks and copies the last partial
    one)."""
    max_batch_tokens: int = 512
    """The most token rows one step runs (decode rows, drafts, prefill chunks)."""
    max_num_seqs: int = 64
    """The most requests running at once; more wait."""
    priority_share: float = 0.7
    """While a more urgent request (lower ``priority``) decodes, less urgent ones take part in
    only some steps, so that the urgent stream keeps at least this share of the decode rate it
    has alone (see docs/engine.md, "Priority")."""
    background_prefill_tokens: int = 64
    """The most prompt tokens less urgent requests prefill in one of those shared steps (bounds
    the pause they cause in the urgent stream)."""
    precision: str = "exact"
    """``"exact"`` (the checkpoint's arithmetic, bit-identical on every path) or ``"int8"``
    (GGUF-block weights times int8-quantised activations on the CPU kernels: faster, logits
    close to but not equal to exact; greedy drafted == greedy plain holds in both)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if isinstance(self.drafter, str) and self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, a Drafter or None, "
                             f"got {self.drafter!r}")
        if self.draft_tokens != "auto" and (isinstance(self.draft_tokens, bool) or not isinstance(
                self.draft_tokens, int) or self.draft_tokens < 0):
            raise ValueError(f"draft_tokens must be 'auto' or an int >= 0, got {self.draft_tokens!r}")
        if not 0.0 < self.acceptance_threshold <= 1.0:
            raise ValueError(f"acceptance_threshold must be in (0, 1], got {self.acceptance_threshold}")
        if not 0.0 < self.priority_share <= 1.0:
            raise ValueError(f"priority_share must be in (0, 1], got {self.priority_share}")
        for name in ("max_draft_tokens", "max_seq_len", "prefill_chunk", "kv_cache_bytes",
                     "block_size", "max_batch_tokens", "max_num_seqs", "background_prefill_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be None or an int >= 1, got {self.threads!r}")

    def replace(self, **overrides: Any) -> NativeConfig:
        """This config with ``overrides`` (field names) changed; an unknown name is a
        `TypeError` that lists the fields (and names the new one for a renamed option)."""
        fields = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            hints = "".join(f"; {old!r} is now {_RENAMED[old]!r}" for old in unknown if old in _RENAMED)
            raise TypeError(f"NativeConfig has no option {unknown}{hints}; choose from {sorted(fields)}")
        return dataclasses.replace(self, **overrides)
