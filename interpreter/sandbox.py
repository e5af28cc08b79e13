"""Restricted execution of model-written Python inside a worker process.

The pieces, in the order code meets them:

* :func:`compile_cell` parses a cell and compiles it with RestrictedPython's
  ``compile_restricted_exec`` (plus annotated assignments and ``nonlocal``), so every
  attribute read goes through ``_getattr_``, every subscript through ``_getitem_``, every
  write through ``_write_`` and names starting with ``_`` are refused at compile time.
* :func:`make_builtins` builds the only builtins a cell sees: a curated safe set, guarded
  ``getattr``/``setattr``/``type``/``dir``, an ``__import__`` limited to
  :data:`ALLOWED_MODULES` (served as read-only facades), and the guard functions.
* :class:`Sandbox` holds one persistent namespace and runs cells in it, capturing ``print``
  into a capped buffer and recording ``FINAL`` / ``FINAL_VAR`` answers.

This is the first of two walls; the worker process around it adds CPU, memory and
wall-clock limits, a fork per cell, and the OS jail (jail.py) that holds when this layer is
bypassed (see docs/sandbox.md).
"""

from __future__ import annotations

import _string  # type: ignore[import-not-found]
import abc
import ast
import builtins
import collections
import copy as _copy_module
import dataclasses as _dataclasses_module
import decimal
import enum
import functools
import importlib
import io
import keyword
import operator
import pprint as _pprint_module
import re
import reprlib
import string
import sys
import types
import typing as typing_module
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from RestrictedPython import compile_restricted_exec
from RestrictedPython.Guards import guarded_iter_unpack_sequence, guarded_unpack_sequence
from RestrictedPython.transformer import (
    INSPECT_ATTRIBUTES,
    RestrictingNodeTransformer,
    copy_locations,
)

from agentrt.tools.errors import ToolError

from .protocol import NotPlainDataError, to_plain

SANDBOX_MODULE_NAME = "__sandbox__"
"""``__name__`` of the sandbox namespace, hence ``__module__`` of classes defined in it."""

MAX_TRACEBACK_FRAMES = 8
MAX_ERROR_MESSAGE_CHARS = 2000


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


_FORMATTER = _SafeFormatter()


def _safe_format(template: str, /, *args: Any, **kwargs: Any) -> str:
    if not isinstance(template, str):
        raise TypeError("format() needs a str template")
    return _FORMATTER.vformat(template, args, kwargs)


def _safe_format_map(template: str, mapping: Any, /) -> str:
    if not isinstance(template, str):
        raise TypeError("format_map() needs a str template")
    return _FORMATTER.vformat(template, (), mapping)


_STR_METHOD_OVERRIDES = {"format": _safe_format, "format_map": _safe_format_map}
_MISSING = object()


def guarded_getattr(obj: Any, name: str, default: Any = _MISSING) -> Any:
    """``getattr`` for sandboxed code: refuses private and internal attributes, ``__init__``
    except on ``super()`` of an object the sandbox made, and ABC registration."""
    if name == "__init__" and type(obj) is super:
        if not _defined_in_sandbox(obj.__self__) or isinstance(obj.__self__, type):
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
        if default is _MISSING:
            raise
        return default
    if isinstance(value, _FORBIDDEN_RESULT_TYPES):
        raise AttributeError(
            f'"{name}" is a {type(value).__name__} object, which the sandbox may not access')
    if name == "getbuffer" and isinstance(obj, io.BytesIO):
        raise AttributeError('"getbuffer" is not accessible in the sandbox (no raw memory access)')
    return _without_raw_format(value)


_RAW_STR_FORMAT = {str.format: _safe_format, str.format_map: _safe_format_map}


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


_SANDBOX_CLASSES: weakref.WeakSet[type] = weakref.WeakSet()
"""Classes made by the sandbox: ``class`` statements and the vetted class factories."""


def _made_class(cls: Any) -> Any:
    """Record ``cls`` as made by the sandbox; returns it."""
    if isinstance(cls, type):
        _SANDBOX_CLASSES.add(cls)
    return cls


def _build_class(function: Any, name: str, *bases: Any, **options: Any) -> Any:
    """The ``class`` statement (``__build_class__``), recording what it makes."""
    return _made_class(builtins.__build_class__(function, name, *bases, **options))


def _defined_in_sandbox(obj: Any) -> bool:
    if isinstance(obj, types.FunctionType):
        return obj.__module__ == SANDBOX_MODULE_NAME
    cls = obj if isinstance(obj, type) else type(obj)
    return getattr(cls, "__module__", None) == SANDBOX_MODULE_NAME


