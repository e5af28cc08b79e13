"""Size limits on tool-call arguments, checked before anything serialises, hashes or copies them.

A tool call's arguments travel to the runtime pickled, and the runtime then validates them and
builds a canonical key from them; both steps expand shared references (a list holding the same
1 MB string a thousand times becomes 1 GB). :func:`check_arguments` measures the arguments the way
that expansion would (:func:`~.protocol.plain_size`: shared references counted each time, in
time proportional to the distinct objects) and refuses a call whose arguments are too big or too
deeply nested. The sandbox checks before sending (a `ToolError` that names the limit, the same in
the shadow and in the real run); the runtime checks again on receipt, before anything else, since
a breached worker may skip the first check.

Sizes: a ``str`` counts one per character, ``bytes`` / ``bytearray`` one per byte, any other
value 8, and every container 8 plus its elements (each reference counted again). Types are
read with ``type()``, so a value the shadow has not resolved yet counts 8 and is never forced
(the authoritative run checks the resolved arguments).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentrt.tools.errors import ToolError

from .protocol import PlainDataTooLarge, plain_size

__all__ = ["MAX_ARG_BYTES", "MAX_ARG_DEPTH", "check_arguments"]

MAX_ARG_BYTES = 16_000_000
"""Total size of one call's arguments, shared references expanded."""
MAX_ARG_DEPTH = 64
"""How deeply containers may nest inside one call's arguments."""


def check_arguments(tool: str, args: tuple, kwargs: Mapping[str, Any], *,
                    max_bytes: int = MAX_ARG_BYTES, max_depth: int = MAX_ARG_DEPTH) -> int:
    """Return the arguments' expanded size; raise the sandbox's `ToolError` (what model code
    sees as ``ToolError``) past a limit."""
    try:
        size = plain_size(tuple(args), limit=max_bytes, max_depth=max_depth)
        return size + plain_size(dict(kwargs), limit=max_bytes - size, max_depth=max_depth)
    except PlainDataTooLarge as exc:
        if "nest" in str(exc):
            raise ToolError(f"{tool}(): arguments nest deeper than the limit of {max_depth} "
                            "levels") from None
        raise ToolError(f"{tool}(): arguments exceed the limit of {max_bytes:,} bytes (shared "
                        "references count each time they appear); pass smaller pieces") from None
