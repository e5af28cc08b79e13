"""Connection-level guards for ``agentrt serve``: the deadlines and the cap that uvicorn lacks.

uvicorn (0.55, h11) closes a keep-alive connection that stays silent, and ``limit_concurrency``
answers 503 once too many connections are open — but it has no deadline for a request's
headers. A client that sends one header byte every few seconds (slowloris) keeps its connection
for ever, and a few hundred such clients then hold every slot that ``limit_concurrency`` counts.
`guarded_h11` returns uvicorn's own `H11Protocol` with three additions, all driven by timers on
the event loop and independent of the ASGI app:

- **header deadline**: from a connection's start, and again from the end of each reply, the
  client has ``header_timeout_s`` to complete the next request's headers, however it trickles
  them (the deadline is absolute, not reset by data); past it the connection is closed;
- **connection cap**: at ``max_connections`` open connections a new one closes the oldest
  connection that is waiting for a request (a slowloris or an idle keep-alive one); when every
  connection is busy with a request, the new one gets a 503 with ``Retry-After`` and is closed;
- **write deadline**: a reply that cannot be written because the client stopped reading (the
  transport's buffer stays full) for ``write_timeout_s`` closes the connection, which cancels
  the request.

The request body's own deadline (``body_timeout_s``) is the app's, in `read_body`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

from .serve_limits import ConnectionCounts, ServeLimits

log = logging.getLogger("agentrt.serve")


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline, a connection cap and a write deadline.

    Use a subclass from `guarded_h11`, which sets `limits` and `counts` for one server.
    """

    limits: ClassVar[ServeLimits] = ServeLimits()
    counts: ClassVar[ConnectionCounts] = ConnectionCounts()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.waiting_since: float | None = None
        """Loop time since which this connection has waited for a request's headers; None while
        it serves one."""
        self._cycle_waited_after: object = None
        self._header_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        super().connection_made(transport)  # type: ignore[arg-type]
        type(self).counts.opened += 1
        if not self._make_room():
            self._refuse()
            return
        self._wait_for_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        self._cancel_write_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout_s,
                                                     self._write_too_slow)

    def resume_writing(self) -> None:
        self._cancel_write_timer()
        super().resume_writing()

    # -- uvicorn hooks -------------------------------------------------------------------------

    def handle_events(self) -> None:
        super().handle_events()
        # uvicorn starts a new request cycle once a request's headers are complete
        if self.waiting_since is not None and self.cycle is not self._cycle_waited_after:
            self._cancel_header_timer()
            self.waiting_since = None

    def on_response_complete(self) -> None:
        self._wait_for_headers()  # before uvicorn parses a pipelined request, which ends the wait
        super().on_response_complete()

    # -- the guards ----------------------------------------------------------------------------

    def _wait_for_headers(self) -> None:
        self._cancel_header_timer()
        self.waiting_since = self.loop.time()
        self._cycle_waited_after = self.cycle
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s,
                                                  self._headers_too_slow)

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if self.waiting_since is not None and not self.transport.is_closing():
            type(self).counts.header_timeouts += 1
            log.debug("closing %s: no complete request headers within %g s", self.client,
                      self.limits.header_timeout_s)
            self.transport.close()

    def _write_too_slow(self) -> None:
        self._write_timer = None
        if not self.transport.is_closing():
            type(self).counts.write_timeouts += 1
            log.info("closing %s: the client read nothing of its reply for %g s", self.client,
                     self.limits.write_timeout_s)
            self.transport.abort()  # close() would wait for the unread buffer to drain

    def _make_room(self) -> bool:
        """At the cap, close the connection that has waited longest for a request; False if every
        other connection is busy with one."""
        if len(self.connections) <= self.limits.max_connections:  # includes this one
            return True
        live = [c for c in self.connections
                if c is not self and not c.transport.is_closing()]
        if len(live) < self.limits.max_connections:
            return True
        idle = [c for c in live if getattr(c, "waiting_since", None) is not None]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.waiting_since)
        type(self).counts.evicted += 1
        oldest._cancel_header_timer()
        oldest.transport.close()
        return True

    def _refuse(self) -> None:
        type(self).counts.refused += 1
        log.warning("refusing a connection from %s: %d connections are open and busy",
                    self.client, self.limits.max_connections)
        body = json.dumps({"error": {
            "message": f"the server has {self.limits.max_connections} connections busy; "
                       "retry later", "type": "server_error", "param": None,
            "code": "too_many_connections"}}).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nretry-after: {self.limits.retry_after_s}\r\n"
                f"connection: close\r\n\r\n").encode()
        self.transport.write(head + body)
        self.transport.close()

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None


def guarded_h11(limits: ServeLimits, counts: ConnectionCounts) -> type[GuardedH11Protocol]:
    """A `GuardedH11Protocol` class for one server: pass it to ``uvicorn.Config(http=...)``."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits, "counts": counts})


__all__ = ["GuardedH11Protocol", "guarded_h11"]
