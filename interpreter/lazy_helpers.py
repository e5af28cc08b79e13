"""The shadow's run-time helpers: the ``_lz_*_`` functions the shadow transform emits, the
allow-list of pure callables they may defer, and RestrictedPython guards that understand lazies."""

from __future__ import annotations

import builtins
import functools
import json
import operator
import types
from collections.abc import Callable, Mapping
from typing import Any

from .lazy_values import (
    MUTATING_METHOD_NAMES,
    Lazy,
    _call,
    _defer,
    _holds_lazy,
    force,
    force_deep,
)
from .sandbox.provenance import unwrap

# ---------------------------------------------------------------------------------------------
# Helpers injected into the shadow namespace (targets of shadow_transform)

_BINARY_OPERATORS: dict[str, Callable[[Any, Any], Any]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul, "@": operator.matmul,
    "/": operator.truediv, "//": operator.floordiv, "%": operator.mod, "**": operator.pow,
    "<<": operator.lshift, ">>": operator.rshift, "&": operator.and_, "^": operator.xor,
    "|": operator.or_,
}
_UNARY_OPERATORS: dict[str, Callable[[Any], Any]] = {
    "-": operator.neg, "+": operator.pos, "~": operator.invert,
}


def _not_in(a: Any, b: Any) -> bool:
    return a not in b


def _in(a: Any, b: Any) -> bool:
    return a in b


_COMPARE_OPERATORS: dict[str, Callable[[Any, Any], Any]] = {
    "==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le,
    ">": operator.gt, ">=": operator.ge, "is": operator.is_, "is not": operator.is_not,
    "in": _in, "not in": _not_in,
}
# Identity tests never look inside their operands; every other comparison may compare elements.
_SHALLOW_COMPARE = frozenset({"is", "is not"})


def _lz_binop_(op: str, left: Any, right: Any) -> Any:
    """``left <op> right``, deferred if an operand is lazy (``%`` also looks inside the right
    operand when formatting a string)."""
    fn = _BINARY_OPERATORS[op]
    deep_right = op == "%" and type(left) in (str, bytes)
    if type(left) is Lazy or _holds_lazy(right, deep=deep_right):
        return _defer(fn, (left, right), name=op)
    return fn(left, right)


def _lz_unary_(op: str, operand: Any) -> Any:
    """``<op> operand`` for ``-``, ``+``, ``~``, deferred if the operand is lazy."""
    fn = _UNARY_OPERATORS[op]
    if type(operand) is Lazy:
        return _defer(fn, (operand,), name=f"unary {op}")
    return fn(operand)


def _lz_compare_(left: Any, op: str, right: Any) -> Any:
    """``left <op> right`` for one comparison operator, deferred if an operand holds a lazy."""
    fn = _COMPARE_OPERATORS[op]
    deep = op not in _SHALLOW_COMPARE
    if _holds_lazy(left, deep) or _holds_lazy(right, deep):
        return _defer(fn, (left, right), name=op)
    return fn(left, right)


