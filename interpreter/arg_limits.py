"""Size limits on tool-call arguments, checked in the sandbox before anything is serialised.

A tool call's arguments travel to the runtime pickled, and the runtime then validates them and
builds a canonical key from them; both steps expand shared references (a list holding the same
1 MB string a thousand times becomes 1 GB). :func:`check_arguments` walks the arguments the way
that expansion would, without copying anything, and refuses a call whose arguments are too big or
too deeply nested with a `ToolError` that names the limit. The walk stops as soon as a limit is
passed, so checking a huge argument costs no more than the limit itself.

Sizes: a ``str`` counts one per character, ``bytes`` / ``bytearray`` one per byte, any other
value 8, and every container 8 plus its elements (each reference counted again). Types are
read with ``type()``, so a value the shadow has not resolved yet counts 8 and is never forced
(the authoritative run checks the resolved arguments).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .sandbox import ToolError

__all__ = ["MAX_ARG_BYTES", "MAX_ARG_DEPTH", "check_arguments"]

MAX_ARG_BYTES = 16_000_000
"""Total size of one call's arguments, shared references expanded."""
MAX_ARG_DEPTH = 64
"""How deeply containers may nest inside one call's arguments."""

_SCALAR_SIZE = 8


def check_arguments(tool: str, args: tuple, kwargs: Mapping[str, Any], *,
                    max_bytes: int = MAX_ARG_BYTES, max_depth: int = MAX_ARG_DEPTH) -> int:
    """Return the arguments' expanded size; raise the sandbox's `ToolError` (what model code
    sees as ``ToolError``) past a limit."""
    total = 0
    stack: list[tuple[Any, int]] = [(tuple(args), 0), (dict(kwargs), 0)]
    while stack:
        value, depth = stack.pop()
        kind = type(value)  # the real type: a value not yet known (the shadow's) is not forced
        if issubclass(kind, (str, bytes, bytearray)):
            total += len(value)
        elif issubclass(kind, (list, tuple, set, frozenset, dict)):
            if depth >= max_depth:
                raise ToolError(
                    f"{tool}(): arguments nest deeper than the limit of {max_depth} levels")
            total += _SCALAR_SIZE
            items = value.items() if issubclass(kind, dict) else value
            for item in items:
                stack.append((item, depth + 1))
        else:
            total += _SCALAR_SIZE
        if total > max_bytes:
            raise ToolError(
                f"{tool}(): arguments exceed the limit of {max_bytes:,} bytes (shared "
                "references count each time they appear); pass smaller pieces")
    return total
