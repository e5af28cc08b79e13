"""MCP tools: every tool of a Model Context Protocol server as an agentrt `Tool`.

::

    from agentrt.tools.mcp import mcp_tools

    async with mcp_tools("python -m my_server") as tools:           # a stdio server
        result = await Agent(engine, tools=tools).run(task)
    async with mcp_tools(url="http://127.0.0.1:8000/mcp") as tools:  # streamable HTTP
        ...

Each MCP tool becomes a `Tool` whose arguments are validated (pydantic, lax like every tool)
against a model built from the tool's input JSON schema, so a bad call fails in the agent's code
with a `TypeError` naming the argument, before anything is sent. The tool's annotations decide
speculation: ``readOnlyHint: true`` makes it speculatable (it may run before its statement
really executes); anything else (destructive, unannotated) never runs early. ``speculate=`` in
`mcp_tools` overrides that per tool. Results: structured content comes back as Python values
(a lone ``{"result": value}`` wrapper, as the Python SDK writes for non-object returns, is
unwrapped), text content as ``str``; a result flagged ``isError`` (or a protocol error) raises
`MCPToolError`, a `ToolError`.

Needs the ``mcp`` package (``pip install 'agentrt[mcp]'``, mcp 2.x).
"""

from __future__ import annotations

import inspect
import keyword
import re
import shlex
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal, Union

from pydantic import Field
from typing_extensions import NotRequired, Required, TypedDict

from .definition import Tool
from .errors import ToolDefinitionError, ToolError

CallTool = Callable[[str, dict[str, Any]], Awaitable[Any]]
"""Sends one ``tools/call``: ``(MCP tool name, arguments) -> CallToolResult``."""

_P = inspect.Parameter
_POSITIONAL = _P.POSITIONAL_OR_KEYWORD
_OMITTED = None
"""The default of an optional argument without a schema default: not sent when left at it."""


class MCPToolError(ToolError):
    """An MCP tool call failed: the server flagged the result ``isError``, answered with a
    protocol error, or the connection broke."""


class MCPConnectionError(ToolError, ConnectionError):
    """An MCP server could not be started, reached or listed."""


@asynccontextmanager
async def mcp_tools(
    command: str | Sequence[str] | None = None,
    *,
    url: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    speculate: Mapping[str, bool] | None = None,
    timeout: float | None = None,
    prefix: str = "",
) -> AsyncIterator[list[Tool]]:
    """Connect to an MCP server and yield its tools as `Tool` objects; disconnect on exit.

    Give either ``command`` (a command line, as a string split like a shell does or a list of
    arguments: the server is started as a subprocess and spoken to over stdin/stdout, with
    ``env`` and ``cwd``) or ``url`` (a streamable-HTTP endpoint such as
    ``http://127.0.0.1:8000/mcp``). ``speculate`` maps MCP tool names to True/False to override
    the ``readOnlyHint`` rule; ``timeout`` (seconds) applies to every call; ``prefix`` is put
    before every tool name. Names that are not Python identifiers are made into ones
    (``get-weather`` -> ``get_weather``). The tools may only be called while the context is
    open. Raises `MCPConnectionError` when the server cannot be started, reached or listed.
    """
    from mcp import Client

    target, where = _target(command, url, env, cwd)
    client = Client(target)
    # Entered by hand, and left without the exception: the client's task group would wrap an
    # error of the caller's block (or of the listing below) in an exception group.
    try:
        await client.__aenter__()
    except Exception as exc:
        raise MCPConnectionError(
            f"cannot connect to MCP server {where}: {_describe(exc)}") from None
    try:
        try:
            specs = await _list_tools(client)
        except Exception as exc:
            raise MCPConnectionError(f"cannot list the tools of MCP server {where}: "
                                     f"{_describe(exc)}") from None
        overrides = dict(speculate or {})
        unknown = sorted(set(overrides) - {spec.name for spec in specs})
        if unknown:
            raise ToolDefinitionError(
                f"speculate= names {', '.join(map(repr, unknown))}, not tools of MCP server "
                f"{where} (its tools: {', '.join(spec.name for spec in specs) or 'none'})")
        tools = [tool_from_mcp(spec, client.call_tool, speculate=overrides.get(spec.name),
                               timeout=timeout, name=prefix + python_name(spec.name))
                 for spec in specs]
        _check_unique(tools, where)
        yield tools
    finally:
        await client.__aexit__(None, None, None)