class _Raised:
    """An operand of a comparison chain whose evaluation raised (re-raised only if reached)."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


def _chain_rest(ops: tuple[str, ...], left: Any, *operands: Any) -> Any:
    result: Any = True
    for op, right in zip(ops, operands):
        if type(right) is _Raised:
            raise right.exc
        result = _COMPARE_OPERATORS[op](left, right)
        if not result:
            return result
        left = right
    return result


def _lz_compare_chain_(left: Any, *rest: Any) -> Any:
    """``left op1 b op2 c ...`` with Python's chain semantics; ``rest`` alternates operator
    names and zero-argument functions producing the next operand (so an operand the chain
    short-circuits past is never evaluated). Once an operand is lazy the rest of the chain is
    deferred; the remaining operands are then evaluated now, and an exception one raises is
    re-raised only if the deferred chain reaches it."""
    ops: tuple[str, ...] = rest[0::2]
    thunks = rest[1::2]
    result: Any = True
    for index, (op, thunk) in enumerate(zip(ops, thunks)):
        right = thunk()
        deep = op not in _SHALLOW_COMPARE
        if _holds_lazy(left, deep) or _holds_lazy(right, deep):
            later: list[Any] = []
            for later_thunk in thunks[index + 1:]:
                try:
                    later.append(later_thunk())
                except Exception as exc:
                    later.append(_Raised(exc))
            return _defer(_chain_rest, (ops[index:], left, right, *later), name="comparison chain")
        result = _COMPARE_OPERATORS[op](left, right)
        if index == len(ops) - 1 or not result:
            return result
        left = right
    return result


def _render_fstring(*parts: Any) -> str:
    pieces = []
    for part in parts:
        if type(part) is str:
            pieces.append(part)
            continue
        value, conversion, spec = part
        if conversion == 115:
            value = str(value)
        elif conversion == 114:
            value = repr(value)
        elif conversion == 97:
            value = ascii(value)
        pieces.append(format(value, "" if spec is None else spec))
    return "".join(pieces)


def _lz_fstring_(*parts: Any) -> Any:
    """An f-string: literal parts are ``str``, replacement fields are
    ``(value, conversion, spec)`` tuples (conversion as in ``ast.FormattedValue``; ``spec`` a
    string or None). Deferred if a value or spec holds a lazy."""
    for part in parts:
        if type(part) is not str and (_holds_lazy(part[0]) or type(part[2]) is Lazy):
            return _defer(_render_fstring, parts, name="f-string")
    return _render_fstring(*parts)


_PURE_FUNCTIONS = (len, str, int, float, sorted, sum, min, max, round, abs, repr, list, tuple,
                   dict, set, frozenset, bool, json.dumps, json.loads, builtins.divmod,
                   builtins.pow)
"""Callables ``_lz_call_`` may defer (free of side effects)."""
_PURE_CALLABLES = frozenset(id(fn) for fn in _PURE_FUNCTIONS)  # the tuple keeps the ids valid
# Methods of built-in data types that only read their receiver.
PURE_METHOD_NAMES = frozenset({
    "join", "format", "split", "rsplit", "strip", "lstrip", "rstrip", "upper", "lower",
    "replace", "startswith", "endswith", "title", "capitalize", "casefold", "swapcase",
    "splitlines", "count", "find", "rfind", "index", "rindex", "zfill", "center", "ljust",
    "rjust", "partition", "rpartition", "encode", "decode", "removeprefix", "removesuffix",
    "isdigit", "isalpha", "isalnum", "isspace", "islower", "isupper", "isnumeric", "isdecimal",
    "get", "keys", "values", "items", "copy", "dumps", "loads",
    "deepcopy",  # not pure: listed so that ``copy.deepcopy(x)`` gets concrete arguments
})
_PURE_METHOD_OWNERS = (str, bytes, dict, list, tuple, set, frozenset)


# Pure callables that never look inside the elements of their arguments: a list of lazies
# needs no deferral (``len(results)`` is known before the results are).
_SHALLOW_CALLABLES = frozenset(id(fn) for fn in (len, list, tuple, bool))


def _is_pure_callable(fn: Any) -> bool:
    fn = unwrap(fn)  # a module function as the sandbox holds it
    if id(fn) in _PURE_CALLABLES:
        return True
    if type(fn) is functools.partial:  # e.g. a sandbox's safe ``str.format`` bound to a template
        return _is_pure_callable(fn.func) and not _holds_lazy(fn.args)
    if type(fn) is types.BuiltinMethodType:
        owner = getattr(fn, "__self__", None)
        return type(owner) in _PURE_METHOD_OWNERS and fn.__name__ in PURE_METHOD_NAMES
    return False


def _lz_call_(fn: Any, /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` for calls the transform found on the allow-list of pure builtins
    and methods: deferred if an argument holds a lazy and ``fn`` really is pure; a call of
    anything else (e.g. a rebound name) gets concrete arguments, forcing them."""
    if type(fn) is Lazy:
        return _defer(_call, (fn, *args), kwargs, name="call")
    if id(fn) in _SHALLOW_CALLABLES:
        if not any(type(a) is Lazy for a in (*args, *kwargs.values())):
            return fn(*args, **kwargs)
    elif not (_holds_lazy(args) or _holds_lazy(kwargs)):
        return fn(*args, **kwargs)
    if _is_pure_callable(fn):
        return _defer(fn, args, kwargs)
    return fn(*force_deep(args), **force_deep(kwargs))


