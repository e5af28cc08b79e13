"""Sandboxed execution of model-written code: the REPL (worker processes) and the sandbox.

Exports are loaded lazily so that the worker process, which imports this package, does
not pull in the runtime side (anyio).
"""

from __future__ import annotations

from agentrt.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    **dict.fromkeys(["Repl", "ReplSession", "ReplLimits", "CellResult", "FinalAnswer",
                     "VariableSummary", "ReplError", "ReplProcessDied", "ReplMessages",
                     "ToolHandler"], ".repl"),
    **dict.fromkeys(["Sandbox", "ToolError", "ALLOWED_MODULES"], ".sandbox"),
    **dict.fromkeys(["ToolChannel", "blocking_proxy"], ".worker"),
})
