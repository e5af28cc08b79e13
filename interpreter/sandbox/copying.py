"""The sandbox's ``copy.copy`` and ``copy.deepcopy``, written for the sandbox.

The stdlib's copy rebuilds an object from its reduction, whatever that names: a bound method
reduces to ``getattr(obj, name)`` with a name its maker chose, and ``deepcopy`` fills a memo the
caller passes in. Here:

* plain data is copied by type (the builtin containers, item by item for ``deepcopy``);
* functions, methods, classes, views and immutable values (numbers, strings, bytes, ranges,
  slices, enum members, dates and times, decimals, fractions, compiled patterns...) are
  returned as they are (``deepcopy`` copies the items of tuples and frozensets);
* any other object must be one the sandbox made or a held stdlib object; it is rebuilt from its
  class's own reduction (trusted code: a cell cannot define reduction hooks), and only by
  calling ``copyreg``'s constructors or a class the sandbox holds or made, which must give a new
  object of the same class; its state is set with its class's ``__setstate__`` or, for plain
  state, key by key (no name starting with ``_``).

``deepcopy`` takes no ``memo``. Every copy is admitted where the cell reads it, as anything is.
"""

from __future__ import annotations

import collections
import copyreg
import datetime
import decimal
import enum
import fractions
import re
import types
import typing
from collections.abc import Callable
from typing import Any

from .admission import Admission, CheckedClass, TypeView
from .provenance import SandboxFunction

_ATOMIC: tuple[type, ...] = (
    int, float, complex, bool, str, bytes, type(None), type(...), type(NotImplemented), range,
    slice, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
    types.MethodDescriptorType, SandboxFunction, TypeView, CheckedClass, enum.Enum,
    datetime.date, datetime.time, datetime.timedelta, datetime.tzinfo, decimal.Decimal,
    fractions.Fraction, re.Pattern, re.Match, property, classmethod, staticmethod,
    typing._Final,  # type: ignore[attr-defined]  # typing's aliases and special forms
)
"""Returned as they are: immutable, or callables and classes (as the stdlib does)."""

_CONSTRUCTORS = frozenset({copyreg.__newobj__, copyreg.__newobj_ex__,  # type: ignore[attr-defined]
                           copyreg._reconstructor})  # type: ignore[attr-defined]


