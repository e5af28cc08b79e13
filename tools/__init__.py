"""Tools: the ``@tool`` decorator, the `Tool` wrapper, the `ToolRegistry` and built-in tools."""

from .builtins import make_llm_tools
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
    "UnknownToolError", "ToolDefinitionError", "UnkeyableArgumentsError", "make_llm_tools",
]
