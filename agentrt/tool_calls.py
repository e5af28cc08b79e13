"""One helper for running a tool with its trace events and its count."""

from __future__ import annotations

import hashlib
import io
import pickle
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from agentrt.tools import ToolError, ToolRegistry

from .events import ProgramCall, ToolFinished, ToolStarted
from .results import RunStats
from .trace import Trace


async def traced_call(registry: ToolRegistry, trace: Trace, stats: RunStats, name: str,
                      args: Sequence[Any], kwargs: Mapping[str, Any], *, call_id: int,
                      mode: Literal["sync", "early"], turn: int | None = None,
                      block: int | None = None, lineno: int | None = None) -> Any:
    """Run tool ``name``; emit ``tool_started`` / ``tool_finished`` and count the invocation.

    ``mode`` is ``"sync"`` (the authoritative run) or ``"early"`` (a speculative launch);
    ``turn``, ``block`` and ``lineno`` say where the program made a sync call. The tool's
    exception, if any, is re-raised after ``tool_finished`` records it (as a `ToolError` when
    the exception cannot even be turned into text).
    """
    stats.tool_calls[name] += 1
    trace.emit(ToolStarted(call_id, name, mode, turn, block, lineno))
    try:
        result = await registry.call(name, args, kwargs)
    except BaseException as exc:
        try:
            error = f"{type(exc).__name__}: {exc}"
        except Exception as unprintable:
            error = f"{type(exc).__name__} (its str() raised {type(unprintable).__name__})"
            trace.emit(ToolFinished(call_id, name, mode, error))
            raise ToolError(f"{name}() raised {error}") from exc
        trace.emit(ToolFinished(call_id, name, mode, error))
        raise
    trace.emit(ToolFinished(call_id, name, mode, None))
    return result


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "backslashreplace")).hexdigest()[:16]


LARGE_VALUE_CHARS = 1 << 16
"""Strings and bytes at least this long are fed to a value's digest in chunks, not copied."""


class _HashSink(io.RawIOBase):
    """A file that hashes what is written to it."""

    def __init__(self, hashed: Any) -> None:
        self.hashed = hashed

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.hashed.update(data)
        return len(data)


class _DigestPickler(pickle.Pickler):
    """Pickles a value into a hash without a memo (equal values digest alike, whatever they
    share), feeding its large strings and bytes to a second hash one chunk at a time."""

    def __init__(self, sink: _HashSink, leaves: Any) -> None:
        super().__init__(sink, protocol=5)
        self.fast = True
        self._leaves = leaves

    def persistent_id(self, obj: Any) -> tuple[bool, int] | None:
        kind = type(obj)
        if (kind is str or kind is bytes) and len(obj) >= LARGE_VALUE_CHARS:
            self._leaves.update(b"s" if kind is str else b"b")
            for start in range(0, len(obj), LARGE_VALUE_CHARS):
                piece = obj[start:start + LARGE_VALUE_CHARS]
                self._leaves.update(piece.encode("utf-8", "surrogatepass") if kind is str
                                    else piece)
            return kind is str, len(obj)
        return None


def value_digest(value: Any) -> str:
    """A short digest of ``value``, equal for equal values, made without a serialised copy of
    its large strings and bytes (its repr's, for a value that cannot be pickled)."""
    try:
        pickled, leaves = hashlib.sha256(), hashlib.sha256()
        _DigestPickler(_HashSink(pickled), leaves).dump(value)
    except Exception:
        return _digest(repr(value))
    return hashlib.sha256(pickled.digest() + leaves.digest()).hexdigest()[:16]


def call_digests(registry: ToolRegistry, name: str, args: Sequence[Any],
                 kwargs: Mapping[str, Any], *, value: Any = None,
                 error: BaseException | None = None) -> ProgramCall:
    """The ``program_call`` event of a call: the tool, digests of its arguments (the tool's
    canonical call key where it has one) and of its result, or the error it raised."""
    try:
        key = registry.get(name).call_key(args, kwargs)
    except Exception:
        key = repr((name, tuple(args), dict(kwargs)))
    return ProgramCall(tool=name, args=_digest(key),
                       result=None if error is not None else value_digest(value),
                       error=None if error is None else f"{type(error).__name__}: {error}")
