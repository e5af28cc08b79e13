"""`EffectEpochs`: the authoritative run's effectful calls, counted into epochs.

Every shadow has an *epoch*: the number of effectful calls the authoritative run had made when
its code began. An effectful call advances the epoch; the early calls of tools that read a scope
it writes are then stale, and a shadow of an older epoch may no longer launch such calls (reads
never overtake writes; pure calls and reads of other scopes cross). While a block that has passed
an effect is running, no new shadow starts: it would start from the block's beginning, before
that effect.
"""

from __future__ import annotations

from agentrt.tools import Tool, ToolRegistry
from agentrt.tools.scopes import overlaps


class EffectEpochs:
    """Epochs of one run, from the scopes the registry's tools declare."""

    def __init__(self, registry: ToolRegistry) -> None:
        self._reads = {t.name: t.reads for t in registry if t.speculate}
        """What each speculatable tool reads."""
        self._writes: list[frozenset[str]] = []
        """What the effectful calls wrote, in order (epoch n follows the n-th)."""
        self._running: int | None = None
        """The epoch the running block started in (None: no block is running)."""

    @property
    def current(self) -> int:
        """Effectful calls the authoritative run has made so far."""
        return len(self._writes)

    def advance(self, tool: Tool) -> list[str]:
        """Effectful ``tool`` is about to run: the next epoch begins. Returns the speculatable
        tools whose early calls it makes stale (they read a scope it writes)."""
        self._writes.append(tool.writes)
        return [name for name, reads in self._reads.items() if overlaps(reads, tool.writes)]

    def overtakes(self, name: str, epoch: int) -> bool:
        """Whether tool ``name`` reads a scope written by an effectful call made since
        ``epoch``."""
        reads = self._reads[name]
        return any(overlaps(reads, writes) for writes in self._writes[epoch:])

    def block_started(self) -> None:
        self._running = self.current

    def block_executed(self) -> None:
        self._running = None

    def shadow_epoch(self) -> int | None:
        """The epoch a shadow started now would run in; None if it must wait for the running
        block, which has passed an effect."""
        if self._running is not None and self._running != self.current:
            return None
        return self.current
