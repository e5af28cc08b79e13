"""agentrt: a speculative tool-calling runtime for code-writing agents.

The public entry points: `Agent` (the run loop), `tool` (register a Python function as a tool),
the engines (`ReplayEngine` here; `NativeEngine`, `VLLMEngine`, `OpenAIEngine` in
`agentrt.engine`), `RunResult` and `Trace`.

Names are imported lazily, so the sandbox worker (``agentrt.interpreter.worker``) starts without
loading the runtime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "Agent": "agentrt.agent",
    "BlockRecord": "agentrt.results",
    "RunInterrupted": "agentrt.results",
    "RunResult": "agentrt.results",
    "RunStats": "agentrt.results",
    "TurnRecord": "agentrt.results",
    "Event": "agentrt.trace",
    "Trace": "agentrt.trace",
    "Engine": "agentrt.engine",
    "ReplayEngine": "agentrt.engine",
    "SamplingParams": "agentrt.engine",
    "ReplLimits": "agentrt.interpreter.repl",
    "SpeculationBudget": "agentrt.ledger",
    "Tool": "agentrt.tools",
    "ToolError": "agentrt.tools",
    "tool": "agentrt.tools",
}

__all__ = [*_EXPORTS, "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from agentrt.engine import Engine, ReplayEngine, SamplingParams
    from agentrt.interpreter.repl import ReplLimits
    from agentrt.ledger import SpeculationBudget
    from agentrt.tools import Tool, ToolError, tool

    from .agent import Agent
    from .results import BlockRecord, RunInterrupted, RunResult, RunStats, TurnRecord
    from .trace import Event, Trace


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'agentrt' has no attribute {name!r}")
