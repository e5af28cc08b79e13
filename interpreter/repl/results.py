"""What the REPL hands back: cell results, final answers, variable summaries, errors.

Also the decoding of a worker's ``reply`` frames into these types.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from agentrt.errors import AgentrtError

from ..frames import Reply


@dataclasses.dataclass(frozen=True)
class FinalAnswer:
    """An answer recorded by ``FINAL(answer)`` or ``FINAL_VAR("name")``.

    ``value`` is plain data, or the value's repr string when ``is_repr`` is true (it was
    not plain data). ``variable`` names the variable for FINAL_VAR.
    """

    value: Any
    is_repr: bool = False
    variable: str | None = None


@dataclasses.dataclass
class CellResult:
    """The outcome of one cell.

    ``error`` is ``"ExcType: message"`` followed by a short traceback of the cell's own
    lines; ``killed`` is true when a sandbox process died or was stopped (limits, crash).
    """

    stdout: str
    error: str | None
    error_type: str | None
    final: FinalAnswer | None
    duration_s: float
    killed: bool = False

    @property
    def ok(self) -> bool:
        """True when the cell ran without error."""
        return self.error is None


@dataclasses.dataclass(frozen=True)
class VariableSummary:
    """Type name and short repr (memory addresses removed) of one sandbox variable."""

    type_name: str
    repr: str


class ReplError(AgentrtError, RuntimeError):
    """The REPL could not do what was asked (failed start, unresponsive worker...)."""


class ReplProcessDied(ReplError):
    """The sandbox process behind a handle is no longer running."""


def reply_value(reply: Reply) -> Any:
    """The value of a command's reply, or its error raised as the matching exception."""
    if reply.ok:
        return reply.value
    error_type, message = str(reply.error_type), reply.message
    if error_type == "KeyError":
        raise KeyError(message)
    if error_type in ("TypeError", "NotPlainDataError"):
        raise TypeError(message)
    if error_type == "ValueError":
        raise ValueError(message)
    raise ReplError(f"{error_type}: {message}")


def cell_result(reply: Reply, duration: float) -> CellResult:
    """A cell's reply frame as a :class:`CellResult` (malformed parts become an error)."""
    if not reply.ok:
        error_type = reply.error_type or "RuntimeError"
        return CellResult("", f"{error_type}: {reply.message}", error_type, None, duration)
    value = reply.value
    if not isinstance(value, dict):
        return CellResult("", "RuntimeError: malformed cell result", "RuntimeError", None, duration)
    error, error_type = value.get("error"), value.get("error_type")
    final, raw_final = None, value.get("final")
    if isinstance(raw_final, dict):
        variable = raw_final.get("variable")
        final = FinalAnswer(raw_final.get("value"), bool(raw_final.get("is_repr")),
                            variable if isinstance(variable, str) else None)
    return CellResult(
        stdout=value.get("stdout") if isinstance(value.get("stdout"), str) else "",
        error=error if isinstance(error, str) else None,
        error_type=error_type if isinstance(error_type, str) else None,
        final=final,
        duration_s=duration,
    )
