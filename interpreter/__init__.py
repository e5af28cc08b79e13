"""Sandboxed execution of model-written code: the REPL (worker processes) and the sandbox.

Exports are loaded lazily so that the worker process, which imports this package, does
not pull in the runtime side (anyio).
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Repl": "repl",
    "ReplSession": "repl",
    "ReplLimits": "repl",
    "CellResult": "repl",
    "FinalAnswer": "repl",
    "VariableSummary": "repl",
    "ReplError": "repl",
    "ReplProcessDied": "repl",
    "ReplMessages": "repl",
    "ToolHandler": "repl",
    "Sandbox": "sandbox",
    "ToolError": "sandbox",
    "ALLOWED_MODULES": "sandbox",
    "ToolChannel": "worker",
    "blocking_proxy": "worker",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module_name}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
