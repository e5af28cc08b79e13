"""Runtime -> worker frames carry large values without serialised copies of them.

`encode_trusted` leaves large ``str`` and ``bytes`` out of the pickle and sends them after it in
chunks; the worker's `FramedSocket.recv` puts them back. Frames without such values are the plain
frames, and a frame cut short ends its process.
"""

from __future__ import annotations

import socket
import threading
import tracemalloc

import anyio
import pytest

from agentrt.interpreter.frames import ToolResult
from agentrt.interpreter.protocol import (
    OUT_OF_BAND_BYTES,
    FramedSocket,
    encode_frame,
    encode_trusted,
)
from agentrt.interpreter.repl.processes import Proc
from agentrt.interpreter.repl.results import ReplProcessDied


def _through_a_socket(message: dict) -> dict:
    """Send ``message`` as the runtime does and receive it as a worker does."""
    host, worker = socket.socketpair()
    errors: list[BaseException] = []

    def send() -> None:
        try:
            for piece in encode_trusted(message):
                host.sendall(piece)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        received = FramedSocket(worker).recv()
    finally:
        sender.join()
        host.close()
        worker.close()
    assert not errors
    return received


def test_large_strings_and_bytes_arrive_equal_and_shared_once():
    ascii_text = "a" * (3 * OUT_OF_BAND_BYTES + 5)
    wide = "é\ud800€" * (OUT_OF_BAND_BYTES // 2)  # non-ASCII, with lone surrogates
    data = bytes(range(256)) * (OUT_OF_BAND_BYTES // 64)
    message = {"op": "tool_result", "call": 1,
               "value": [ascii_text, {"w": wide, "b": data}, ascii_text, "small", b"tiny", 7]}
    received = _through_a_socket(message)
    assert received == message
    value = received["value"]
    assert value[0] is value[2]  # one value referred to twice arrives once, shared
    assert type(value[1]["b"]) is bytes


def test_a_frame_without_large_values_is_the_plain_frame():
    message = ToolResult(3, {"k": ["v" * 1000, 1.5, None]}).to_message()
    assert b"".join(encode_trusted(message)) == encode_frame(message, limit=None)
    assert _through_a_socket(message) == message


def test_encoding_a_large_result_holds_one_chunk_at_a_time():
    text = "x" * 30_000_000
    message = ToolResult(1, text).to_message()
    tracemalloc.start()
    try:
        sent = 0
        for piece in encode_trusted(message):
            sent += len(piece)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert sent > len(text)
    assert peak < 4 * OUT_OF_BAND_BYTES, f"encoding peaked at {peak / 1e6:.1f} MB"


class _FailingStream:
    """A stream that takes ``good`` pieces, then breaks."""

    def __init__(self, good: int) -> None:
        self.good = good
        self.pieces = 0

    async def send(self, piece) -> None:
        if self.pieces >= self.good:
            raise anyio.BrokenResourceError
        self.pieces += 1


@pytest.mark.parametrize("good", [0, 1])
def test_a_frame_cut_short_ends_its_process(good):
    proc = Proc("token", "cell")
    proc.stream = _FailingStream(good)  # type: ignore[assignment]

    async def main() -> None:
        with pytest.raises(ReplProcessDied):
            await proc.send(ToolResult(1, "x" * (2 * OUT_OF_BAND_BYTES)))

    anyio.run(main)
    if good:  # part of the frame went out: the connection is unusable
        assert proc.dead.is_set() and "cut short" in (proc.stop_reason or "")
    else:  # nothing went out
        assert not proc.dead.is_set()
