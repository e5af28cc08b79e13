"""Load the ``@tool`` functions a Python module defines (``agentrt run --tools mypkg.tools``)."""

from __future__ import annotations

import importlib
from pathlib import Path

from agentrt.tools import Tool

from .errors import AgentrtError


class ToolModuleError(AgentrtError, ValueError):
    """A tools module that cannot be imported or holds no tools."""


def load_tool_module(name: str) -> list[Tool]:
    """Import module ``name`` and return its `Tool` objects, in definition order.

    The module must be importable (installed, or on ``PYTHONPATH``). Raises `ToolModuleError`
    if the module cannot be imported or defines no ``@tool`` functions.
    """
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        hint = ""
        if Path(*name.split(".")).with_suffix(".py").is_file() and exc.name == name.split(".")[0]:
            hint = " (it is in the current directory: run with PYTHONPATH=.)"
        raise ToolModuleError(f"cannot import tools module {name!r}: {exc}{hint}") from None
    except Exception as exc:  # the module itself failed while importing
        raise ToolModuleError(
            f"tools module {name!r} failed while importing: {type(exc).__name__}: {exc}"
        ) from None
    tools: list[Tool] = []
    for value in vars(module).values():
        if isinstance(value, Tool) and all(value is not t for t in tools):
            tools.append(value)
    if not tools:
        raise ToolModuleError(
            f"tools module {name!r} defines no tools: decorate functions with @agentrt.tool"
        )
    return tools
