"""One helper for running a tool with its trace events and its count."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from agentrt.tools import ToolError, ToolRegistry

from .results import RunStats
from .trace import Trace


async def traced_call(registry: ToolRegistry, trace: Trace, stats: RunStats, name: str,
                      args: Sequence[Any], kwargs: Mapping[str, Any], *, call_id: int,
                      mode: str, **where: Any) -> Any:
    """Run tool ``name``; emit ``tool_started`` / ``tool_finished`` and count the invocation.

    ``mode`` is ``"sync"`` (the authoritative run) or ``"early"`` (a speculative launch);
    ``where`` adds fields to ``tool_started`` (turn, block, lineno). The tool's exception, if
    any, is re-raised after ``tool_finished`` records it (as a `ToolError` when the exception
    cannot even be turned into text).
    """
    stats.tool_calls[name] += 1
    trace.emit("tool_started", call_id=call_id, tool=name, mode=mode, **where)
    try:
        result = await registry.call(name, args, kwargs)
    except BaseException as exc:
        try:
            error = f"{type(exc).__name__}: {exc}"
        except Exception as unprintable:
            error = f"{type(exc).__name__} (its str() raised {type(unprintable).__name__})"
            trace.emit("tool_finished", call_id=call_id, tool=name, mode=mode, error=error)
            raise ToolError(f"{name}() raised {error}") from exc
        trace.emit("tool_finished", call_id=call_id, tool=name, mode=mode, error=error)
        raise
    trace.emit("tool_finished", call_id=call_id, tool=name, mode=mode, error=None)
    return result


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8", "backslashreplace")).hexdigest()[:16]


def call_digests(registry: ToolRegistry, name: str, args: Sequence[Any],
                 kwargs: Mapping[str, Any], *, value: Any = None,
                 error: BaseException | None = None) -> dict[str, Any]:
    """Fields of a ``program_call`` event: the tool, digests of its arguments (the tool's
    canonical call key where it has one) and of its result, or the error it raised."""
    try:
        key = registry.get(name).call_key(args, kwargs)
    except Exception:
        key = repr((name, tuple(args), dict(kwargs)))
    return {"tool": name, "args": _digest(key),
            "result": None if error is not None else _digest(repr(value)),
            "error": None if error is None else f"{type(error).__name__}: {error}"}
