"""Tools: the ``@tool`` decorator, the `Tool` wrapper and the `ToolRegistry`."""

from .errors import (
    ToolArgumentError,
    ToolDefinitionError,
    ToolError,
    ToolTimeoutError,
    UnkeyableArgumentsError,
    UnknownToolError,
)
from .registry import ToolRegistry
from .tool import Tool, tool

__all__ = [
    "tool", "Tool", "ToolRegistry", "ToolError", "ToolArgumentError", "ToolTimeoutError",
    "UnknownToolError", "ToolDefinitionError", "UnkeyableArgumentsError",
]