class Copier:
    """``copy`` and ``deepcopy`` for one sandbox (see the module docstring)."""

    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    def copy(self, x: Any) -> Any:
        """A shallow copy of ``x``."""
        return self._copy(x, None)

    def deepcopy(self, x: Any, memo: Any = None, /) -> Any:
        """A deep copy of ``x`` (no ``memo`` argument in the sandbox)."""
        if memo is not None:
            raise TypeError("deepcopy(x, memo) is not supported in the sandbox: call "
                            "deepcopy(x)")
        return self._copy(x, {})

    # -- by kind -------------------------------------------------------------------------------
    def _copy(self, x: Any, memo: dict[int, Any] | None) -> Any:
        if memo is not None and id(x) in memo:
            return memo[id(x)]
        kind = type(x)
        if kind is tuple or kind is frozenset:
            if memo is None:
                return x
            items = [self._copy(item, memo) for item in x]
            y = x if all(a is b for a, b in zip(items, x)) else kind(items)
            memo[id(x)] = y
            return y
        if isinstance(x, _ATOMIC):
            return x
        copier = _CONTAINER_COPIES.get(kind)
        if copier is not None:
            return copier(self, x, memo)
        return self._rebuild(x, memo)

    def _item(self, x: Any, memo: dict[int, Any] | None) -> Any:
        return x if memo is None else self._copy(x, memo)

    def _rebuild(self, x: Any, memo: dict[int, Any] | None) -> Any:
        cls = type(x)
        made = self.admission.provenance.made(x)
        if not made and not self.admission.admissible(x):
            raise TypeError(f"copy: {cls.__qualname__!r} objects cannot be copied in the "
                            "sandbox")
        try:
            reduction = cls.__reduce_ex__(x, 4)
        except Exception as exc:
            raise TypeError(f"copy: cannot copy {cls.__qualname__!r} objects ({exc})") from None
        if type(reduction) is not tuple or not 2 <= len(reduction) <= 6:
            raise TypeError(f"copy: cannot copy {cls.__qualname__!r} objects")
        func, args, state, listitems, dictitems = (*reduction, None, None, None)[:5]
        if not self._constructor(func):
            raise TypeError(f"copy: {cls.__qualname__!r} objects are rebuilt by a function "
                            "the sandbox does not call")
        if memo is not None:
            args = self._copy(args, memo)
        y = func(*args)
        if type(y) is not cls or y is x:
            raise TypeError(f"copy: {cls.__qualname__!r} objects do not rebuild as new objects "
                            "of their class")
        if memo is not None:
            memo[id(x)] = y
        if state is not None:
            self._set_state(y, self._item(state, memo))
        if listitems is not None:
            for item in listitems:
                y.append(self._item(item, memo))
        if dictitems is not None:
            for key, value in dictitems:
                y[self._item(key, memo)] = self._item(value, memo)
        return y

    def _constructor(self, func: Any) -> bool:
        if func in _CONSTRUCTORS:
            return True
        if isinstance(func, type):
            return self.admission.admit_class(func) is func
        return False

    def _set_state(self, y: Any, state: Any) -> None:
        setstate = getattr(type(y), "__setstate__", None)
        if setstate is not None:
            setstate(y, state)
            return
        slots = None
        if type(state) is tuple and len(state) == 2:
            state, slots = state
        for part in (state, slots):
            if part is None:
                continue
            if type(part) is not dict:
                raise TypeError("copy: an object's state must be a dict")
            for key, value in part.items():
                if type(key) is not str or key.startswith("_"):
                    raise TypeError(f"copy: refusing to set attribute {key!r} in the sandbox")
                object.__setattr__(y, key, value)


def _copy_list(copier: Copier, x: list, memo: dict[int, Any] | None) -> list:
    y: list = []
    if memo is not None:
        memo[id(x)] = y
    y.extend(copier._item(item, memo) for item in x)
    return y


def _copy_mapping(copier: Copier, x: dict, memo: dict[int, Any] | None) -> dict:
    kind = type(x)
    y = collections.defaultdict(x.default_factory) if kind is collections.defaultdict \
        else kind()
    if memo is not None:
        memo[id(x)] = y
    for key, value in x.items():
        y[copier._item(key, memo)] = copier._item(value, memo)
    return y


def _copy_set(copier: Copier, x: set, memo: dict[int, Any] | None) -> set:
    y = {copier._item(item, memo) for item in x}
    if memo is not None:
        memo[id(x)] = y
    return y


def _copy_bytearray(copier: Copier, x: bytearray, memo: dict[int, Any] | None) -> bytearray:
    return bytearray(x)


def _copy_deque(copier: Copier, x: collections.deque,
                memo: dict[int, Any] | None) -> collections.deque:
    y: collections.deque = collections.deque(maxlen=x.maxlen)
    if memo is not None:
        memo[id(x)] = y
    y.extend(copier._item(item, memo) for item in x)
    return y


_CONTAINER_COPIES: dict[type, Callable[[Copier, Any, dict[int, Any] | None], Any]] = {
    list: _copy_list, dict: _copy_mapping, collections.OrderedDict: _copy_mapping,
    collections.defaultdict: _copy_mapping, collections.Counter: _copy_mapping,
    set: _copy_set, bytearray: _copy_bytearray, collections.deque: _copy_deque,
}


def copy_functions(admission: Admission) -> dict[str, Callable[..., Any]]:
    """The ``copy`` facade's functions for one sandbox."""
    copier = Copier(admission)

    def copy(x: Any, /) -> Any:
        """A shallow copy of ``x``."""
        return copier.copy(x)

    def deepcopy(x: Any, memo: Any = None, /) -> Any:
        """A deep copy of ``x``."""
        return copier.deepcopy(x, memo)

    return {"copy": copy, "deepcopy": deepcopy}


__all__ = ["Copier", "copy_functions"]
