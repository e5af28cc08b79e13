"""The REPL's message stream: what shadow forks say, for one consumer.

The REPL hands on each message of a shadow fork, already checked and typed
(:class:`~..frames.Launch`, :class:`~..frames.ShadowDone`), as ``(session token, message)`` in
arrival order across all connections, plus its own :class:`~..frames.RefusedCall` notice when it
refuses a tool call from a shadow session. A tool call waits until the consumer has received
every message that arrived before it, so a message never falls behind a tool call that followed
it. At most :data:`MAX_QUEUED` messages wait unread; past that, the REPL stops reading from the
sending worker until the consumer catches up.
"""

from __future__ import annotations

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..frames import ShadowMessage

SessionMessage = tuple[str, ShadowMessage]
"""``(session token, message)``: the token is that of the `ReplSession` that sent it."""

MAX_QUEUED = 1024


class ReplMessages(anyio.abc.ObjectReceiveStream[SessionMessage]):
    """The receiving end of the stream (an anyio object receive stream; iterate or
    ``receive()``). Closing it stops the stream: later messages are dropped."""

    def __init__(self) -> None:
        send, receive = anyio.create_memory_object_stream[SessionMessage](MAX_QUEUED)
        self._send: MemoryObjectSendStream[SessionMessage] = send
        self._receive: MemoryObjectReceiveStream[SessionMessage] = receive
        self._posted = 0
        self._taken = 0
        self._progress = anyio.Event()
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether the consumer closed the stream."""
        return self._closed

    async def post(self, token: str, message: ShadowMessage) -> None:
        """Queue a message; waits while :data:`MAX_QUEUED` are unread (dropped once closed)."""
        if self.closed:
            return
        try:
            await self._send.send((token, message))
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            return
        self._posted += 1

    def mark(self) -> int:
        """How many messages were posted so far (for :meth:`wait_received`)."""
        return self._posted

    async def wait_received(self, mark: int) -> None:
        """Wait until the consumer has received the first ``mark`` messages (or closed)."""
        while self._taken < mark and not self.closed:
            await self._progress.wait()

    async def receive(self) -> SessionMessage:
        item = await self._receive.receive()
        self._received()
        return item

    def receive_nowait(self) -> SessionMessage:
        """The next message if one is waiting; raises ``anyio.WouldBlock`` otherwise."""
        item = self._receive.receive_nowait()
        self._received()
        return item

    def close(self) -> None:
        """Stop the stream now: queued and later messages are dropped, waiters released."""
        self._closed = True
        self._send.close()
        self._receive.close()
        self._progress.set()

    async def aclose(self) -> None:
        self.close()

    def _received(self) -> None:
        self._taken += 1
        self._progress.set()
        self._progress = anyio.Event()
