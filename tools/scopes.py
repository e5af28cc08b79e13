"""Effect scopes: what a tool reads and writes, so that speculation knows which calls may overtake
which.

A scope is a name the tool's author chooses (``"accounts"``, ``"notes"``). A speculatable tool
*reads* scopes (an undeclared one reads every scope; a pure one reads none); an effectful tool
*writes* scopes (an undeclared one writes every scope). A read may run early past an effectful
call only when their scopes are disjoint. Sets are plain ``frozenset[str]``; the reserved name
`EVERY_SCOPE` stands for all scopes at once.
"""

from __future__ import annotations

from collections.abc import Iterable

from .errors import ToolDefinitionError

EVERY_SCOPE = "*"
"""The scope name that overlaps every scope (what an undeclared tool reads or writes)."""
ALL_SCOPES: frozenset[str] = frozenset({EVERY_SCOPE})
"""Every scope: what an unannotated speculatable tool reads and an effectful one writes."""


def overlaps(a: frozenset[str], b: frozenset[str]) -> bool:
    """Whether scope sets ``a`` and ``b`` share a scope (`EVERY_SCOPE` shares every one)."""
    if not a or not b:
        return False
    return EVERY_SCOPE in a or EVERY_SCOPE in b or not a.isdisjoint(b)


def check_scopes(tool: str, option: str, scopes: Iterable[str]) -> frozenset[str]:
    """``scopes`` as a frozenset of scope names; `ToolDefinitionError` naming ``tool`` and
    ``option`` when it is not a collection of non-empty strings."""
    if isinstance(scopes, (str, bytes)) or not isinstance(scopes, Iterable):
        raise ToolDefinitionError(
            f"tool {tool!r}: {option}= takes a set of scope names, e.g. {option}={{'accounts'}}, "
            f"got {type(scopes).__name__} {scopes!r}")
    names = list(scopes)
    for name in names:
        if not isinstance(name, str) or not name.strip():
            raise ToolDefinitionError(
                f"tool {tool!r}: {option}= scope names must be non-empty strings, got {name!r}")
        if name == EVERY_SCOPE:
            raise ToolDefinitionError(
                f"tool {tool!r}: {option}= scope name {EVERY_SCOPE!r} is reserved (leave "
                f"{option}= out to mean every scope)")
    return frozenset(names)
