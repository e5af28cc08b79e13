"""The REPL's message stream: unsolicited messages of forked sessions, for one consumer.

The REPL does not read these messages; it hands each one on as ``(session token, message)``
in arrival order (across all connections), plus its own ``{"op": "refused_call", "name": ...}``
notice when it refuses a tool call from a shadow session. A tool call waits until the
consumer has received every message that arrived before it, so a message never falls
behind a tool call that followed it.
"""

from __future__ import annotations

import math
from typing import Any

import anyio
import anyio.abc
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

Message = tuple[str, dict[str, Any]]
"""``(session token, message)``: the token is that of the `ReplSession` that sent it."""


class ReplMessages(anyio.abc.ObjectReceiveStream[Message]):
    """The receiving end of the stream (an anyio object receive stream; iterate or
    ``receive()``). Closing it stops the stream: later messages are dropped."""

    def __init__(self) -> None:
        send, receive = anyio.create_memory_object_stream[Message](math.inf)
        self._send: MemoryObjectSendStream[Message] = send
        self._receive: MemoryObjectReceiveStream[Message] = receive
        self._posted = 0
        self._taken = 0
        self._progress = anyio.Event()
        self._closed = False

    @property
    def closed(self) -> bool:
        """Whether the consumer closed the stream."""
        return self._closed

    def post(self, token: str, message: dict[str, Any]) -> None:
        """Queue a message (never blocks; dropped once the stream is closed)."""
        if not self.closed:
            self._send.send_nowait((token, message))
            self._posted += 1

    def mark(self) -> int:
        """How many messages were posted so far (for :meth:`wait_received`)."""
        return self._posted

    async def wait_received(self, mark: int) -> None:
        """Wait until the consumer has received the first ``mark`` messages (or closed)."""
        while self._taken < mark and not self.closed:
            await self._progress.wait()

    async def receive(self) -> Message:
        item = await self._receive.receive()
        self._received()
        return item

    def receive_nowait(self) -> Message:
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
