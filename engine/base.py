"""The `Engine` protocol every backend satisfies, and the small types it speaks.

An engine turns a chat (a list of ``{"role": ..., "content": ...}`` messages) into an async
stream of `Delta` objects. The last delta of a stream carries ``finish_reason``, ``usage`` and,
where the backend has them, decoding ``metrics`` (`DecodeMetrics`: drafts, acceptance, timings).
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from agentrt.errors import AgentrtError

from .metrics import DecodeMetrics

Message = dict[str, str]
"""One chat message: ``{"role": "system" | "user" | "assistant", "content": str}``."""


class EngineError(AgentrtError, RuntimeError):
    """A backend failed to produce a generation (bad model, server error, ...)."""


class EngineStreamError(EngineError):
    """A generation stream died part-way through."""


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one generation. ``temperature == 0`` means greedy.

    Every field is checked when the object is built: a wrong type, a value out of range or a
    non-finite float is a `ValueError` naming the field.
    """

    max_tokens: int = 1024
    temperature: float = 0.0
    top_k: int = 0
    """0 disables top-k."""
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Generation ends when any of these strings appears; the stop string is not emitted (one
    string may be given alone)."""
    priority: int = 0
    """Scheduling priority where the backend batches requests: lower values are served first
    (the native engine's policy is in docs/engine.md); backends without one ignore it."""

    def __post_init__(self) -> None:
        for name in ("max_tokens", "top_k", "priority"):
            _require_int(name, getattr(self, name))
        if self.seed is not None:
            _require_int("seed", self.seed)
            if not -2**63 <= self.seed < 2**64:
                raise ValueError(f"SamplingParams.seed must fit in 64 bits, got {self.seed}")
        for name in ("temperature", "top_p"):
            _require_finite(name, getattr(self, name))
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        try:
            stop = tuple(stop)
        except TypeError:
            raise ValueError(f"SamplingParams.stop must be a string or a sequence of strings, "
                             f"got {type(self.stop).__name__}") from None
        if not all(isinstance(s, str) for s in stop):
            raise ValueError(f"SamplingParams.stop must hold strings only, got {stop!r:.200}")
        object.__setattr__(self, "stop", stop)


def _require_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"SamplingParams.{name} must be an int, got {value!r:.100} "
                         f"({type(value).__name__})")


def _require_finite(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"SamplingParams.{name} must be a finite number, got {value!r:.100}")


CHAT_ROLES = frozenset({"system", "user", "assistant"})


def check_messages(messages: object, roles: frozenset[str] = CHAT_ROLES) -> list[Message]:
    """``messages`` as a list of fresh ``{"role", "content"}`` dicts, or a `ValueError` naming
    the first message and field that is wrong (not a dict, an unknown role, content not text)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                         f"got {type(messages).__name__}")
    checked: list[Message] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got "
                             f"{type(message).__name__}: {message!r:.100}")
        role, content = message.get("role"), message.get("content")
        if role not in roles:
            raise ValueError(f"messages[{i}]['role'] must be one of {sorted(roles)}, "
                             f"got {role!r:.100}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}]['content'] must be a str, got "
                             f"{type(content).__name__}: {content!r:.100}")
        checked.append({"role": role, "content": content})
    return checked


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
    metrics: DecodeMetrics | None = None


@dataclass
class Completion:
    """A whole generation, as collected by `complete`."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    metrics: DecodeMetrics | None = None


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

    def metrics(self) -> DecodeMetrics | None:
        """Decoding metrics aggregated over the engine's life, if it has them."""
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
