"""The run timeline: timestamped, typed events, one list per run, exportable as JSON.

Each event is an `Event`: its time and its payload, an instance of one of the registered event
types (`agentrt.events`: one dataclass per kind, listed in ``docs/trace.md``). A saved trace
(`Trace.to_dict`, `Trace.save`) is ``{"events": [{"t", "kind", "data"}, ...]}``, ``data`` being
the payload's fields; `Trace.from_dict` reads it back into typed events.

`chrome_trace` / `save_chrome_trace` (`agentrt.trace_export`) export a trace as Chrome
trace-event JSON, which Perfetto (ui.perfetto.dev) and chrome://tracing open.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .events import EVENTS, EventData
from .trace_export import chrome_trace, save_chrome_trace


@dataclass
class Event:
    """One event of a run: when (``t``, seconds since the run started) and what (``payload``)."""

    t: float
    payload: EventData

    @property
    def kind(self) -> str:
        return self.payload.kind

    @property
    def data(self) -> dict[str, Any]:
        """The payload's fields by name."""
        return self.payload.fields()


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

    def emit(self, payload: EventData) -> Event:
        """Record ``payload`` now; a `TypeError` if it is not of a registered event type."""
        kind = getattr(type(payload), "kind", None)
        if EVENTS.get(kind) is not type(payload):
            raise TypeError(f"{payload!r:.100} is not of a registered event type")
        event = Event(self.now(), payload)
        self.events.append(event)
        if self.listener is not None:
            self.listener(event)
        return event

    def of(self, *kinds: str) -> list[Event]:
        """The events of the given kinds, in order."""
        return [e for e in self.events if e.kind in kinds]

    def to_dict(self) -> dict[str, Any]:
        return {"events": [{"t": e.t, "kind": e.kind, "data": e.data} for e in self.events]}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=repr)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_json(indent=1))
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trace:
        """The trace `to_dict` wrote (e.g. read back from a saved JSON file); a `ValueError`
        for an event of an unknown kind, a `TypeError` for one with wrong fields."""
        trace = cls()
        for e in data["events"]:
            kind = EVENTS.get(e["kind"])
            if kind is None:
                raise ValueError(f"a saved trace holds an event of unknown kind {e['kind']!r}")
            trace.events.append(Event(e["t"], kind(**(e.get("data") or {}))))
        return trace

    def to_chrome(self, name: str = "agentrt run") -> dict[str, Any]:
        """This trace as Chrome trace-event JSON (see `chrome_trace`)."""
        return chrome_trace(self, name)

    def __len__(self) -> int:
        return len(self.events)


__all__ = ["Event", "Trace", "chrome_trace", "save_chrome_trace"]
