"""The run timeline: timestamped events, one list per run, exportable as JSON.

Event kinds (``data`` fields in brackets):

- ``run_started`` [task], ``run_finished`` [status, answer], ``run_error`` [error]
- ``turn_started`` [turn], ``turn_finished`` [turn, finish_reason, completion_tokens]
- ``delta`` [turn, chars, text] — one per engine delta
- ``block_opened`` [turn, block], ``statement_closed`` [turn, block, stmt, lineno],
  ``block_closed`` [turn, block, chars, unterminated]
- ``exec_started`` / ``exec_finished`` [turn, block, error, final]
- ``tool_started`` / ``tool_finished`` [call_id, tool, mode, error] — ``mode`` is ``"sync"``
  for a call made by the authoritative run, ``"early"`` for a speculative launch
- speculation events (``spec_*``) are documented in ``agentrt.speculation``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Event:
    t: float
    """Seconds since the run started."""
    kind: str
    data: dict[str, Any] = field(default_factory=dict)


class Trace:
    """An append-only list of `Event`, timed from the trace's creation.

    ``listener``, if given, is called with every event as it is emitted (live displays).
    """

    def __init__(self, listener: Callable[[Event], None] | None = None) -> None:
        self._t0 = time.monotonic()
        self.events: list[Event] = []
        self.listener = listener

    def now(self) -> float:
        return time.monotonic() - self._t0

    def emit(self, kind: str, **data: Any) -> Event:
        event = Event(self.now(), kind, data)
        self.events.append(event)
        if self.listener is not None:
            self.listener(event)
        return event

    def of(self, *kinds: str) -> list[Event]:
        """The events of the given kinds, in order."""
        return [e for e in self.events if e.kind in kinds]

    def to_dict(self) -> dict[str, Any]:
        return {"events": [asdict(e) for e in self.events]}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=repr)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_json(indent=1))
        return path

    def __len__(self) -> int:
        return len(self.events)
