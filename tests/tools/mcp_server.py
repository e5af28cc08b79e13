"""A small MCP server (written with the ``mcp`` package) for the MCP tool tests.

``python mcp_server.py stdio LOG`` or ``python mcp_server.py http PORT LOG``. Every tool call
appends ``{"tool", "args"}`` as one JSON line to LOG, in the order the server received them.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated, Literal

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import BaseModel, Field

LOG = sys.argv[-1]
POPULATION = {"paris": 2100, "rome": 2800, "oslo": 700, "lima": 9700}
server = MCPServer("agentrt-test-server", log_level="WARNING")


def log(tool: str, **args) -> None:
    with open(LOG, "a") as f:
        f.write(json.dumps({"tool": tool, "args": args, "t": time.time()}) + "\n")


class Square(BaseModel):
    n: int
    square: int


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def population(city: str) -> int:
    """Population of a city, in thousands."""
    log("population", city=city)
    time.sleep(0.3)
    return POPULATION[city.lower()]


@server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=True))
def delete_city(city: str) -> str:
    """Remove a city from the registry."""
    log("delete_city", city=city)
    POPULATION.pop(city.lower(), None)
    return f"deleted {city}"


@server.tool()
def note(text: str) -> str:
    """Unannotated: appends a note."""
    log("note", text=text)
    return "noted"


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def search(query: Annotated[str, Field(min_length=2)], k: int = 3,
           mode: Literal["fast", "exact"] = "fast") -> list[str]:
    """Search the corpus."""
    log("search", query=query, k=k, mode=mode)
    return [f"{mode}:{query}:{i}" for i in range(k)]


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def square(n: int) -> Square:
    """A structured result."""
    log("square", n=n)
    return Square(n=n, square=n * n)


@server.tool(annotations=ToolAnnotations(read_only_hint=True), structured_output=False)
def shout(text: str) -> str:
    """A text result."""
    log("shout", text=text)
    return text.upper() + "!"


@server.tool(name="get-weather", annotations=ToolAnnotations(read_only_hint=True))
def get_weather(city: str, days: int | None = None) -> str:
    """A hyphenated name and an optional argument without a default value on the wire."""
    log("get-weather", city=city, days=days)
    return f"sunny in {city} for {days or 1} day(s)"


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def broken(reason: str) -> str:
    """Always fails."""
    log("broken", reason=reason)
    raise ToolError(f"broken on purpose: {reason}")


if __name__ == "__main__":
    if sys.argv[1] == "http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run("stdio")
