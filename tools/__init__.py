"""Tools: the ``@tool`` decorator, the `Tool` wrapper and the `ToolRegistry`.

Names are imported on first use, so that ``agentrt.tools.errors`` (the one `ToolError`, which
the sandbox's worker processes raise too) loads without pydantic and the rest of the layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentrt.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "tool": ".definition", "Tool": ".definition", "ToolRegistry": ".registry",
    "ToolError": ".errors", "ToolArgumentError": ".errors", "ToolTimeoutError": ".errors",
    "UnknownToolError": ".errors", "ToolDefinitionError": ".errors",
    "UnkeyableArgumentsError": ".errors", "ToolCancelledError": ".errors",
    "DEFAULT_TOOL_TIMEOUT_S": ".definition",
})

if TYPE_CHECKING:  # pragma: no cover
    from .definition import DEFAULT_TOOL_TIMEOUT_S
    from .errors import (
        ToolArgumentError,
        ToolCancelledError,
        ToolDefinitionError,
        ToolError,
        ToolTimeoutError,
        UnkeyableArgumentsError,
        UnknownToolError,
    )
    from .registry import ToolRegistry
    from .definition import Tool, tool

