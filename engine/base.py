"""The `Engine` protocol every backend satisfies, and the small types it speaks.

An engine turns a chat (a list of ``{"role": ..., "content": ...}`` messages) into an async
stream of `Delta` objects. The last delta of a stream carries ``finish_reason``, ``usage`` and,
where the backend has them, speculative-decoding ``metrics``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from .metrics import SpecMetrics

Message = dict[str, str]
"""One chat message: ``{"role": "system" | "user" | "assistant", "content": str}``."""


class EngineError(RuntimeError):
    """A backend failed to produce a generation (bad model, server error, ...)."""


class EngineStreamError(EngineError):
    """A generation stream died part-way through."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one generation. ``temperature == 0`` means greedy."""

    max_tokens: int = 1024
    temperature: float = 0.0
    top_k: int = 0
    """0 disables top-k."""
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Generation ends when any of these strings appears; the stop string is not emitted."""
    priority: int = 0
    """Scheduling priority where the backend batches requests: lower values are served first
    (the native engine's policy is in docs/engine.md); backends without one ignore it."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        object.__setattr__(self, "stop", tuple(self.stop))


@dataclass
class Usage:
    """Token counts of one generation."""

    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Delta:
    """A piece of streamed output. Only the final delta has ``finish_reason`` set."""

    text: str
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    """``"stop"`` (end of sequence or stop string), ``"length"`` (max_tokens), or ``None``."""
    usage: Usage | None = None
    metrics: SpecMetrics | None = None


@dataclass
class Completion:
    """A whole generation, as collected by `complete`."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    metrics: SpecMetrics | None = None


@runtime_checkable
class Engine(Protocol):
    """What the runtime needs from a model backend."""

    name: str

    def stream(
        self, messages: Sequence[Message], params: SamplingParams | None = None
    ) -> AsyncIterator[Delta]:
        """Stream the assistant's reply to ``messages`` as text deltas."""
        ...

    def remember(self, text: str) -> None:
        """Offer text the model is likely to repeat (earlier code cells) to the drafter."""
        ...

    async def aclose(self) -> None:
        """Release the backend's resources."""
        ...


class BaseEngine:
    """Convenience base with no-op defaults for the optional parts of `Engine`."""

    name: str = "engine"

    def stream(
        self, messages: Sequence[Message], params: SamplingParams | None = None
    ) -> AsyncIterator[Delta]:  # pragma: no cover - abstract
        raise NotImplementedError

    def remember(self, text: str) -> None:
        return None

    def metrics(self) -> SpecMetrics | None:
        """Speculative-decoding metrics aggregated over the engine's life, if it has them."""
        return None

    async def aclose(self) -> None:
        return None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


async def complete(
    engine: Engine, messages: Sequence[Message], params: SamplingParams | None = None
) -> Completion:
    """Run one generation to the end and collect it."""
    parts: list[str] = []
    out = Completion(text="")
    async for delta in engine.stream(messages, params):
        parts.append(delta.text)
        out.token_ids.extend(delta.token_ids)
        if delta.finish_reason is not None:
            out.finish_reason = delta.finish_reason
        if delta.usage is not None:
            out.usage = delta.usage
        if delta.metrics is not None:
            out.metrics = delta.metrics
    out.text = "".join(parts)
    return out