def tool_from_mcp(spec: Any, call: CallTool, *, speculate: bool | None = None,
                  timeout: float | None = None, name: str | None = None) -> Tool:
    """One MCP tool description (``mcp.types.Tool``) as a `Tool` that sends calls with ``call``.

    ``speculate`` None follows the tool's ``readOnlyHint``. ``name`` defaults to the MCP name
    made into an identifier.
    """
    tool_name = name or python_name(spec.name)
    schema = spec.input_schema or {}
    defs = {**schema.get("definitions", {}), **schema.get("$defs", {})}
    required = set(schema.get("required", ()))
    params, wire, optional = [], {}, set()
    for prop, prop_schema in (schema.get("properties") or {}).items():
        param = python_name(prop)
        if param in wire:
            raise ToolDefinitionError(f"MCP tool {spec.name!r}: arguments {wire[param]!r} and "
                                      f"{prop!r} both map to the Python name {param!r}")
        wire[param] = prop
        annotation = schema_type(prop_schema, defs)
        if prop in required:
            params.append(_P(param, _POSITIONAL, annotation=annotation))
        elif isinstance(prop_schema, dict) and "default" in prop_schema:
            params.append(_P(param, _POSITIONAL, annotation=annotation,
                             default=prop_schema["default"]))
        else:
            optional.add(param)
            params.append(_P(param, _POSITIONAL, annotation=annotation | None, default=_OMITTED))
    params.sort(key=lambda p: p.default is not _P.empty)  # required ones first, in schema order
    output_schema = getattr(spec, "output_schema", None)

    async def call_mcp_tool(**arguments: Any) -> Any:
        sent = {wire[k]: v for k, v in arguments.items()
                if not (k in optional and v is _OMITTED)}
        try:
            result = await call(spec.name, sent)
        except ToolError:
            raise
        except Exception as exc:
            raise MCPToolError(f"{tool_name}(): {_describe(exc)}") from None
        return result_value(result, output_schema, tool_name)

    returns = _return_type(output_schema)
    call_mcp_tool.__signature__ = inspect.Signature(params, return_annotation=returns)
    call_mcp_tool.__name__ = tool_name
    description = spec.description or getattr(spec, "title", None) or ""
    if speculate is None:
        annotations = getattr(spec, "annotations", None)
        speculate = bool(annotations is not None and annotations.read_only_hint is True)
    return Tool(call_mcp_tool, name=tool_name, speculate=speculate, timeout=timeout,
                description=" ".join(description.split()))


def result_value(result: Any, output_schema: dict[str, Any] | None = None,
                 tool_name: str = "tool") -> Any:
    """A ``CallToolResult`` as a Python value (see the module docstring); raises
    `MCPToolError` for an ``isError`` result."""
    if result.is_error:
        message = "\n".join(_text_of(item) for item in result.content) or "the tool failed"
        raise MCPToolError(f"{tool_name}(): {message}")
    structured = result.structured_content
    if structured is not None:
        wrapped = isinstance(structured, dict) and set(structured) == {"result"}
        if wrapped and _wraps_result(output_schema):
            return structured["result"]
        return structured
    items = list(result.content)
    if not items:
        return None
    if all(getattr(item, "type", None) == "text" for item in items):
        return "\n".join(item.text for item in items)
    return [item.text if getattr(item, "type", None) == "text"
            else item.model_dump(mode="json", by_alias=True, exclude_none=True) for item in items]


def schema_type(schema: Any, defs: Mapping[str, Any] | None = None,
                _seen: frozenset = frozenset()) -> Any:
    """The Python type (for pydantic validation) that a JSON schema describes.

    Covers what tool schemas use: the scalar types with their bounds and lengths, ``enum`` and
    ``const``, arrays, objects with ``properties`` (a `TypedDict`, so values stay dicts) or
    ``additionalProperties``, ``anyOf`` / ``oneOf`` / type lists, and local ``$ref``. Anything
    else validates as ``Any`` (the server still checks it).
    """
    defs = defs or {}
    if not isinstance(schema, dict):
        return Any
    ref = schema.get("$ref")
    if isinstance(ref, str):
        key = ref.rsplit("/", 1)[-1]
        if key in _seen or key not in defs:
            return Any  # recursive or external: not followed
        return schema_type(defs[key], defs, _seen | {key})
    if "const" in schema:
        return Literal[schema["const"]] if _literal_ok([schema["const"]]) else Any
    if isinstance(schema.get("enum"), list) and schema["enum"] and _literal_ok(schema["enum"]):
        return Literal[tuple(schema["enum"])]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return _union([schema_type(s, defs, _seen) for s in schema[key]])
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) == 1:
        return schema_type(schema["allOf"][0], defs, _seen)
    kind = schema.get("type")
    if isinstance(kind, list):
        return _union([schema_type({**schema, "type": k}, defs, _seen) for k in kind])
    if kind == "string":
        return _constrained(str, min_length=schema.get("minLength"),
                            max_length=schema.get("maxLength"), pattern=schema.get("pattern"))
    if kind in ("integer", "number"):
        return _constrained(int if kind == "integer" else float, ge=schema.get("minimum"),
                            le=schema.get("maximum"), gt=_exclusive(schema, "exclusiveMinimum"),
                            lt=_exclusive(schema, "exclusiveMaximum"))
    if kind == "boolean":
        return bool
    if kind == "null":
        return type(None)
    if kind == "array":
        item = schema_type(schema.get("items", {}), defs, _seen)
        return _constrained(list[item], min_length=schema.get("minItems"),
                            max_length=schema.get("maxItems"))
    if kind == "object" or "properties" in schema:
        properties = schema.get("properties")
        if isinstance(properties, dict) and properties:
            required = set(schema.get("required", ()))
            fields = {k: (Required if k in required else NotRequired)[schema_type(v, defs, _seen)]
                      for k, v in properties.items()}
            title = python_name(str(schema.get("title") or "object"))
            return TypedDict(title, fields)  # type: ignore[operator]
        extra = schema.get("additionalProperties")
        return dict[str, schema_type(extra, defs, _seen) if isinstance(extra, dict) else Any]
    return Any