def shadow_helpers() -> dict[str, Callable[..., Any]]:
    """The ``_lz_*_`` functions the shadow transform emits, keyed by their global name."""
    return {
        "_lz_binop_": _lz_binop_,
        "_lz_unary_": _lz_unary_,
        "_lz_compare_": _lz_compare_,
        "_lz_compare_chain_": _lz_compare_chain_,
        "_lz_fstring_": _lz_fstring_,
        "_lz_call_": _lz_call_,
    }


# ---------------------------------------------------------------------------------------------
# RestrictedPython guards that understand lazies


def lazy_aware_guards(guards: Mapping[str, Callable[..., Any]]) -> dict[str, Callable[..., Any]]:
    """Wrap the RestrictedPython guards found in ``guards`` for the shadow namespace.

    ``_getattr_`` and ``_getitem_`` on a lazy object (or with a lazy key) return a deferred
    value that applies the original guard to the concrete values later; attribute names of
    mutating methods force instead, so mutations happen in program order. ``_inplacevar_``
    defers like the operator. ``_write_``, ``_getiter_``, ``_iter_unpack_sequence_`` and
    ``_unpack_sequence_`` force their lazy inputs first. Other entries are returned unchanged.
    """
    wrapped = dict(guards)
    if "_getattr_" in guards:
        wrapped["_getattr_"] = _wrap_getattr(guards["_getattr_"])
    if "_getitem_" in guards:
        wrapped["_getitem_"] = _wrap_getitem(guards["_getitem_"])
    if "_inplacevar_" in guards:
        wrapped["_inplacevar_"] = _wrap_inplacevar(guards["_inplacevar_"])
    for name in ("_write_", "_getiter_"):
        if name in guards:
            wrapped[name] = _wrap_forcing_first_arg(guards[name])
    for name in ("_iter_unpack_sequence_", "_unpack_sequence_"):
        if name in guards:
            wrapped[name] = _wrap_forcing_first_arg(guards[name])
    return wrapped


def _wrap_getattr(guard: Callable[..., Any]) -> Callable[..., Any]:
    def lazy_getattr(obj: Any, name: str, *default: Any) -> Any:
        if type(obj) is Lazy:
            if name in MUTATING_METHOD_NAMES:
                return guard(force(obj), name, *default)
            return _defer(guard, (obj, name, *default), name=f".{name}")
        return guard(obj, name, *default)

    return lazy_getattr


def _wrap_getitem(guard: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    def lazy_getitem(obj: Any, key: Any) -> Any:
        if type(obj) is Lazy or _holds_lazy(key):
            return _defer(guard, (obj, key), name="[]")
        return guard(obj, key)

    return lazy_getitem


def _wrap_inplacevar(guard: Callable[[str, Any, Any], Any]) -> Callable[[str, Any, Any], Any]:
    def lazy_inplacevar(op: str, target: Any, value: Any) -> Any:
        if type(target) is Lazy or type(value) is Lazy:
            return _defer(guard, (op, target, value), name=op)
        return guard(op, target, value)

    return lazy_inplacevar


def _wrap_forcing_first_arg(guard: Callable[..., Any]) -> Callable[..., Any]:
    def forcing_guard(obj: Any, *rest: Any) -> Any:
        return guard(force(obj), *rest)

    forcing_guard.__name__ = getattr(guard, "__name__", "guard")
    return forcing_guard

