"""The Python policy: the restricted compiler and the guards every cell's code goes through.

:func:`compile_cell` parses a cell and compiles it with RestrictedPython's
``compile_restricted_exec`` (plus annotated assignments, ``nonlocal`` and ``super().__init__``),
so every attribute read goes through ``_getattr_``, every subscript through ``_getitem_``, every
write through ``_write_``, and names starting with ``_`` are refused at compile time. The guards
below are what those hooks call; they hold no state.
"""

from __future__ import annotations

import _string  # type: ignore[import-not-found]
import abc
import ast
import collections
import decimal
import functools
import io
import operator
import re
import string
import types
from collections.abc import Callable
from typing import Any, Final

from RestrictedPython import compile_restricted_exec
from RestrictedPython.transformer import (
    INSPECT_ATTRIBUTES,
    RestrictingNodeTransformer,
    copy_locations,
)

SANDBOX_MODULE_NAME = "__sandbox__"
"""``__name__`` of the sandbox namespace, hence ``__module__`` of classes defined in it."""

MISSING: Any = object()
"""Marks an argument that was not given."""


# --------------------------------------------------------------------------- compile

class SandboxSyntaxError(Exception):
    """A cell failed to parse or was refused by the restricted compiler."""

    def __init__(self, message: str, lineno: int | None) -> None:
        super().__init__(message)
        self.lineno = lineno


