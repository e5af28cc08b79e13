"""`ToolRegistry`: the named set of tools an agent may call."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from .definition import DEFAULT_TOOL_TIMEOUT_S, Tool
from .errors import ToolDefinitionError, UnknownToolError


class ToolRegistry:
    """Tools by name, in registration order. Plain functions are wrapped with `Tool` defaults.

    ``default_timeout`` limits each call of a tool that sets no ``timeout`` of its own (seconds;
    ``math.inf``: no limit).
    """

    def __init__(self, tools: Iterable[Tool | Callable[..., Any]] = (), *,
                 default_timeout: float = DEFAULT_TOOL_TIMEOUT_S) -> None:
        if isinstance(default_timeout, bool) or not isinstance(default_timeout, (int, float)) \
                or not default_timeout > 0:
            raise ValueError(f"default_timeout must be a number > 0 (math.inf: no limit), "
                             f"got {default_timeout!r}")
        self.default_timeout = float(default_timeout)
        self._tools: dict[str, Tool] = {}
        for item in tools:
            self.register(item)

    def register(self, item: Tool | Callable[..., Any]) -> Tool:
        """Add a tool (or a plain function); return the `Tool`. Usable as a decorator.

        Raises `ToolDefinitionError` if a tool of that name is already registered.
        """
        registered = item if isinstance(item, Tool) else Tool(item)
        if registered.name in self._tools:
            raise ToolDefinitionError(f"a tool named {registered.name!r} is already registered")
        self._tools[registered.name] = registered
        return registered

    def get(self, name: str) -> Tool:
        """The tool called ``name``; `UnknownToolError` (listing the known names) if none."""
        try:
            return self._tools[name]
        except KeyError:
            raise UnknownToolError(name, self.names()) from None

    def names(self) -> list[str]:
        """Registered tool names, in registration order."""
        return list(self._tools)

    def __iter__(self) -> Iterator[Tool]:
        return iter(list(self._tools.values()))

    def __len__(self) -> int:
        return len(self._tools)

    def __contains__(self, name: object) -> bool:
        if isinstance(name, Tool):
            return self._tools.get(name.name) is name
        return name in self._tools

    def render_signatures(self) -> str:
        """One `Tool.signature_line` per tool, newline-separated (for prompts)."""
        return "\n".join(t.signature_line() for t in self._tools.values())

    def json_schemas(self) -> list[dict[str, Any]]:
        """`Tool.json_schema` of every tool, in registration order."""
        return [t.json_schema() for t in self._tools.values()]

    async def call(
        self, name: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        """Validate and run the tool called ``name`` (see `Tool.invoke`)."""
        return await self.get(name).invoke(args, kwargs, default_timeout=self.default_timeout)