def _writable(obj: Any) -> bool:
    return isinstance(obj, _WRITABLE_TYPES) or _defined_in_sandbox(obj)


def guarded_write(obj: Any) -> Any:
    """Allow item/attribute writes on containers and on things defined in the sandbox."""
    if _writable(obj):
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


_INPLACE_OPERATORS: dict[str, Callable[[Any, Any], Any]] = {
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


# --------------------------------------------------------------------------- modules

ALLOWED_MODULES = frozenset({
    "base64", "binascii", "bisect", "cmath", "collections", "collections.abc", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "enum", "fractions", "functools",
    "hashlib", "heapq", "html", "io", "itertools", "json", "math", "numbers", "operator",
    "pprint", "random", "re", "statistics", "string", "textwrap", "time", "typing",
    "unicodedata",
})
"""Modules ``import`` may load. All are pure computation; see docs/sandbox.md for why."""


def _safe_attrgetter(*names: str) -> Callable[[Any], Any]:
    for name in names:
        for part in str(name).split("."):
            check_attribute_name(None, part)

    def resolve(obj: Any, dotted: str) -> Any:
        for part in dotted.split("."):
            obj = guarded_getattr(obj, part)
        return obj

    if len(names) == 1:
        return lambda obj: resolve(obj, names[0])
    return lambda obj: tuple(resolve(obj, name) for name in names)


def _safe_methodcaller(name: str, /, *args: Any, **kwargs: Any) -> Callable[[Any], Any]:
    check_attribute_name(None, name)
    return lambda obj: guarded_getattr(obj, name)(*args, **kwargs)


def check_field_names(names: Any, what: str, allowed: tuple[str, ...] = ()) -> None:
    """Raise unless every name is a public identifier (class factories put names into
    generated source or set them as attributes)."""
    for name in names:
        if name in allowed:
            continue
        if type(name) is not str or not name.isidentifier() or keyword.iskeyword(name) \
                or name.startswith("_"):
            raise TypeError(f"{what}: {name!r} is not allowed in the sandbox (names must be "
                            "identifiers that do not start with '_')")


def _safe_update_wrapper(wrapper: Any, wrapped: Any,
                         assigned: Any = functools.WRAPPER_ASSIGNMENTS,
                         updated: Any = functools.WRAPPER_UPDATES) -> Any:
    """``functools.update_wrapper`` onto a function or instance defined in the sandbox,
    copying only strings, public annotations and public attributes."""
    if (tuple(assigned), tuple(updated)) != (functools.WRAPPER_ASSIGNMENTS,
                                             functools.WRAPPER_UPDATES):
        raise ValueError("custom 'assigned'/'updated' attributes are not supported in the sandbox")
    if isinstance(wrapper, type) or not _defined_in_sandbox(wrapper):
        raise TypeError("functools.update_wrapper: the wrapper must be a function or an "
                        "instance defined in the sandbox")
    for name in ("__module__", "__name__", "__qualname__", "__doc__"):
        value = getattr(wrapped, name, None)
        if type(value) is str or (name == "__doc__" and value is None):
            setattr(wrapper, name, value)
    annotations = getattr(wrapped, "__annotations__", None)
    if isinstance(annotations, dict):
        check_field_names(list(annotations), "functools.update_wrapper", allowed=("return",))
        wrapper.__annotations__ = dict(annotations)
    extra = getattr(wrapped, "__dict__", None)
    if isinstance(extra, dict):
        for name, value in list(extra.items()):
            if type(name) is str and name.isidentifier() and not name.startswith("_"):
                setattr(wrapper, name, value)
    wrapper.__wrapped__ = wrapped
    return wrapper


def _safe_wraps(wrapped: Any, assigned: Any = functools.WRAPPER_ASSIGNMENTS,
                updated: Any = functools.WRAPPER_UPDATES) -> Callable[[Any], Any]:
    return lambda wrapper: _safe_update_wrapper(wrapper, wrapped, assigned, updated)


def _writing_to_argument(function: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a decorator that sets attributes on its argument: only on sandbox objects."""

    @functools.wraps(function)
    def decorate(target: Any, *args: Any, **kwargs: Any) -> Any:
        return function(guarded_write(target), *args, **kwargs)

    return decorate


_NEUTRAL_BASES = frozenset({object, typing_module.Generic})


def _check_dataclass_fields(target: type) -> None:
    """Raise unless every class ``target`` derives from was made by the sandbox and every
    field ``dataclass`` would read (its own annotations, every base's dataclass fields) has a
    public identifier for a name: dataclasses writes source code from them."""
    for cls in target.__mro__:
        if cls in _NEUTRAL_BASES or cls.__module__ == "builtins":
            continue  # carry no dataclass fields
        if cls not in _SANDBOX_CLASSES:
            raise TypeError(f"dataclass(): {cls.__qualname__!r} was not defined in the sandbox")
        namespace = type.__dict__["__dict__"].__get__(cls)
        annotations = namespace.get("__annotations__", {})
        fields = namespace.get("__dataclass_fields__", {})
        if type(annotations) is not dict or type(fields) is not dict:
            raise TypeError(f"dataclass(): {cls.__qualname__!r} has crafted annotations")
        check_field_names(dict.keys(annotations), "dataclass field")
        for key, field in dict.items(fields):
            if type(field) is not _dataclasses_module.Field or field.name != key:
                raise TypeError(f"dataclass(): {cls.__qualname__!r} has crafted fields")
            check_field_names([key], "dataclass field")


def _safe_dataclass(cls: Any = None, /, **options: Any) -> Any:
    """``dataclasses.dataclass`` for classes made by the sandbox (bases included) whose fields,
    inherited ones too, have public identifiers for names."""

    def wrap(target: Any) -> Any:
        if not isinstance(target, type):
            raise TypeError("dataclass() applies only to classes defined in the sandbox")
        _check_dataclass_fields(target)
        return _made_class(_dataclasses_module.dataclass(target, **options))

    return wrap if cls is None else wrap(cls)


class _CheckedReconstruct:
    """``copy``'s reconstruction step, refusing what only an attack needs: a reduction that
    rebuilds a class, module or function, state that sets dunder attributes, and writes (state,
    items) into an object the sandbox did not make, unless it is a new copy of the very object
    being copied (a stdlib object's own reduction)."""

    def __init__(self, real: Callable[..., Any]) -> None:
        self.real = real

    def __call__(self, x: Any, memo: Any, func: Any, args: Any, state: Any = None,
                 listiter: Any = None, dictiter: Any = None, *rest: Any, **kwargs: Any) -> Any:
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):
            for key in state[1]:
                if type(key) is not str or (key.startswith("__") and key.endswith("__")):
                    raise TypeError(f"copy: refusing to set attribute {key!r} in the sandbox")
        writes = state is not None or listiter is not None or dictiter is not None

        def build(*build_args: Any, **build_kwargs: Any) -> Any:
            made = func(*build_args, **build_kwargs)
            if isinstance(made, (type, types.ModuleType, types.FunctionType,
                                 types.BuiltinFunctionType, types.MethodType)):
                raise TypeError("copy: this object's reduction rebuilds a class, module or "
                                "function, which the sandbox refuses")
            fresh_copy = type(made) is type(x) and made is not x
            if writes and not fresh_copy and not _writable(made):
                raise TypeError(f"copy: this object's reduction writes into a "
                                f"{type(made).__name__!r} object the sandbox did not make")
            return made

        return self.real(x, memo, build, args, state, listiter, dictiter, *rest, **kwargs)


def _with_checked_copy(function: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``function`` (copy.copy, deepcopy, dataclasses.asdict...) with the checked
    reconstruction step (workers are single-threaded, so swapping it is safe)."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        real = _copy_module._reconstruct
        if isinstance(real, _CheckedReconstruct):
            return function(*args, **kwargs)
        _copy_module._reconstruct = _CheckedReconstruct(real)
        try:
            return function(*args, **kwargs)
        finally:
            _copy_module._reconstruct = real

    return call


def _safe_namedtuple(typename: str, field_names: Any, *, rename: bool = False,
                     defaults: Any = None, module: Any = None) -> type:
    """``collections.namedtuple``, always owned by the sandbox (no ``module=``)."""
    if module is not None:
        raise ValueError("namedtuple(module=...) is not supported in the sandbox")
    return _made_class(collections.namedtuple(typename, field_names, rename=rename,
                                              defaults=defaults, module=SANDBOX_MODULE_NAME))


def _member_names(names: Any) -> tuple[Any, list[Any]]:
    """A stable copy of an Enum functional-API ``names`` argument and the names in it."""
    if isinstance(names, str):
        return names, names.replace(",", " ").split()
    if isinstance(names, Mapping):
        names = dict(names)
        return names, list(names)
    names = list(names)
    return names, [item if isinstance(item, str) else tuple(item)[0] for item in names]


def _sandbox_enum(base: type) -> type:
    """A subclass of enum class ``base`` whose functional API (``Enum('E', names)``)
    refuses private and dunder names, which would become arbitrary class attributes."""

    def create(cls: Any, class_name: Any, names: Any, **options: Any) -> Any:
        names, keys = _member_names(names)
        check_field_names(keys, "Enum member name")
        if options.get("module") is None:
            options["module"] = SANDBOX_MODULE_NAME
        return _made_class(real_create.__func__(cls, class_name, names, **options))

    real_create = base._create_
    safe = types.new_class(base.__name__, (base,), exec_body=lambda ns: ns.update(
        {"__module__": base.__module__, "__qualname__": base.__qualname__}))
    safe._create_ = classmethod(create)
    return safe


def _safe_dataclass_transform(**options: Any) -> Callable[[Any], Any]:
    """``typing.dataclass_transform``: its decorator marks only objects the sandbox made."""
    return _writing_to_argument(typing_module.dataclass_transform(**options))


def _reveal_type(obj: Any, /) -> Any:
    """``typing.reveal_type``, printing to the cell's output instead of stderr."""
    write_output(f"Runtime type is {type(obj).__name__!r}\n")
    return obj


def _sandbox_pprint(obj: Any, *args: Any, **kwargs: Any) -> None:
    kwargs.pop("stream", None)
    write_output(_pprint_module.pformat(obj, *args, **kwargs) + "\n")


@dataclass(frozen=True)
class _ModuleRule:
    only: tuple[str, ...] = ()
    deny: frozenset[str] = frozenset()
    replace: Mapping[str, Any] | None = None
    plain_results: bool = False
    """Its functions return only numbers, strings and containers of what they were given, so
    their results need no check (kept fast and identical: the shadow knows ``json.dumps``)."""


_SANDBOX_ENUMS = {name: _sandbox_enum(getattr(enum, name))
                  for name in ("Enum", "IntEnum", "Flag", "IntFlag", "StrEnum")
                  if hasattr(enum, name)}

_MODULE_RULES: dict[str, _ModuleRule] = {
    "typing": _ModuleRule(
        deny=frozenset({"get_type_hints", "ForwardRef"}),  # both eval strings
        replace={"reveal_type": _reveal_type, "dataclass_transform": _safe_dataclass_transform,
                 **{name: _writing_to_argument(getattr(typing_module, name))
                    for name in ("final", "no_type_check", "runtime_checkable")}}),
    "json": _ModuleRule(plain_results=True),
    "math": _ModuleRule(plain_results=True),
    "cmath": _ModuleRule(plain_results=True),
    "functools": _ModuleRule(
        deny=frozenset({"singledispatch", "singledispatchmethod"}),  # register() evals hints
        replace={"update_wrapper": _safe_update_wrapper, "wraps": _safe_wraps,
                 "total_ordering": _writing_to_argument(functools.total_ordering)}),
    "copy": _ModuleRule(replace={"copy": _with_checked_copy(_copy_module.copy),
                                 "deepcopy": _with_checked_copy(_copy_module.deepcopy)}),
    "operator": _ModuleRule(
        replace={"attrgetter": _safe_attrgetter, "methodcaller": _safe_methodcaller}),
    "string": _ModuleRule(deny=frozenset({"Formatter"})),
    "collections": _ModuleRule(deny=frozenset({"UserString"}),  # .format() is raw str.format
                               replace={"namedtuple": _safe_namedtuple}),
    "enum": _ModuleRule(deny=frozenset({"global_enum", "global_enum_repr", "global_flag_repr",
                                        "global_str", "EnumMeta", "EnumType", "ReprEnum"}),
                        replace=_SANDBOX_ENUMS),
    "dataclasses": _ModuleRule(
        deny=frozenset({"make_dataclass"}),
        replace={"dataclass": _safe_dataclass,
                 "asdict": _with_checked_copy(_dataclasses_module.asdict),
                 "astuple": _with_checked_copy(_dataclasses_module.astuple)}),
    "time": _ModuleRule(only=("sleep", "time", "time_ns", "monotonic", "monotonic_ns",
                              "perf_counter", "perf_counter_ns", "gmtime", "localtime",
                              "strftime", "mktime", "struct_time")),
    "io": _ModuleRule(only=("StringIO", "BytesIO")),
    "pprint": _ModuleRule(only=("pformat", "saferepr", "isreadable", "isrecursive"),
                          replace={"pprint": _sandbox_pprint, "pp": _sandbox_pprint}),
    "html": _ModuleRule(only=("escape", "unescape")),
}
_MUTABLE_MODULE_VALUES = (types.ModuleType, dict, list, set, bytearray)
_FUNCTION_TYPES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType)
_REFUSED_RESULTS = (types.ModuleType, types.FrameType, types.CodeType, types.TracebackType,
                    typing_module.ForwardRef)


def sandbox_value(value: Any, *, nested: bool = False) -> Any:
    """What a facade function returned, as the sandbox may hold it: the real ``type`` and
    other metaclasses become the sandbox's ``type``; modules, frames, code, tracebacks and
    ``ForwardRef`` (which stdlib code evaluates) are refused; tuples, and lists inside them,
    are mapped item by item."""
    if isinstance(value, type):
        return SandboxType if issubclass(value, type) else value
    kind = type(value)
    if kind is tuple or (nested and kind is list):
        mapped = [sandbox_value(item, nested=True) for item in value]
        return tuple(mapped) if kind is tuple else mapped
    if isinstance(value, _REFUSED_RESULTS):
        raise TypeError(f"this call returned a {kind.__name__} object, which the sandbox may "
                        "not hold")
    return value


def _checked_results(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` with its results passed through :func:`sandbox_value`."""

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        return sandbox_value(function(*args, **kwargs))

    return call


class SandboxModule:
    """A read-only view of an allowed module: only its vetted public attributes."""

    __slots__ = ("_name", "_attributes")

    def __init__(self, name: str, attributes: dict[str, Any]) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_attributes", attributes)

    def __getattr__(self, name: str) -> Any:
        try:
            return self._attributes[name]
        except KeyError:
            raise AttributeError(
                f"module {self._name!r} has no attribute {name!r} in the sandbox") from None

    def __setattr__(self, name: str, value: Any) -> None:
        raise TypeError(f"module {self._name!r} is read-only in the sandbox")

    __delattr__ = __setattr__  # type: ignore[assignment]

    def __dir__(self) -> list[str]:
        return sorted(self._attributes)

    def __repr__(self) -> str:
        return f"<module {self._name!r} (sandbox)>"


_FACADES: dict[str, SandboxModule] = {}


def module_facade(name: str) -> SandboxModule:
    """The sandbox view of allowed module ``name`` (built once per process)."""
    if name in _FACADES:
        return _FACADES[name]
    if name not in ALLOWED_MODULES:
        raise ImportError(f"module {name!r} is not available in the sandbox")
    module = importlib.import_module(name)
    rule = _MODULE_RULES.get(name, _ModuleRule())
    names = rule.only or getattr(module, "__all__", None) or list(vars(module))
    attributes: dict[str, Any] = {}
    for attr in names:
        if attr.startswith("_") or attr in rule.deny:
            continue
        value = getattr(module, attr, _MISSING)
        if value is _MISSING or isinstance(value, _MUTABLE_MODULE_VALUES):
            continue
        if isinstance(value, _FUNCTION_TYPES) and not rule.plain_results:
            value = _checked_results(value)
        attributes[attr] = value
    attributes.update(rule.replace or {})
    prefix = name + "."
    for submodule in ALLOWED_MODULES:
        if submodule.startswith(prefix) and "." not in submodule[len(prefix):]:
            attributes[submodule[len(prefix):]] = module_facade(submodule)
    facade = SandboxModule(name, attributes)
    _FACADES[name] = facade
    return facade


def guarded_import(name: str, globals: Any = None, locals: Any = None,
                   fromlist: Any = (), level: int = 0) -> SandboxModule:
    """``__import__`` limited to :data:`ALLOWED_MODULES`."""
    if level != 0:
        raise ImportError("relative imports are not available in the sandbox")
    if type(name) is not str or name not in ALLOWED_MODULES:
        allowed = ", ".join(sorted(ALLOWED_MODULES))
        raise ImportError(
            f"import of {name!r} is not allowed in the sandbox; allowed modules: {allowed}")
    return module_facade(name if fromlist else name.partition(".")[0])


# --------------------------------------------------------------------------- output

class OutputBuffer:
    """Collects printed text up to ``max_chars`` and counts what it dropped."""

    def __init__(self, max_chars: int) -> None:
        self._max_chars = max_chars
        self._parts: list[str] = []
        self._size = 0
        self._dropped = 0

    def write(self, text: str) -> None:
        """Append ``text``, keeping at most ``max_chars`` characters in total."""
        room = self._max_chars - self._size
        if len(text) <= room:
            self._parts.append(text)
            self._size += len(text)
            return
        if room > 0:
            self._parts.append(text[:room])
            self._size += room
        self._dropped += len(text) - max(room, 0)

    def text(self) -> str:
        """Everything kept so far (without the truncation note)."""
        return "".join(self._parts)

    def getvalue(self) -> str:
        """Everything kept, plus a note on how much was dropped."""
        text = self.text()
        if self._dropped:
            text += f"\n[output truncated: {self._dropped} more characters]"
        return text


_current_output: OutputBuffer | None = None


def write_output(text: str) -> None:
    """Write to the output buffer of the cell now running (no-op between cells)."""
    if _current_output is not None:
        _current_output.write(text)


class _Printer:
    """Target of RestrictedPython's print rewriting (``print(...)`` -> ``_print._call_print``)."""

    __slots__ = ()

    def _call_print(self, *objects: Any, sep: str | None = " ", end: str | None = "\n",
                    file: Any = None, flush: bool = False) -> None:
        if sep is not None and not isinstance(sep, str):
            raise TypeError(f"sep must be None or a string, not {type(sep).__name__}")
        if end is not None and not isinstance(end, str):
            raise TypeError(f"end must be None or a string, not {type(end).__name__}")
        if file is not None:
            builtins.print(*objects, sep=sep, end=end, file=file)
            return
        sep = " " if sep is None else sep
        for index, obj in enumerate(objects):
            if index:
                write_output(sep)
            write_output(obj if type(obj) is str else str(obj))
        write_output("\n" if end is None else end)

    def __call__(self) -> str:  # the ``printed`` name
        return _current_output.text() if _current_output is not None else ""


_PRINTER = _Printer()


# --------------------------------------------------------------------------- builtins

_SAFE_BUILTIN_NAMES = (
    "abs", "all", "any", "ascii", "bin", "bool", "bytearray", "bytes", "callable", "chr",
    "classmethod", "complex", "dict", "divmod", "enumerate", "filter", "float", "format",
    "frozenset", "hash", "hex", "id", "int", "isinstance", "issubclass", "iter", "len",
    "list", "map", "max", "min", "next", "object", "oct", "ord", "pow", "property", "range",
    "repr", "reversed", "round", "set", "slice", "sorted", "staticmethod", "str", "sum",
    "super", "tuple", "zip", "None", "True", "False", "Ellipsis", "NotImplemented",
)

_UNAVAILABLE_BUILTINS = {
    "open": "no file access", "input": "no interactive input", "eval": "no dynamic code",
    "exec": "no dynamic code", "compile": "no dynamic code", "globals": "no namespace access",
    "locals": "no namespace access", "vars": "no namespace access",
    "breakpoint": "no debugger", "exit": "the cell cannot stop the interpreter",
    "quit": "the cell cannot stop the interpreter", "memoryview": "no raw memory access",
}


def _unavailable(name: str, reason: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise PermissionError(f"{name}() is not available in the sandbox ({reason})")
    refuse.__name__ = refuse.__qualname__ = name
    return refuse


def _filtered_dir(*args: Any) -> list[str]:
    if len(args) > 1:
        raise TypeError("dir() takes at most one argument")
    names = dir(args[0]) if args else list(_active_namespace())
    return sorted(name for name in names if not name.startswith("_"))


_active_sandbox: Sandbox | None = None


def _active_namespace() -> dict[str, Any]:
    return _active_sandbox.namespace if _active_sandbox is not None else {}


def make_builtins() -> dict[str, Any]:
    """The builtins dict for a sandbox namespace (without tools and answer helpers)."""
    table: dict[str, Any] = {name: getattr(builtins, name) for name in _SAFE_BUILTIN_NAMES}
    for name, value in vars(builtins).items():
        if isinstance(value, type) and issubclass(value, BaseException) and name[0] != "_":
            table[name] = value
    for name, reason in _UNAVAILABLE_BUILTINS.items():
        table[name] = _unavailable(name, reason)
    table.update({
        "type": SandboxType,
        "getattr": guarded_getattr,
        "hasattr": guarded_hasattr,
        "setattr": guarded_setattr,
        "delattr": guarded_delattr,
        "dir": _filtered_dir,
        "ToolError": ToolError,
        "__import__": guarded_import,
        "__build_class__": _build_class,
        "__metaclass__": type,
        "_getattr_": guarded_getattr,
        "_getitem_": guarded_getitem,
        "_getiter_": iter,
        "_write_": guarded_write,
        "_inplacevar_": guarded_inplacevar,
        "_apply_": guarded_apply,
        "_iter_unpack_sequence_": guarded_iter_unpack_sequence,
        "_unpack_sequence_": guarded_unpack_sequence,
        "_print_": lambda _getattr=None: _PRINTER,
    })
    return table


# --------------------------------------------------------------------------- namespace

@dataclass
class CellOutcome:
    """What one cell produced, as plain data."""

    stdout: str
    error: str | None = None
    error_type: str | None = None
    final: dict[str, Any] | None = None

    def to_message(self) -> dict[str, Any]:
        """Plain-data form sent to the runtime."""
        return {"stdout": self.stdout, "error": self.error, "error_type": self.error_type,
                "final": self.final}


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 80
_SHORT_REPR.maxlist = _SHORT_REPR.maxtuple = _SHORT_REPR.maxset = _SHORT_REPR.maxdict = 6
_SHORT_REPR.maxlevel = 3


def type_name(value: Any) -> str:
    """The name of ``value``'s type as the sandbox presents it."""
    return "module" if isinstance(value, SandboxModule) else type(value).__name__


def short_repr(value: Any) -> str:
    """A bounded repr with memory addresses removed (stable across processes)."""
    try:
        text = _SHORT_REPR.repr(value)
    except Exception:
        text = f"<{type(value).__name__} object>"
    return _ADDRESS.sub("", text)


class Sandbox:
    """One persistent restricted namespace; runs cells in it."""

    def __init__(self, *, max_output_chars: int = 1_000_000) -> None:
        # Stdlib helpers such as dataclasses look up a class's module in sys.modules; give
        # them an empty placeholder (the namespace itself is never registered there).
        sys.modules.setdefault(SANDBOX_MODULE_NAME, types.ModuleType(SANDBOX_MODULE_NAME))
        self._max_output_chars = max_output_chars
        self._builtins = make_builtins()
        self._builtins.update({
            "FINAL": self._final_answer,
            "FINAL_VAR": self._final_variable,
            "SHOW_VARS": self._show_variables,
            "help": self._help,
        })
        self.namespace: dict[str, Any] = {"__builtins__": self._builtins,
                                          "__name__": SANDBOX_MODULE_NAME}
        self._tools: dict[str, tuple[str, Any]] = {}
        self.compiler: Callable[[str, str], types.CodeType] = compile_cell
        """Turns (source, filename) into code; raises SandboxSyntaxError. Replaceable."""
        self._sources: dict[str, list[str]] = {}
        self._cells_run = 0
        self._final: dict[str, Any] | None = None

    # -- extension points ----------------------------------------------------
    def install_builtin(self, name: str, value: Any) -> None:
        """Add or replace a builtin visible to cells (guards such as ``_getattr_`` too)."""
        self._builtins[name] = value

    def builtin(self, name: str) -> Any:
        """The current builtin ``name`` (KeyError if there is none)."""
        return self._builtins[name]

    def install_tool(self, name: str, signature: str, proxy: Callable[..., Any]) -> None:
        """Expose ``proxy`` as builtin ``name``; ``signature`` is shown by ``help()``."""
        self._builtins[name] = proxy
        self._tools[name] = (signature, proxy)

    def tool_names(self) -> list[str]:
        """Names of the installed tools."""
        return list(self._tools)

    # -- running -------------------------------------------------------------
    def execute(self, source: str, name: str = "cell") -> CellOutcome:
        """Run ``source`` in the namespace; errors become part of the outcome."""
        global _current_output, _active_sandbox
        self._cells_run += 1
        filename = f"<{name}#{self._cells_run}>"
        output = OutputBuffer(self._max_output_chars)
        self._final = None
        _current_output, _active_sandbox = output, self
        error = error_type = None
        try:
            code = self.compiler(source, filename)
            self._sources[filename] = source.splitlines()
            exec(code, self.namespace)
        except SandboxSyntaxError as exc:
            error, error_type = f"SyntaxError: {exc}", "SyntaxError"
        except BaseException as exc:  # the cell's own errors, including SystemExit
            error, error_type = self._describe(exc), type(exc).__name__
        finally:
            _current_output = None
        return CellOutcome(output.getvalue(), error, error_type, self._final)

    def _describe(self, exc: BaseException) -> str:
        try:
            message = str(exc)
        except Exception:
            message = "<unprintable message>"
        if len(message) > MAX_ERROR_MESSAGE_CHARS:
            message = message[:MAX_ERROR_MESSAGE_CHARS] + "..."
        lines = [f"{type(exc).__name__}: {message}" if message else type(exc).__name__]
        frames = []
        tb = exc.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            if code.co_filename in self._sources:
                frames.append((code.co_filename, tb.tb_lineno, code.co_name))
            tb = tb.tb_next
        if frames:
            lines.append("Traceback (most recent call last):")
            if len(frames) > MAX_TRACEBACK_FRAMES:
                lines.append(f"  ... {len(frames) - MAX_TRACEBACK_FRAMES} earlier frames omitted")
                frames = frames[-MAX_TRACEBACK_FRAMES:]
            for filename, lineno, function in frames:
                lines.append(f'  File "{filename}", line {lineno}, in {function}')
                source = self._sources[filename]
                if 0 < lineno <= len(source) and source[lineno - 1].strip():
                    lines.append(f"    {source[lineno - 1].strip()}")
        return "\n".join(lines)

    # -- variables -------------------------------------------------------------
    def set_variable(self, name: str, value: Any) -> None:
        """Bind ``name`` in the namespace."""
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) \
                or name.startswith("_"):
            raise ValueError(f"invalid variable name: {name!r}")
        self.namespace[name] = value

    def get_variable(self, name: str) -> Any:
        """The variable's value as plain data (KeyError if unbound, TypeError if not plain)."""
        if not isinstance(name, str) or name.startswith("_") or name not in self.namespace:
            raise KeyError(name)
        return to_plain(self.namespace[name])

    def variables(self) -> dict[str, Any]:
        """The user-visible variables (names not starting with ``_``)."""
        return {k: v for k, v in self.namespace.items() if not k.startswith("_")}

    def summary(self) -> dict[str, list[str]]:
        """``{name: [type name, short repr]}`` for every user-visible variable."""
        return {name: [type_name(value), short_repr(value)]
                for name, value in self.variables().items()}

    # -- helpers visible in the sandbox ---------------------------------------
    def _final_answer(self, answer: Any) -> None:
        """FINAL(answer): record the final answer of the run."""
        self._final = self._final_record(answer, None)

    def _final_variable(self, name: Any) -> None:
        """FINAL_VAR("name"): record the value of variable ``name`` as the final answer."""
        if not isinstance(name, str):
            raise TypeError("FINAL_VAR expects the variable's name as a string, "
                            "e.g. FINAL_VAR('answer')")
        name = name.strip()
        if name.startswith("_") or name not in self.namespace:
            raise NameError(f"FINAL_VAR: no variable named {name!r}")
        self._final = self._final_record(self.namespace[name], name)

    def _final_record(self, value: Any, variable: str | None) -> dict[str, Any]:
        try:
            return {"value": to_plain(value), "is_repr": False, "variable": variable}
        except (NotPlainDataError, RecursionError):
            text = repr(value)
            if len(text) > self._max_output_chars:
                text = text[:self._max_output_chars] + "..."
            return {"value": text, "is_repr": True, "variable": variable}

    def _show_variables(self) -> None:
        """SHOW_VARS(): print the variables defined so far with their types."""
        variables = self.variables()
        if not variables:
            write_output("No variables defined yet.\n")
            return
        listing = ", ".join(f"{name} ({type_name(value)})" for name, value in variables.items())
        write_output(f"Variables: {listing}\n")

    def _help(self, obj: Any = _MISSING) -> None:
        """help(): list the tools and helpers; help(tool) shows that tool's signature."""
        for name, (signature, proxy) in self._tools.items():
            if obj is proxy or obj == name:
                write_output(f"{signature}\n")
                return
        if obj is not _MISSING:
            doc = getattr(obj, "__doc__", None)
            if not isinstance(doc, str) or not doc.strip():
                doc = "no help available"
            write_output(f"{short_repr(obj)}: {doc.strip().split(chr(10) * 2)[0]}\n")
            return
        lines = ["Tools:"] + [f"  {signature}" for signature, _ in self._tools.values()]
        if not self._tools:
            lines.append("  (none)")
        lines += ["Helpers:", "  FINAL(answer)  FINAL_VAR('name')  SHOW_VARS()  help(tool)",
                  "Modules: " + ", ".join(sorted(ALLOWED_MODULES))]
        write_output("\n".join(lines) + "\n")
