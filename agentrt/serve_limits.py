"""What ``agentrt serve`` accepts: its limits (`ServeLimits`), the refusal they raise
(`RequestError`, an OpenAI-style error body), what its connection guards counted
(`ConnectionCounts`), and the two checks that run before a body is
parsed: `read_body` (size and time, enforced while reading) and `check_json_depth` (nesting,
checked without recursion so that ``json`` never reaches a ``RecursionError``)."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from itertools import accumulate
from typing import Any

import anyio

from .errors import AgentrtError

MiB = 1024 * 1024


@dataclass(frozen=True)
class ServeLimits:
    """The bounds one server enforces (defaults in brackets)."""

    max_body_bytes: int = 4 * MiB
    """Largest request body [4 MiB]; a larger one is a 413, refused from its Content-Length or
    as soon as more arrives, never read whole."""
    max_messages: int = 1024
    """Most ``messages`` in one chat request [1024]; more is a 400."""
    max_json_depth: int = 64
    """Deepest nesting of arrays and objects in a body [64]; deeper is a 400."""
    max_requests: int = 64
    """Chat requests in progress at once, from reading the body to the end of the reply [64];
    one more is a 503 with ``Retry-After``."""
    retry_after_s: int = 1
    """The ``Retry-After`` of a 503 [1 s]."""
    max_connections: int = 512
    """Open HTTP connections [512]; at the cap a new connection closes the oldest one that is
    waiting for a request, or is refused with a 503 when every one is busy."""
    header_timeout_s: float = 5.0
    """Time from a connection's start (or its previous reply) to a request's complete headers
    [5 s]; slower, the connection is closed."""
    body_timeout_s: float = 30.0
    """Time to receive a request's whole body once its headers are in [30 s]; slower is a 408."""
    keep_alive_s: float = 5.0
    """How long an idle keep-alive connection stays open [5 s]."""
    write_timeout_s: float = 30.0
    """How long a reply may wait on a client that does not read it [30 s]; then it is closed."""
    max_header_bytes: int = 32 * 1024
    """Largest request line plus headers [32 KiB]; larger is a 400."""

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if not value > 0:
                raise ValueError(f"ServeLimits.{field.name} must be > 0, got {value!r}")


@dataclass
class ConnectionCounts:
    """What the guards did to connections (``/metrics`` under ``connections``)."""

    opened: int = 0
    header_timeouts: int = 0
    """Closed for not completing a request's headers within ``header_timeout_s``."""
    evicted: int = 0
    """Closed while waiting for a request, to make room for a new connection at the cap."""
    refused: int = 0
    """New connections answered 503 at the cap because every open one was busy."""
    write_timeouts: int = 0
    """Closed because the client did not read its reply for ``write_timeout_s``."""


class RequestError(AgentrtError):
    """A request this server refuses: becomes an HTTP error with an OpenAI-style body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error", *, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


CLOSE = {"Connection": "close"}
"""Headers of a refusal sent before the body was read: the client's connection is not reused."""


async def read_body(request: Any, limits: ServeLimits) -> bytes:
    """The body of a starlette ``request``, read chunk by chunk within the limits.

    A Content-Length over ``max_body_bytes`` is refused before any of the body is read; a body
    without one (chunked) is refused as soon as it passes the limit, so at most one chunk
    (64 KiB) beyond it is ever held. Raises `RequestError` (413, 408 or 400); a client gone
    mid-body raises starlette's ``ClientDisconnect``.
    """
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise RequestError(400, f"Content-Length is not a number: {declared[:40]!r}",
                               headers=CLOSE)
        if int(declared) > limit:
            raise RequestError(413, f"the body is {declared} bytes; this server accepts at most "
                                    f"{limit} bytes", code="request_too_large", headers=CLOSE)
    body = bytearray()
    try:
        with anyio.fail_after(limits.body_timeout_s):
            async with contextlib.aclosing(request.stream()) as chunks:
                async for chunk in chunks:
                    body += chunk
                    if len(body) > limit:
                        raise RequestError(413, f"the body is more than {limit} bytes; this "
                                                f"server accepts at most {limit} bytes",
                                           code="request_too_large", headers=CLOSE)
    except TimeoutError:
        raise RequestError(408, f"the body did not arrive within {limits.body_timeout_s:g} s "
                                f"({len(body)} bytes came)", code="request_timeout",
                           headers=CLOSE) from None
    return bytes(body)


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [0] * 256
for _open, _close in (b"[]", b"{}"):
    _STEP[_open], _STEP[_close] = 1, -1


def json_depth(raw: bytes, stop_above: int | None = None) -> int:
    """How deeply arrays and objects nest in the JSON text ``raw``: linear, no recursion.

    Strings are cut out first (a bracket inside one does not count); what remains is reduced to
    its brackets, and the depth is the highest running count of openers minus closers, counted
    64 Ki brackets at a time so that the scan stops as soon as it passes ``stop_above``. On text
    that is not JSON the answer is only an estimate; the parser then refuses it anyway.
    """
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    depth = peak = 0
    for start in range(0, len(brackets), _SCAN_CHUNK):
        running = list(accumulate(map(_STEP.__getitem__, brackets[start:start + _SCAN_CHUNK]),
                                  initial=depth))
        peak, depth = max(peak, max(running)), running[-1]
        if stop_above is not None and peak > stop_above:
            break
    return peak


_SCAN_CHUNK = 64 * 1024


def check_json_depth(raw: bytes, limit: int) -> None:
    """Raise a 400 `RequestError` if ``raw`` nests deeper than ``limit`` levels."""
    if raw.count(b"[") + raw.count(b"{") <= limit:  # cannot be deeper than it has openers
        return
    depth = json_depth(raw, stop_above=limit)
    if depth > limit:
        raise RequestError(400, f"the body nests JSON more than {limit} levels deep; this "
                                f"server accepts at most {limit}", code="too_deep")


__all__ = ["CLOSE", "ConnectionCounts", "MiB", "RequestError", "ServeLimits", "check_json_depth",
           "json_depth", "read_body"]
