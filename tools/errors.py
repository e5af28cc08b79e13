"""Errors raised by tools, the `Tool` wrapper and the `ToolRegistry`.

Exceptions raised *by* a tool function itself are never wrapped: they reach the caller unchanged.
"""

from __future__ import annotations

from agentrt.errors import AgentrtError


class ToolError(AgentrtError):
    """Base class of every error the tool layer raises on its own account."""


class ToolDefinitionError(ToolError, ValueError):
    """A function can't be made into a tool (``*args``, a bad name, a bad limit, a duplicate name...)."""


class ToolArgumentError(ToolError, TypeError):
    """A call passed arguments the tool's signature rejects.

    It is a `TypeError` because that is what Python raises for a bad call, so model-written code
    sees the familiar error. ``problems`` lists ``(argument or None, message)`` pairs; the message
    reads like ``search(): argument 'k': Input should be a valid integer (got 'ten')``.
    """

    def __init__(self, tool: str, problems: list[tuple[str | None, str]]) -> None:
        self.tool = tool
        self.problems = list(problems)
        parts = [f"argument {arg!r}: {msg}" if arg else msg for arg, msg in self.problems]
        super().__init__(f"{tool}(): " + "; ".join(parts))

    def __reduce__(self):
        return (type(self), (self.tool, self.problems))


class ToolTimeoutError(ToolError, TimeoutError):
    """A tool call ran past the tool's ``timeout``."""

    def __init__(self, tool: str, timeout: float) -> None:
        self.tool = tool
        self.timeout = timeout
        super().__init__(f"{tool}() timed out after {timeout:g} s")

    def __reduce__(self):
        return (type(self), (self.tool, self.timeout))


class ToolCancelledError(ToolError, RuntimeError):
    """A tool raised ``CancelledError`` although nothing cancelled its call, or ``SystemExit``.

    The runtime keeps such an exception from cancelling or ending anything else: it is that
    call's error (a `RuntimeError` in the sandbox).
    """

    def __init__(self, tool: str, raised: BaseException | str) -> None:
        self.tool = tool
        self.raised = raised if isinstance(raised, str) else _describe(raised)
        why = ("although nothing cancelled the call (did it await a task that was cancelled?)"
               if self.raised.startswith("CancelledError") else "(a tool may not end the process)")
        super().__init__(f"{tool}() raised {self.raised} {why}")

    def __reduce__(self):
        return (type(self), (self.tool, self.raised))


def _describe(exc: BaseException) -> str:
    return repr(exc) if exc.args else type(exc).__name__


class UnknownToolError(ToolError, LookupError):
    """A registry was asked for a tool name it doesn't hold."""

    def __init__(self, name: str, known: list[str]) -> None:
        self.name = name
        self.known = list(known)
        listing = ", ".join(self.known) if self.known else "(none)"
        super().__init__(f"no tool named {name!r}; known tools: {listing}")

    def __reduce__(self):
        return (type(self), (self.name, self.known))


class UnkeyableArgumentsError(ToolError, TypeError):
    """`Tool.call_key` met an argument value that has no canonical (JSON) form."""
