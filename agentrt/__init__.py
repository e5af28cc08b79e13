"""agentrt: a speculative tool-calling runtime for code-writing agents.

The public entry points: `Agent` (the run loop), `tool` (register a Python function as a tool),
the engines (`NativeEngine`, `ReplayEngine` here; `VLLMEngine`, `OpenAIEngine` in
`agentrt.engine`), `RunResult` and `Trace`. Every error agentrt raises on its own account derives
from `AgentrtError` (`EngineError` from an engine, `ReplError` from the sandboxed REPL, `ToolError`
from the tool layer); `RunInterrupted` is an interrupt, not an error.

Names are imported lazily, so the sandbox worker (``agentrt.interpreter.worker``) starts without
loading the runtime.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy_exports import lazy_exports

__version__ = "0.1.0"

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "Agent": ".agent",
    "AgentrtError": ".errors",
    "BlockRecord": ".results",
    "RunInterrupted": ".results",
    "RunResult": ".results",
    "RunStats": ".results",
    "TurnRecord": ".results",
    "Event": ".trace",
    "Trace": ".trace",
    "Engine": ".engine",
    "EngineError": ".engine",
    "NativeEngine": ".engine",
    "ReplayEngine": ".engine",
    "SamplingParams": ".engine",
    "ReplError": ".interpreter.repl",
    "ReplLimits": ".interpreter.repl",
    "SpeculationBudget": ".ledger",
    "Tool": ".tools",
    "ToolError": ".tools",
    "tool": ".tools",
})
__all__ = [*__all__, "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from agentrt.engine import (
        Engine,
        EngineError,
        NativeEngine,
        ReplayEngine,
        SamplingParams,
    )
    from agentrt.interpreter.repl import ReplError, ReplLimits
    from agentrt.ledger import SpeculationBudget
    from agentrt.tools import Tool, ToolError, tool

    from .agent import Agent
    from .errors import AgentrtError
    from .results import BlockRecord, RunInterrupted, RunResult, RunStats, TurnRecord
    from .trace import Event, Trace