class SandboxPolicy(RestrictingNodeTransformer):
    """RestrictedPython's policy, plus annotated assignments, ``nonlocal`` and
    ``super().__init__``.

    The first two only bind names (checked like any other). ``x.__init__`` compiles to a
    guarded lookup that succeeds only on ``super()`` objects.
    """

    def visit_Attribute(self, node: ast.Attribute) -> ast.AST:
        if node.attr == "__init__" and isinstance(node.ctx, ast.Load):
            node = self.node_contents_visit(node)
            lookup = ast.Call(func=ast.Name("_getattr_", ast.Load()),
                              args=[node.value, ast.Constant("__init__")], keywords=[])
            copy_locations(lookup, node)
            return lookup
        return super().visit_Attribute(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> ast.AST:
        return self.node_contents_visit(node)

    def visit_Nonlocal(self, node: ast.Nonlocal) -> ast.AST:
        for name in node.names:
            self.check_name(node, name)
        return self.node_contents_visit(node)


_RP_LINE_PREFIX = re.compile(r"^Line (\d+|None): (.*)$", re.DOTALL)


def compile_cell(source: str, filename: str) -> types.CodeType:
    """Compile ``source`` in restricted exec mode or raise :class:`SandboxSyntaxError`."""
    lines = source.splitlines()
    try:
        tree = ast.parse(source, filename, "exec")
    except SyntaxError as exc:
        raise SandboxSyntaxError(
            _syntax_message(exc.msg, exc.lineno, lines), exc.lineno) from None
    result = compile_restricted_exec(tree, filename, policy=SandboxPolicy)
    if result.errors:
        messages, first_line = [], None
        for error in result.errors[:5]:
            match = _RP_LINE_PREFIX.match(error)
            lineno = int(match.group(1)) if match and match.group(1) != "None" else None
            text = match.group(2) if match else error
            first_line = first_line if first_line is not None else lineno
            messages.append(_syntax_message(text.rstrip("."), lineno, lines))
        if len(result.errors) > 5:
            messages.append(f"... and {len(result.errors) - 5} more")
        raise SandboxSyntaxError("\n".join(messages), first_line)
    return result.code


def _syntax_message(message: str, lineno: int | None, lines: list[str]) -> str:
    if lineno is None:
        return message
    text = f"{message} (line {lineno})"
    if 0 < lineno <= len(lines) and lines[lineno - 1].strip():
        text += f"\n    {lines[lineno - 1].strip()}"
    return text


# --------------------------------------------------------------------------- guards

FORBIDDEN_ATTRIBUTES = frozenset(INSPECT_ATTRIBUTES) | frozenset({
    "f_back", "f_builtins", "f_code", "f_globals", "f_locals", "f_trace", "f_generator",
    "tb_frame", "tb_next", "gi_frame", "gi_code", "gi_yieldfrom", "cr_frame", "cr_code",
    "cr_await", "cr_origin", "ag_frame", "ag_code", "ag_await", "mro",
})
"""Attribute names refused on every object (interpreter internals reachable without ``_``)."""

_FORBIDDEN_PREFIXES = ("co_", "func_", "im_")
_FORBIDDEN_RESULT_TYPES = (types.ModuleType, types.FrameType, types.CodeType, types.TracebackType)


def check_attribute_name(obj: Any, name: Any) -> None:
    """Raise if the sandbox may not read attribute ``name`` (of ``obj``)."""
    if type(name) is not str:
        raise TypeError("attribute name must be a string")
    if name.startswith("_"):
        raise AttributeError(
            f'"{name}" is not accessible in the sandbox: names starting with "_" are private')
    if name in FORBIDDEN_ATTRIBUTES or name.startswith(_FORBIDDEN_PREFIXES):
        raise AttributeError(f'"{name}" is not accessible in the sandbox (interpreter internals)')
    if name == "obj" and isinstance(obj, BaseException):
        raise AttributeError('"obj" of an exception is not accessible in the sandbox')


class _SafeFormatter(string.Formatter):
    """``str.format`` whose field lookups (``{0.attr}``, ``{0[key]}``) go through the guards."""

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> tuple[Any, Any]:
        first, rest = _string.formatter_field_name_split(field_name)
        obj = self.get_value(first, args, kwargs)
        for is_attribute, key in rest:
            obj = guarded_getattr(obj, key) if is_attribute else guarded_getitem(obj, key)
        return obj, first


def _safe_format(template: str, /, *args: Any, **kwargs: Any) -> str:
    if not isinstance(template, str):
        raise TypeError("format() needs a str template")
    return _SafeFormatter().vformat(template, args, kwargs)


def _safe_format_map(template: str, mapping: Any, /) -> str:
    if not isinstance(template, str):
        raise TypeError("format_map() needs a str template")
    return _SafeFormatter().vformat(template, (), mapping)


_STR_METHOD_OVERRIDES: Final = {"format": _safe_format, "format_map": _safe_format_map}
_RAW_STR_FORMAT: Final = {str.format: _safe_format, str.format_map: _safe_format_map}


def guarded_getattr(obj: Any, name: str, default: Any = MISSING) -> Any:
    """``getattr`` for sandboxed code: refuses private and internal attributes, ``__init__``
    except on ``super()`` of an object the sandbox made, and ABC registration."""
    if name == "__init__" and type(obj) is super:
        if not defined_in_sandbox(obj.__self__) or isinstance(obj.__self__, type):
            raise AttributeError("super().__init__ is available only on objects of classes "
                                 "defined in the sandbox")
        return obj.__init__
    check_attribute_name(obj, name)
    if name == "register" and isinstance(obj, abc.ABCMeta):
        raise AttributeError(f"{obj.__name__}.register() is not available in the sandbox (it "
                             "changes what isinstance() answers for everyone)")
    if name in _STR_METHOD_OVERRIDES:
        if isinstance(obj, str):
            return functools.partial(_STR_METHOD_OVERRIDES[name], obj)
        if isinstance(obj, type) and issubclass(obj, str):
            return _STR_METHOD_OVERRIDES[name]
    try:
        value = getattr(obj, name)
    except AttributeError:
        if default is MISSING:
            raise
        return default
    if isinstance(value, _FORBIDDEN_RESULT_TYPES):
        raise AttributeError(
            f'"{name}" is a {type(value).__name__} object, which the sandbox may not access')
    if name == "getbuffer" and isinstance(obj, io.BytesIO):
        raise AttributeError('"getbuffer" is not accessible in the sandbox (no raw memory access)')
    return _without_raw_format(value)


def _without_raw_format(value: Any) -> Any:
    """``value``, unless it is the raw ``str.format``/``format_map`` (reached e.g. through
    ``super()`` in a ``str`` subclass): then the guarded version."""
    if type(value) is types.BuiltinMethodType and isinstance(value.__self__, str) \
            and value.__name__ in _STR_METHOD_OVERRIDES:
        return functools.partial(_STR_METHOD_OVERRIDES[value.__name__], value.__self__)
    try:
        return _RAW_STR_FORMAT.get(value, value)
    except TypeError:  # unhashable
        return value


def guarded_hasattr(obj: Any, name: str) -> bool:
    """``hasattr`` that answers through :func:`guarded_getattr`."""
    try:
        guarded_getattr(obj, name)
    except (AttributeError, TypeError):
        return False
    return True


def guarded_getitem(obj: Any, key: Any) -> Any:
    """``obj[key]`` (subscripts reach no interpreter internals)."""
    return obj[key]


_WRITABLE_TYPES = (list, dict, set, bytearray, collections.deque, decimal.Context)


def defined_in_sandbox(obj: Any) -> bool:
    """Whether ``obj`` is a function, a class or an instance of a class the sandbox defined."""
    if isinstance(obj, types.FunctionType):
        return obj.__module__ == SANDBOX_MODULE_NAME
    cls = obj if isinstance(obj, type) else type(obj)
    return getattr(cls, "__module__", None) == SANDBOX_MODULE_NAME


def writable(obj: Any) -> bool:
    """Whether sandboxed code may write items or attributes of ``obj``."""
    return isinstance(obj, _WRITABLE_TYPES) or defined_in_sandbox(obj)


def guarded_write(obj: Any) -> Any:
    """Allow item/attribute writes on containers and on things defined in the sandbox."""
    if writable(obj):
        return obj
    raise TypeError(
        f"cannot modify {type(obj).__name__!r} objects in the sandbox (only lists, dicts, "
        "sets and objects of classes defined in the sandbox can be changed)")


def guarded_setattr(obj: Any, name: str, value: Any) -> None:
    """``setattr`` for sandboxed code."""
    check_attribute_name(obj, name)
    setattr(guarded_write(obj), name, value)


def guarded_delattr(obj: Any, name: str) -> None:
    """``delattr`` for sandboxed code."""
    check_attribute_name(obj, name)
    delattr(guarded_write(obj), name)


_INPLACE_OPERATORS: Final[dict[str, Callable[[Any, Any], Any]]] = {
    "+=": operator.iadd, "-=": operator.isub, "*=": operator.imul, "/=": operator.itruediv,
    "//=": operator.ifloordiv, "%=": operator.imod, "**=": operator.ipow,
    "<<=": operator.ilshift, ">>=": operator.irshift, "|=": operator.ior,
    "^=": operator.ixor, "&=": operator.iand, "@=": operator.imatmul,
}


def guarded_inplacevar(op: str, target: Any, value: Any) -> Any:
    """``target op= value`` for plain names."""
    return _INPLACE_OPERATORS[op](target, value)


def guarded_apply(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Calls written with ``*args`` / ``**kwargs``."""
    return function(*args, **kwargs)


class _SandboxTypeMeta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, type)

    def __subclasscheck__(cls, sub: Any) -> bool:
        return isinstance(sub, type) and issubclass(sub, type)

    def __repr__(cls) -> str:
        return "<class 'type'>"


class SandboxType(metaclass=_SandboxTypeMeta):
    """The sandbox's ``type``: one argument only, and metaclasses read as ``type`` itself.

    ``type(name, bases, dict)`` would build classes with arbitrary dunder methods, which
    the restricted compiler otherwise forbids; ``class`` statements remain available.
    """

    def __new__(cls, *args: Any) -> Any:  # noqa: D102
        if len(args) != 1:
            raise TypeError(
                "type() takes exactly one argument in the sandbox; "
                "use a class statement to define classes")
        result = type(args[0])
        return SandboxType if issubclass(result, type) else result
