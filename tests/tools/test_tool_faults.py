"""Faulty tools at the tool layer: default timeouts, stray cancellations, abandoned threads."""

from __future__ import annotations

import asyncio
import math
import threading

import anyio
import pytest

from agentrt.tools import (
    DEFAULT_TOOL_TIMEOUT_S,
    ToolCancelledError,
    ToolError,
    ToolRegistry,
    ToolTimeoutError,
    tool,
)
from agentrt.tools.definition import MAX_ABANDONED_CALLS


def test_a_tool_without_a_timeout_gets_the_registrys_default():
    @tool
    async def hangs() -> None:
        await anyio.sleep(3600)

    @tool(timeout=math.inf)
    async def patient() -> str:
        await anyio.sleep(0.3)
        return "done"

    registry = ToolRegistry([hangs, patient], default_timeout=0.2)
    assert hangs.timeout is None and DEFAULT_TOOL_TIMEOUT_S == 60.0

    async def main() -> None:
        with pytest.raises(ToolTimeoutError, match=r"hangs\(\) timed out after 0.2 s"):
            await registry.call("hangs")
        assert await registry.call("patient") == "done"  # its own limit (none) wins
        with pytest.raises(ToolTimeoutError, match="after 0.1 s"):
            await hangs.invoke(default_timeout=0.1)

    anyio.run(main)
    with pytest.raises(ValueError, match="default_timeout"):
        ToolRegistry(default_timeout=0)


@pytest.mark.parametrize("how", ["raises", "awaits a cancelled task", "sync", "exit"])
def test_a_stray_cancelled_error_is_the_calls_own_error(how):
    @tool
    async def raises() -> None:
        raise asyncio.CancelledError()

    @tool(name="raises")
    async def awaits() -> None:
        task = asyncio.ensure_future(asyncio.sleep(10))
        await asyncio.sleep(0)
        task.cancel()
        await task

    @tool(name="raises")
    def sync() -> None:
        raise asyncio.CancelledError()

    @tool(name="raises")
    def exits() -> None:
        raise SystemExit(2)

    @tool
    async def slow() -> None:
        await anyio.sleep(3600)

    chosen = {"raises": raises, "awaits a cancelled task": awaits, "sync": sync,
              "exit": exits}[how]

    async def main() -> None:
        with pytest.raises(ToolCancelledError, match=r"raises\(\) raised") as caught:
            await chosen.invoke()
        assert isinstance(caught.value, RuntimeError) and caught.value.tool == "raises"
        await anyio.sleep(0)  # the task itself was never cancelled
        with anyio.move_on_after(0.1) as scope:  # a cancellation by the caller still cancels
            await slow.invoke()
        assert scope.cancelled_caught

    anyio.run(main)


def test_abandoned_sync_calls_are_bounded_and_released_when_they_return():
    release = threading.Event()

    @tool(timeout=0.05)
    def blocks() -> str:
        release.wait(60)
        return "back"

    async def main() -> None:
        for _ in range(MAX_ABANDONED_CALLS):
            with pytest.raises(ToolTimeoutError):
                await blocks.invoke()
        with pytest.raises(ToolError, match=f"{MAX_ABANDONED_CALLS} earlier calls"):
            await blocks.invoke()
        release.set()
        for _ in range(200):  # until the abandoned threads have returned
            if not any(t.name == "agentrt tool blocks" for t in threading.enumerate()):
                break
            await anyio.sleep(0.02)
        assert await blocks.invoke() == "back"

    try:
        anyio.run(main)
    finally:
        release.set()
    assert all(t.daemon for t in threading.enumerate() if t.name.startswith("agentrt tool"))
