"""`NativeConfig`: every option of the native engine, grouped by concern and checked when built.

The groups: `TargetOptions` (the model that runs), `DraftingOptions` (who drafts and how much),
`KVCacheOptions` (the paged cache and its prefix index) and `SchedulingOptions` (what one step
runs). `NativeConfig` takes each option by its own (flat) name, ``NativeConfig(drafter=None,
block_size=16)``, or a whole group, ``NativeConfig(drafting=DraftingOptions(drafter=None))``, and
reads it either way (``config.drafter`` is ``config.drafting.drafter``).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the config stays importable without torch
    from .drafters.base import Drafter
    from .llama import Transformer

DRAFTERS = ("suffix", "ngram", "draft", "eagle", "hybrid", "twin", "hybrid-twin")
"""The drafters `DraftingOptions.drafter` names: suffix automaton, n-gram prompt lookup, a draft
model (`DraftingOptions.draft_model`), a learned draft head (`DraftingOptions.draft_head`),
``hybrid`` (per step the suffix lookup or the head, whichever is expected to pay more), and
``twin`` (the target itself in int8 precision, drafting in the request's own KV blocks; exact
precision, GGUF blocks and the CPU kernels needed) and ``hybrid-twin`` (the suffix lookup or
the twin)."""

DTYPES = ("bf16", "fp16", "fp32")
PRECISIONS = ("exact", "int8", "bf16")
"""``exact``: the checkpoint's weights in float32 arithmetic (bit-identical with or without GGUF
blocks); ``int8``: matrices kept in GGUF blocks multiply int8-quantised activations
(`CpuOps.int8_linear`, llama.cpp's arithmetic class), faster and close but not identical;
``bf16``: steps of many rows (prefill chunks, large batches) multiply bfloat16-rounded
activations on AVX512-BF16 (`CpuOps.bf16_dot_linear`), fewer rows exactly: faster prefill, close
but not identical."""

_RENAMED = {"speculation": "drafter", "num_speculative_tokens": "draft_tokens",
            "max_speculative_tokens": "max_draft_tokens"}
"""Former option names, for the error that names their replacement."""


def _positive_ints(options: object, *names: str) -> None:
    """A `ValueError` naming the first of ``names`` that is not an int >= 1."""
    for name in names:
        value = getattr(options, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


@dataclass(frozen=True)
class TargetOptions:
    """The model that runs: its weights, arithmetic, device and context."""

    dtype: str = "bf16"
    """Weight dtype: ``"bf16"``, ``"fp16"`` or ``"fp32"`` (bf16 on CPU runs the compiled
    kernels; fp32 runs torch ops)."""
    device: str = "cpu"
    """``"cpu"`` or a CUDA device."""
    precision: str = "exact"
    """``"exact"`` (the checkpoint's arithmetic, bit-identical on every path), ``"int8"``
    (GGUF-block weights times int8-quantised activations on the CPU kernels: faster, logits
    close to but not equal to exact) or ``"bf16"`` (steps of 64 rows or more, i.e. prefill
    chunks and large batches, with bf16 activations on AVX512-BF16; exact elsewhere and on CPUs
    without it). Greedy drafted == greedy plain holds whatever the batch in exact and int8; in
    bf16 for one request at a time only, since a step's size decides its arithmetic."""
    max_seq_len: int = 4096
    """The longest sequence (prompt + output) one request may reach."""
    threads: int | None = None
    """Torch CPU threads (None: torch's setting)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        _positive_ints(self, "max_seq_len")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be None or an int >= 1, got {self.threads!r}")


@dataclass(frozen=True)
class DraftingOptions:
    """Who drafts tokens for the target to verify, how many, and how strictly they are checked."""

    drafter: str | Drafter | None = "suffix"
    """One of `DRAFTERS`, a `Drafter` instance, or None (plain decoding)."""
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

    def __post_init__(self) -> None:
        if isinstance(self.drafter, str) and self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, a Drafter or None, "
                             f"got {self.drafter!r}")
        if self.draft_tokens != "auto" and (isinstance(self.draft_tokens, bool) or not isinstance(
                self.draft_tokens, int) or self.draft_tokens < 0):
            raise ValueError(f"draft_tokens must be 'auto' or an int >= 0, got {self.draft_tokens!r}")
        _positive_ints(self, "max_draft_tokens")
        if not 0.0 < self.acceptance_threshold <= 1.0:
            raise ValueError(f"acceptance_threshold must be in (0, 1], got {self.acceptance_threshold}")

    @property
    def fixed_k(self) -> int | None:
        """The fixed draft length (None: adaptive k)."""
        return None if self.draft_tokens == "auto" else self.draft_tokens

    @property
    def max_k(self) -> int:
        """The most tokens one step drafts for one request (at least 1)."""
        return max(1, self.fixed_k or self.max_draft_tokens)


@dataclass(frozen=True)
class KVCacheOptions:
    """The paged KV cache: its budget, its block size and the prefix index over it."""

    kv_cache_bytes: int = 512 * 2**20
    """The KV cache budget (512 MiB hold ~23k tokens of SmolLM2-135M in float16); requests wait
    when it is full, and one that could never fit is refused."""
    block_size: int = 64
    """Positions per KV block (the prefix cache shares whole blocks and copies the last partial
    one)."""
    prefix_cache: bool = True
    """Reuse cached keys/values of prompt prefixes seen before (any request's)."""

    def __post_init__(self) -> None:
        _positive_ints(self, "kv_cache_bytes", "block_size")


@dataclass(frozen=True)
class SchedulingOptions:
    """What one step runs: how many requests, how many token rows, and who goes first."""

    max_num_seqs: int = 64
    """The most requests running at once; more wait."""
    max_batch_tokens: int = 512
    """The most token rows one step runs (decode rows, drafts, prefill chunks)."""
    step_token_budget: int | None = 64
    """The most rows a step runs while requests decode: every decoding request's last token,
    then drafts and prompt chunks within what is left (a step without decode rows runs up to
    ``max_batch_tokens``). It bounds the time between tokens of running requests while new
    prompts prefill; None: no bound but ``max_batch_tokens`` (docs/engine.md, "Decoding under
    bursts")."""
    prefill_chunk: int = 512
    """The most prompt tokens one request feeds in one step."""
    priority_share: float = 0.7
    """While a more urgent request (lower ``priority``) decodes, less urgent ones take part in
    only some steps, so that the urgent stream keeps at least this share of the decode rate it
    has alone (see docs/engine.md, "Priority")."""
    background_prefill_tokens: int = 64
    """The most prompt tokens less urgent requests prefill in one of those shared steps (bounds
    the pause they cause in the urgent stream)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.priority_share <= 1.0:
            raise ValueError(f"priority_share must be in (0, 1], got {self.priority_share}")
        _positive_ints(self, "max_num_seqs", "max_batch_tokens", "prefill_chunk",
                       "background_prefill_tokens")
        if self.step_token_budget is not None:
            _positive_ints(self, "step_token_budget")


GROUPS: dict[str, type] = {"target": TargetOptions, "drafting": DraftingOptions,
                           "kv_cache": KVCacheOptions, "scheduling": SchedulingOptions}
"""`NativeConfig`'s groups by attribute name."""

OPTIONS: dict[str, str] = {f.name: group for group, cls in GROUPS.items()
                           for f in dataclasses.fields(cls)}
"""Every flat option name, with the group that holds it (``seed`` is `NativeConfig`'s own)."""


@dataclass(frozen=True, init=False)
class NativeConfig:
    """How a `NativeEngine` runs (see the module docstring); every option is checked when the
    config is built (a `ValueError` names it), an unknown name is a `TypeError`."""

    target: TargetOptions
    drafting: DraftingOptions
    kv_cache: KVCacheOptions
    scheduling: SchedulingOptions
    seed: int | None
    """Seeds requests whose params have no seed (a seeded engine is reproducible)."""

    def __init__(self, *, target: TargetOptions | None = None,
                 drafting: DraftingOptions | None = None, kv_cache: KVCacheOptions | None = None,
                 scheduling: SchedulingOptions | None = None, seed: int | None = None,
                 **options: Any) -> None:
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            hints = "".join(f"; {old!r} is now {_RENAMED[old]!r}" for old in unknown if old in _RENAMED)
            raise TypeError(f"NativeConfig has no option {unknown}{hints}; "
                            f"choose from {sorted(self.options())}")
        given = {"target": target, "drafting": drafting, "kv_cache": kv_cache,
                 "scheduling": scheduling}
        for name, cls in GROUPS.items():
            mine = {key: value for key, value in options.items() if OPTIONS[key] == name}
            group = given[name] if given[name] is not None else cls()
            object.__setattr__(self, name, dataclasses.replace(group, **mine) if mine else group)
        object.__setattr__(self, "seed", seed)

    def __getattr__(self, name: str) -> Any:
        """A flat option name reads through to its group (``config.block_size``)."""
        group = OPTIONS.get(name)
        if group is None:
            raise AttributeError(f"NativeConfig has no attribute {name!r}")
        return getattr(getattr(self, group), name)

    @staticmethod
    def options() -> tuple[str, ...]:
        """Every option's flat name (the keywords `NativeConfig` and `NativeEngine` take)."""
        return (*OPTIONS, "seed")

    def replace(self, **overrides: Any) -> NativeConfig:
        """This config with ``overrides`` (flat option names, or whole groups) changed; an
        unknown name is a `TypeError` that lists the options (and names the new one for a
        renamed option)."""
        current = {name: getattr(self, name) for name in (*GROUPS, "seed")}
        return NativeConfig(**(current | overrides))
