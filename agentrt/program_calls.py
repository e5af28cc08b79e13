"""`ProgramCalls`: the tool calls a run's program makes, served for its sandbox.

The authoritative run (the sandbox executing a complete block) reaches every tool through one
handler, `ProgramCalls.call`: the call is claimed from an early call when the speculator has one
(a hit), else the tool runs now (`traced_call`, a miss). Either way the call ends with a
``program_call`` event (digests of its arguments and of its outcome, in program order), so that
runs with and without speculation, or through different loops, compare call by call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agentrt.tools import ToolRegistry

from .results import RunStats
from .speculation import NoSpeculation
from .tool_calls import call_digests, traced_call
from .trace import Trace

ResultHook = Callable[[str, tuple, dict, Any, "float | None"], None]
"""``hook(name, args, kwargs, value, claimed_s)`` after a call returned ``value``: ``claimed_s``
is when the claim of the early call that served it began, None when the tool ran now."""


class ProgramCalls:
    """The program's tool calls for one run, and the speculator they claim from (a
    `NoSpeculation` until the loop installs its own). ``on_result`` sees each value returned."""

    def __init__(self, registry: ToolRegistry, trace: Trace, stats: RunStats,
                 on_result: ResultHook | None = None) -> None:
        self.registry = registry
        self.trace = trace
        self.stats = stats
        self.speculator: NoSpeculation = NoSpeculation()
        self.block: tuple[int, int] = (0, 0)
        """(turn, block) the sandbox is executing: where its calls come from."""
        self._on_result = on_result
        self._ids = 0

    async def call(self, name: str, args: tuple, kwargs: dict, line: int | None = None) -> Any:
        """Serve one call of the program (``line``: its line in the block); its exception, if
        it raises, is raised here after the ``program_call`` event records it."""
        try:
            value = await self._serve(name, args, kwargs, line)
        except Exception as exc:
            self.trace.emit(call_digests(self.registry, name, args, kwargs, error=exc))
            raise
        self.trace.emit(call_digests(self.registry, name, args, kwargs, value=value))
        return value

    async def _serve(self, name: str, args: tuple, kwargs: dict, line: int | None) -> Any:
        turn, block = self.block
        claimed_s = self.trace.now()
        hit, value = await self.speculator.claim(name, args, kwargs, block=block)
        if not hit:
            self._ids += 1
            claimed_s = None
            value = await traced_call(self.registry, self.trace, self.stats, name, args, kwargs,
                                      call_id=self._ids, mode="sync", turn=turn, block=block,
                                      lineno=line)
        if self._on_result is not None:
            self._on_result(name, args, kwargs, value, claimed_s)
        return value
