"""The Python policy: the restricted compiler and the guards every cell's code goes through.

:func:`compile_cell` parses a cell and compiles it with RestrictedPython's
``compile_restricted_exec`` (plus annotated assignments, ``nonlocal`` and ``super().__init__``),
so every attribute read goes through ``_getattr_``, every subscript through ``_getitem_``, every
write through ``_write_``, and names starting with ``_`` are refused at compile time; then opens
the doors (doors.py: every other value a cell binds passes admission). Here too: the name check
every attribute access goes through and the sandbox's one-argument ``type`` (the guards with
state are in guards.py).
"""

from __future__ import annotations

import ast
import re
import types
from typing import Any

from RestrictedPython import compile_restricted_exec
from RestrictedPython.transformer import (
    INSPECT_ATTRIBUTES,
    RestrictingNodeTransformer,
    copy_locations,
)

from agentrt.errors import AgentrtError

from .doors import open_doors

SANDBOX_MODULE_NAME = "__sandbox__"
"""``__name__`` of the sandbox namespace, hence ``__module__`` of classes defined in it."""

MISSING: Any = object()
"""Marks an argument that was not given."""


# --------------------------------------------------------------------------- compile

class SandboxSyntaxError(AgentrtError):
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

    def visit_Module(self, node: ast.Module) -> ast.AST:
        """RestrictedPython's rewrite, then the doors (doors.py): every value cell code can
        bind passes admission."""
        node = super().visit_Module(node)
        return open_doors(node) if not self.errors else node

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


class _SandboxTypeMeta(type):
    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, type)

    def __subclasscheck__(cls, sub: Any) -> bool:
        return isinstance(sub, type) and issubclass(sub, type)

    def __repr__(cls) -> str:
        return "<class 'type'>"


class SandboxType(metaclass=_SandboxTypeMeta):
    """The sandbox's ``type``: one argument only, and what it answers is admitted (a
    metaclass reads as this ``type`` itself). Each sandbox has a subclass of its own
    (`sandbox_type`) that admits with its admission, so that ``type()`` called anywhere (in
    cell code, or by ``map`` in C) hands out only what the sandbox may hold.

    ``type(name, bases, dict)`` would build classes with arbitrary dunder methods, which
    the restricted compiler otherwise forbids; ``class`` statements remain available.
    """

    __slots__ = ()
    _admit_class: Any = None

    def __new__(cls, *args: Any) -> Any:  # noqa: D102
        if len(args) != 1:
            raise TypeError(
                "type() takes exactly one argument in the sandbox; "
                "use a class statement to define classes")
        if cls._admit_class is None:
            raise TypeError("type() is not bound to a sandbox")
        return cls._admit_class(type(args[0]))


def sandbox_type(admit_class: Any) -> type:
    """The ``type`` of one sandbox: ``type(x)`` is ``admit_class(real type of x)``."""
    return _SandboxTypeMeta("type", (SandboxType,), {
        "__slots__": (), "__module__": "builtins", "__qualname__": "type",
        "_admit_class": staticmethod(admit_class)})


def is_sandbox_type(obj: Any) -> bool:
    """Whether ``obj`` is a sandbox's ``type`` (by its metaclass, not by what it answers)."""
    return type(obj) is _SandboxTypeMeta