def python_name(name: str) -> str:
    """``name`` made into a Python identifier that is not a keyword (``get-weather`` ->
    ``get_weather``, ``class`` -> ``class_``, ``2d`` -> ``_2d``)."""
    text = re.sub(r"\W", "_", name) or "_"
    if text[0].isdigit():
        text = "_" + text
    return text + "_" if keyword.iskeyword(text) else text


# -- helpers ---------------------------------------------------------------------------------


def _target(command: str | Sequence[str] | None, url: str | None,
            env: Mapping[str, str] | None, cwd: str | None) -> tuple[Any, str]:
    """What `mcp.Client` connects to, and how errors name it."""
    if (command is None) == (url is None):
        raise ValueError("mcp_tools needs exactly one of command= (a stdio server) or url=")
    if url is not None:
        if not re.match(r"https?://", url):
            raise ValueError(f"MCP url must start with http:// or https://, got {url!r}")
        return url, url
    from mcp import StdioServerParameters

    argv = shlex.split(command) if isinstance(command, str) else list(command)
    if not argv:
        raise ValueError("MCP server command is empty")
    params = StdioServerParameters(command=argv[0], args=argv[1:],
                                   env=dict(env) if env is not None else None, cwd=cwd)
    return params, repr(shlex.join(argv))


async def _list_tools(client: Any) -> list[Any]:
    specs, cursor = [], None
    for _ in range(1000):  # a server whose cursor never ends cannot hang the start
        page = await client.list_tools(cursor=cursor)
        specs.extend(page.tools)
        cursor = page.next_cursor
        if not cursor:
            return specs
    raise MCPConnectionError("tool listing did not end after 1000 pages")


def _check_unique(tools: list[Tool], where: str) -> None:
    seen: set[str] = set()
    for t in tools:
        if t.name in seen:
            raise ToolDefinitionError(f"MCP server {where}: two tools map to the Python name "
                                      f"{t.name!r}")
        seen.add(t.name)


def _describe(exc: BaseException) -> str:
    """The innermost failure of an exception (task groups wrap them) as ``Type: message``."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc)
    if type(exc).__name__ == "MCPError" and getattr(exc, "error", None) is not None:
        text = exc.error.message
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _text_of(item: Any) -> str:
    return item.text if getattr(item, "type", None) == "text" else f"[{getattr(item, 'type', '?')}]"


def _wraps_result(output_schema: dict[str, Any] | None) -> bool:
    properties = (output_schema or {}).get("properties")
    return isinstance(properties, dict) and list(properties) == ["result"]


def _return_type(output_schema: dict[str, Any] | None) -> Any:
    if not output_schema:
        return str
    if _wraps_result(output_schema):
        return _strip(schema_type(output_schema["properties"]["result"],
                                  output_schema.get("$defs", {})))
    return _strip(schema_type(output_schema, output_schema.get("$defs", {})))


def _strip(annotation: Any) -> Any:
    """A return annotation without validation metadata (it only describes the tool)."""
    return annotation.__origin__ if hasattr(annotation, "__metadata__") else annotation


def _constrained(base: Any, **limits: Any) -> Any:
    limits = {k: v for k, v in limits.items() if v is not None}
    return Annotated[base, Field(**limits)] if limits else base


def _exclusive(schema: dict[str, Any], key: str) -> Any:
    value = schema.get(key)
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _union(types: list[Any]) -> Any:
    if Any in types:
        return Any
    return types[0] if len(types) == 1 else Union[tuple(types)]  # noqa: UP007


def _literal_ok(values: list[Any]) -> bool:
    return all(v is None or isinstance(v, (str, int, bool)) for v in values)


__all__ = ["MCPConnectionError", "MCPToolError", "mcp_tools", "python_name", "result_value",
           "schema_type", "tool_from_mcp"]
