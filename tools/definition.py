"""`Tool`: a typed Python function made into a validated, time-limited, concurrency-limited tool.

A `Tool` is still callable like the function it wraps (un-validated, for users' own tests). The
runtime goes through `Tool.invoke`, which validates the arguments with a pydantic model built from
the signature (lax mode: ``"3"`` is accepted for an ``int``), then runs the function: sync functions
in a worker thread, async functions awaited.

Timeouts: every call has one. A tool's own ``timeout`` wins; a tool without one gets the default
of whoever runs it (`ToolRegistry`'s ``default_timeout``, `Agent`'s ``tool_timeout``, else
`DEFAULT_TOOL_TIMEOUT_S`); ``math.inf`` means no limit. A call that runs past its timeout raises
`ToolTimeoutError` promptly. A *sync* function can't be interrupted, so its thread is abandoned
and keeps running in the background until the function returns on its own; the same goes for a
sync call whose caller is cancelled. Those threads are daemon threads (they never hold up the
process's exit); while `MAX_ABANDONED_CALLS` abandoned calls of one tool still run, its new calls
fail at once with `ToolError`. The ``max_concurrency`` slot of an abandoned call is released when
the caller gives up on it.

Cancellation: a call cancelled by its caller (a timeout, a cancelled run) ends with the caller's
cancellation. A tool that raises `asyncio.CancelledError` (or ``SystemExit``) when nothing
cancelled it, for instance by awaiting a task that something else cancelled, fails with
`ToolCancelledError`, an ordinary error of that call.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import json
import keyword
import math
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Annotated, Any, get_args, get_origin, overload

import anyio
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from pydantic.json_schema import GenerateJsonSchema
from pydantic_core import PydanticSerializationError, to_jsonable_python

from .errors import (
    ToolArgumentError,
    ToolCancelledError,
    ToolDefinitionError,
    ToolError,
    ToolTimeoutError,
    UnkeyableArgumentsError,
)
from .scopes import ALL_SCOPES, check_scopes

DEFAULT_TOOL_TIMEOUT_S = 60.0
"""The time limit of a call of a tool that sets none, unless its registry or agent sets another."""
MAX_ABANDONED_CALLS = 16
"""Sync calls of one tool that may still run after their callers gave up; past it, calls fail."""

_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)


class Tool:
    """A function the agent's code can call, with validated arguments and limits.

    Attributes: ``name``, ``speculate`` (safe to run before its statement really executes: pure,
    read-only or idempotent), ``pure`` (a speculatable tool that depends only on its arguments),
    ``reads`` / ``writes`` (the effect scopes it reads or writes, see `agentrt.tools.scopes`:
    a speculatable tool reads `ALL_SCOPES` unless it declares ``reads`` or is pure, and writes
    nothing; an effectful tool writes `ALL_SCOPES` unless it declares ``writes``), ``timeout``
    (seconds; ``math.inf``: no limit; None: the default of whoever runs it, see the module
    docstring), ``max_concurrency`` (calls of this tool in flight
    at once, or None), ``description`` (default: first paragraph of the docstring), ``is_async``
    and ``func`` (the wrapped function).
    """

    def __init__(
        self,
        func: Callable[..., Any],
        *,
        name: str | None = None,
        speculate: bool = False,
        pure: bool = False,
        reads: Iterable[str] | None = None,
        writes: Iterable[str] | None = None,
        timeout: float | None = None,
        max_concurrency: int | None = None,
        description: str | None = None,
    ) -> None:
        if not callable(func):
            raise TypeError(f"a tool must wrap a callable, got {type(func).__name__}")
        functools.update_wrapper(self, func, updated=())
        self.func = func
        self.name = _check_name(name if name is not None else getattr(func, "__name__", None))
        self.speculate = bool(speculate)
        self.pure = bool(pure)
        self.reads, self.writes = _effect_scopes(self.name, self.speculate, self.pure, reads,
                                                 writes)
        self.timeout = _check_timeout(self.name, timeout)
        self.max_concurrency = _check_max_concurrency(self.name, max_concurrency)
        self.description = (
            description if description is not None else _first_paragraph(inspect.getdoc(func))
        )
        self.is_async = _is_async(func)
        self._signature = _signature(self.name, func)
        self._params = list(self._signature.parameters.values())
        for p in self._params:
            if p.kind in (_P.VAR_POSITIONAL, _P.VAR_KEYWORD):
                star = "*" if p.kind is _P.VAR_POSITIONAL else "**"
                raise ToolDefinitionError(
                    f"tool {self.name!r}: parameter '{star}{p.name}' is not supported; "
                    "tools need a fixed set of named parameters"
                )
        self._by_name = {p.name: p for p in self._params}
        self._fields = {p.name: f"p{i}" for i, p in enumerate(self._params)}
        self._model = _arguments_model(self.name, self._params, self._fields)
        self._limiter: anyio.CapacityLimiter | None = None
        self._abandoned: set[threading.Thread] = set()

    # -- calling -----------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped function directly: no validation, no limits."""
        return self.func(*args, **kwargs)

    def bind(
        self, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """Validate a call's arguments; return them by parameter name, defaults filled in.

        Raises `ToolArgumentError` (a `TypeError`) naming the tool, the argument and the problem.
        """
        data = self._collect(tuple(args), dict(kwargs or {}))
        try:
            model = self._model.model_validate(data)
        except ValidationError as exc:
            raise ToolArgumentError(self.name, _validation_problems(exc)) from None
        return {p.name: getattr(model, self._fields[p.name]) for p in self._params}

    async def invoke(self, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None, *,
                     default_timeout: float = DEFAULT_TOOL_TIMEOUT_S) -> Any:
        """Validate the arguments, then run the tool under its timeout (``default_timeout`` when
        the tool sets none) and its concurrency limit."""
        bound = self.bind(args, kwargs)
        call_args = [bound[p.name] for p in self._params if p.kind is _P.POSITIONAL_ONLY]
        call_kwargs = {p.name: bound[p.name] for p in self._params if p.kind is not _P.POSITIONAL_ONLY}
        timeout = self.timeout if self.timeout is not None else default_timeout
        limiter = self._get_limiter()
        if limiter is None:
            return await self._run_limited_in_time(call_args, call_kwargs, timeout)
        async with limiter:
            return await self._run_limited_in_time(call_args, call_kwargs, timeout)

    async def _run_limited_in_time(self, args: list[Any], kwargs: dict[str, Any],
                                   timeout: float) -> Any:
        with anyio.move_on_after(timeout):  # math.inf: never
            return await self._run(args, kwargs)
        raise ToolTimeoutError(self.name, timeout)

    async def _run(self, args: list[Any], kwargs: dict[str, Any]) -> Any:
        try:
            if self.is_async:
                return await self.func(*args, **kwargs)
            result = await self._in_thread(functools.partial(self.func, *args, **kwargs))
            if inspect.iscoroutine(result):  # a sync wrapper around a coroutine function
                return await result
            return result
        except (Exception, KeyboardInterrupt):
            raise
        except BaseException as exc:  # CancelledError, SystemExit, GeneratorExit
            if isinstance(exc, asyncio.CancelledError) and _cancel_requested():
                raise  # the caller cancelled this call
            raise ToolCancelledError(self.name, exc) from exc

    async def _in_thread(self, call: Callable[[], Any]) -> Any:
        """Run ``call`` in a daemon thread of its own; abandon it if the caller gives up."""
        self._abandoned = {t for t in self._abandoned if t.is_alive()}
        if len(self._abandoned) >= MAX_ABANDONED_CALLS:
            raise ToolError(f"{self.name}(): {len(self._abandoned)} earlier calls that timed out "
                            "or were cancelled are still running; no new call starts until "
                            "they return")
        loop = asyncio.get_running_loop()
        outcome: asyncio.Future[Any] = loop.create_future()
        context = contextvars.copy_context()

        def work() -> None:
            try:
                value, error = context.run(call), None
            except BaseException as exc:  # noqa: BLE001 - handed to the caller as it is
                value, error = None, exc
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
                loop.call_soon_threadsafe(_settle, outcome, value, error)

        thread = threading.Thread(target=work, name=f"agentrt tool {self.name}", daemon=True)
        thread.start()
        try:
            return await outcome
        finally:
            if not outcome.done() or outcome.cancelled():
                self._abandoned.add(thread)

    def _get_limiter(self) -> anyio.CapacityLimiter | None:
        # Created on first use, inside the event loop (older anyio can't create one outside).
        if self.max_concurrency is not None and self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.max_concurrency)
        return self._limiter

    def _collect(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Map a call's arguments to parameter names (the model's aliases), as Python binds them."""
        problems: list[tuple[str | None, str]] = []
        positional = [p for p in self._params if p.kind in _POSITIONAL]
        if len(args) > len(positional):
            problems.append(
                (None, f"takes {_plural(len(positional), 'positional argument')} "
                       f"but {len(args)} {'was' if len(args) == 1 else 'were'} given")
            )
        data: dict[str, Any] = {p.name: value for p, value in zip(positional, args, strict=False)}
        for key, value in kwargs.items():
            param = self._by_name.get(key)
            if param is None:
                problems.append((key, "unexpected keyword argument"))
            elif param.kind is _P.POSITIONAL_ONLY:
                problems.append((key, "positional-only argument passed by keyword"))
            elif key in data:
                problems.append((key, "got multiple values"))
            else:
                data[key] = value
        for p in self._params:
            if p.name not in data and p.default is _P.empty:
                problems.append((p.name, "missing required argument"))
        if problems:
            raise ToolArgumentError(self.name, problems)
        return data

    # -- describing --------------------------------------------------------------------------

    def call_key(self, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> str:
        """A canonical string for (tool name, validated arguments).

        Equal for every spelling of the same call: ``f(1, k=2)``, ``f(x=1, k=2)``, ``f("1", 2)``
        when validation coerces ``"1"`` to ``1``, and calls relying on a default. It is JSON with
        sorted keys; tuples, dicts, sets, bytes and other objects are tagged with their type, so
        values that only look alike (``(1, 2)`` and ``[1, 2]``) give different keys. Dict order is
        kept (a tool may depend on it). Raises `UnkeyableArgumentsError` for a value with no JSON
        form (such a call can't be matched to an earlier one).
        """
        bound = self.bind(args, kwargs)
        canonical = {name: _canonical(self.name, name, value) for name, value in bound.items()}
        return json.dumps(
            {"tool": self.name, "args": canonical},
            sort_keys=True, separators=(",", ":"), ensure_ascii=False,
        )

    def signature_line(self) -> str:
        """One line of Python describing the tool, e.g.
        ``search(query: str, k: int = 5) -> list[str]  # Search the corpus.``"""
        parts: list[str] = []
        previous_kind = None
        for p in self._signature.parameters.values():
            if previous_kind is _P.POSITIONAL_ONLY and p.kind is not _P.POSITIONAL_ONLY:
                parts.append("/")
            if p.kind is _P.KEYWORD_ONLY and previous_kind is not _P.KEYWORD_ONLY:
                parts.append("*")
            parts.append(_parameter_text(p))
            previous_kind = p.kind
        if previous_kind is _P.POSITIONAL_ONLY:
            parts.append("/")
        line = f"{self.name}({', '.join(parts)})"
        returns = self._signature.return_annotation
        if returns is not inspect.Signature.empty:
            line += f" -> {_annotation_text(returns)}"
        if self.description:
            line += f"  # {' '.join(self.description.split())}"
        return line

    def json_schema(self) -> dict[str, Any]:
        """An OpenAI-function-style description: ``{"name", "description", "parameters"}``."""
        parameters = self._model.model_json_schema(schema_generator=_LenientJsonSchema)
        parameters.pop("title", None)
        return {"name": self.name, "description": self.description, "parameters": parameters}

    def __repr__(self) -> str:
        return (
            f"Tool({self.name!r}, speculate={self.speculate}, pure={self.pure}, "
            f"reads={sorted(self.reads)}, writes={sorted(self.writes)}, timeout={self.timeout}, "
            f"max_concurrency={self.max_concurrency}, is_async={self.is_async})"
        )


@overload
def tool(func: Callable[..., Any], /) -> Tool: ...


@overload
def tool(
    *,
    name: str | None = None,
    speculate: bool = False,
    pure: bool = False,
    reads: Iterable[str] | None = None,
    writes: Iterable[str] | None = None,
    timeout: float | None = None,
    max_concurrency: int | None = None,
    description: str | None = None,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    func: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    speculate: bool = False,
    pure: bool = False,
    reads: Iterable[str] | None = None,
    writes: Iterable[str] | None = None,
    timeout: float | None = None,
    max_concurrency: int | None = None,
    description: str | None = None,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make a sync or async function into a `Tool`; use as ``@tool`` or ``@tool(...)``.

    Effect scopes let speculation start calls earlier: ``@tool(speculate=True, pure=True)``
    (depends only on its arguments: it may start before an earlier effectful call), or
    ``@tool(speculate=True, reads={"accounts"})`` with ``@tool(writes={"accounts"})`` on the
    effectful tools (a read waits only for writes to a scope it reads). See `Tool`.
    """

    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool(
            f, name=name, speculate=speculate, pure=pure, reads=reads, writes=writes,
            timeout=timeout,
            max_concurrency=max_concurrency, description=description,
        )

    if func is None:
        return wrap
    if not callable(func):
        raise TypeError(
            f"tool() takes a function, got {type(func).__name__}; "
            "pass options by keyword: @tool(name=...)"
        )
    return wrap(func)


def _effect_scopes(name: str, speculate: bool, pure: bool, reads: Iterable[str] | None,
                   writes: Iterable[str] | None) -> tuple[frozenset[str], frozenset[str]]:
    """(reads, writes) of a tool, checked: see `Tool` and `agentrt.tools.scopes`."""
    if pure and not speculate:
        raise ToolDefinitionError(
            f"tool {name!r}: pure=True needs speculate=True (a pure tool is safe to run early)")
    if pure and (reads is not None or writes is not None):
        raise ToolDefinitionError(
            f"tool {name!r}: pure=True means it depends only on its arguments; "
            "drop reads= and writes=")
    if speculate and writes is not None:
        raise ToolDefinitionError(
            f"tool {name!r}: a speculatable tool may run early, so it must not write; "
            "drop writes= or speculate=True")
    if not speculate and reads is not None:
        raise ToolDefinitionError(
            f"tool {name!r}: reads= applies to speculatable tools only (an effectful tool "
            "never runs early); declare what it changes with writes=")
    if not speculate:
        return ALL_SCOPES, (ALL_SCOPES if writes is None else check_scopes(name, "writes", writes))
    if pure:
        return frozenset(), frozenset()
    return (ALL_SCOPES if reads is None else check_scopes(name, "reads", reads)), frozenset()


def _cancel_requested() -> bool:
    """Whether something cancelled the current task (a cancel scope, ``Task.cancel``)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _settle(outcome: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if outcome.done():  # the caller gave up
        return
    if error is not None:
        outcome.set_exception(error)
    else:
        outcome.set_result(value)


# -- building the arguments model ------------------------------------------------------------


def _arguments_model(
    tool_name: str, params: list[inspect.Parameter], fields: dict[str, str]
) -> type[BaseModel]:
    # Fields get neutral names (p0, p1, ...) with the parameter name as alias, so a parameter may
    # be called anything (``json``, ``model_config``, ``_x``) without clashing with pydantic.
    definitions: dict[str, Any] = {}
    for p in params:
        annotation = Any if p.annotation is _P.empty else p.annotation
        title = p.name.replace("_", " ").strip().title() or p.name
        if p.default is _P.empty:
            info = Field(alias=p.name, title=title)
        else:
            info = Field(p.default, alias=p.name, title=title)
        definitions[fields[p.name]] = (annotation, info)
    try:
        return create_model(
            f"{tool_name}_arguments",
            __config__=ConfigDict(extra="forbid", arbitrary_types_allowed=True),
            **definitions,
        )
    except Exception as exc:  # pydantic rejects an annotation it can't validate
        raise ToolDefinitionError(f"tool {tool_name!r}: can't build argument validation: {exc}") from exc


class _LenientJsonSchema(GenerateJsonSchema):
    """JSON schema generator that describes types with no JSON form as 'anything'."""

    def handle_invalid_for_json_schema(self, schema, error_info):  # noqa: ANN001
        return {}


def _validation_problems(exc: ValidationError) -> list[tuple[str | None, str]]:
    problems: list[tuple[str | None, str]] = []
    for error in exc.errors(include_url=False):
        loc = error.get("loc", ())
        argument = _loc_text(loc) if loc else None
        message = error.get("msg", "invalid value")
        if error.get("type") != "missing" and "input" in error:
            message += f" (got {_short_repr(error['input'])})"
        problems.append((argument, message))
    return problems


def _loc_text(loc: tuple[Any, ...]) -> str:
    text = str(loc[0])
    for part in loc[1:]:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text


def _short_repr(value: Any, limit: int = 60) -> str:
    try:
        text = repr(value)
    except Exception:  # a broken __repr__ must not hide the validation error
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- canonical keys --------------------------------------------------------------------------


def _canonical(tool_name: str, argument: str, value: Any) -> Any:
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        return value if math.isfinite(value) else {"float": repr(value)}
    if kind is list:
        return [_canonical(tool_name, argument, item) for item in value]
    if kind is tuple:
        return {"tuple": [_canonical(tool_name, argument, item) for item in value]}
    if kind is dict:
        return {"dict": [[_canonical(tool_name, argument, k), _canonical(tool_name, argument, v)]
                         for k, v in value.items()]}
    if kind in (set, frozenset):
        items = [_canonical(tool_name, argument, item) for item in value]
        return {kind.__name__: sorted(items, key=_dump_sorted)}
    if kind in (bytes, bytearray):
        return {kind.__name__: value.hex()}
    try:
        data = to_jsonable_python(value)
    except PydanticSerializationError as exc:
        raise UnkeyableArgumentsError(
            f"{tool_name}(): argument {argument!r}: a {kind.__name__} value has no canonical form"
        ) from exc
    return {"object": f"{kind.__module__}.{kind.__qualname__}", "value": data}


def _dump_sorted(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


# -- small helpers ---------------------------------------------------------------------------


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise ToolDefinitionError(
            f"tool name must be a Python identifier that is not a keyword, got {name!r}"
        )
    return name


def _check_timeout(name: str, timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ToolDefinitionError(
            f"tool {name!r}: timeout must be a number > 0 (math.inf: no limit) or None, "
            f"got {timeout!r}")
    return float(timeout)


def _check_max_concurrency(name: str, limit: int | None) -> int | None:
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ToolDefinitionError(
            f"tool {name!r}: max_concurrency must be an int >= 1 or None, got {limit!r}"
        )
    return limit


def _signature(name: str, func: Callable[..., Any]) -> inspect.Signature:
    """The function's signature with every annotation resolved to a type."""
    try:
        signature = inspect.signature(func, eval_str=True)
        # A quoted annotation under ``from __future__ import annotations`` is still a string here.
        scope = getattr(inspect.unwrap(func), "__globals__", {})
        params = [
            p.replace(annotation=_evaluate(p.annotation, scope)) for p in signature.parameters.values()
        ]
        return signature.replace(
            parameters=params, return_annotation=_evaluate(signature.return_annotation, scope)
        )
    except (NameError, SyntaxError) as exc:
        raise ToolDefinitionError(
            f"tool {name!r}: can't resolve its type hints: {exc} (types used in a tool's "
            "annotations must be importable from its module)"
        ) from exc
    except (TypeError, ValueError) as exc:
        raise ToolDefinitionError(f"tool {name!r}: can't read its signature: {exc}") from exc


def _evaluate(annotation: Any, scope: dict[str, Any]) -> Any:
    for _ in range(3):
        if not isinstance(annotation, str):
            break
        annotation = eval(annotation, scope)  # noqa: S307 - a type hint written by the tool's author
    return annotation


def _is_async(func: Callable[..., Any]) -> bool:
    if isinstance(func, Tool):
        return func.is_async
    if inspect.iscoroutinefunction(func):
        return True
    # An object whose class defines ``async def __call__``.
    call = getattr(type(func), "__call__", None)  # noqa: B004 - not a callable() test
    return not inspect.isroutine(func) and inspect.iscoroutinefunction(call)


def _first_paragraph(doc: str | None) -> str:
    if not doc:
        return ""
    paragraph = doc.strip().split("\n\n", 1)[0]
    return " ".join(paragraph.split())


def _parameter_text(p: inspect.Parameter) -> str:
    text = p.name
    if p.annotation is not _P.empty:
        text += f": {_annotation_text(p.annotation)}"
        if p.default is not _P.empty:
            text += f" = {p.default!r}"
    elif p.default is not _P.empty:
        text += f"={p.default!r}"
    return text


def _annotation_text(annotation: Any) -> str:
    if isinstance(annotation, str):
        return annotation
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    if isinstance(annotation, type) and not get_args(annotation):
        return annotation.__qualname__
    return inspect.formatannotation(annotation)


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
