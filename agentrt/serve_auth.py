"""Who may use ``agentrt serve``: the API key check (`ApiKeyGate`, an ASGI wrapper) and the
warning for a server that listens beyond loopback without one (`exposure_warning`)."""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import sys
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

log = logging.getLogger("agentrt.serve")

API_KEY_ENV = "AGENTRT_API_KEY"
"""The environment variable ``agentrt serve`` reads its API key from when ``--api-key`` is unset."""

OPEN_PATHS = frozenset({"/health"})
"""Paths served without a key (a load balancer's health check carries none)."""

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
                   Awaitable[None]]


class ApiKeyGate:
    """Wraps an ASGI app: every HTTP request but `OPEN_PATHS` needs ``Authorization: Bearer KEY``.

    The key is compared with `hmac.compare_digest` (time independent of where it differs). A
    request without the right key gets a 401 with an OpenAI-style error body before anything of
    its body is read, and its connection is closed. ``on_refused`` is called for each one.
    """

    def __init__(self, app: ASGIApp, api_key: str,
                 on_refused: Callable[[], None] = lambda: None) -> None:
        if not api_key:
            raise ValueError("the API key is empty")
        self.app = app
        self._expected = api_key.encode("utf-8")
        self._on_refused = on_refused

    def authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                scheme, _, token = bytes(value).partition(b" ")
                return (scheme.lower() == b"bearer"
                        and hmac.compare_digest(token.strip(), self._expected))
        return False

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if (scope["type"] != "http" or scope.get("path") in OPEN_PATHS
                or self.authorized(scope)):
            await self.app(scope, receive, send)
            return
        self._on_refused()
        body = json.dumps({"error": {
            "message": "missing or wrong API key: send the header 'Authorization: Bearer KEY' "
                       "with the key this server was started with",
            "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", b"Bearer"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) binds loopback only; names other than
    ``localhost`` count as not loopback, since they are not resolved here."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """Warn (logged, and printed to stderr) when ``host`` is not loopback and there is no key.

    Returns the warning, or None when there is nothing to warn about.
    """
    if api_key or is_loopback(host):
        return None
    message = (f"agentrt serve: WARNING: listening on {host!r}, which is not a loopback address, "
               f"without an API key: anyone who can reach this port can use the model. Pass "
               f"--api-key (or set {API_KEY_ENV}), or bind 127.0.0.1.")
    log.warning(message)
    print(message, file=sys.stderr, flush=True)
    return message


__all__ = ["API_KEY_ENV", "OPEN_PATHS", "ApiKeyGate", "exposure_warning", "is_loopback"]
