"""The one path by which a cell makes a class: the ``class`` statement (``__build_class__``).

:class:`ClassBuilder` resolves the bases itself before Python does: a base that is not a class
is resolved only when it is one of typing's aliases (``List[int]``, ``Generic[T]``,
``Protocol[T]``, ``NamedTuple``, ``TypedDict``...), by the rules of their ``__mro_entries__``
but comparing by identity (typing's own code compares the bases with ``==``); every resolved
base must then be a class the sandbox made or one of :data:`ALLOWED_BASES`, a short explicit
list of real classes (object, the builtin data types and exceptions, the collections and
numbers ABCs, typing's generic machinery, a few stdlib classes agent code subclasses) and the
classes they derive from. The metaclass is never the model's: the ``metaclass`` keyword is
refused (the compiler passes `STATEMENT`, nothing else is accepted), so are keywords starting
with ``_``, and the one Python derives from the bases must be one of
:data:`ALLOWED_METACLASSES` (``type``, the ABC, enum and typing metaclasses). All of it is
decided by identity. What the statement makes is recorded in the sandbox's provenance.

``typing.Type[int]`` resolves to ``type``, which is not an allowed base: no cell can make a
metaclass, hence no class with arbitrary dunders.
"""

from __future__ import annotations

import builtins
import collections
import collections.abc
import datetime
import decimal
import enum
import fractions
import io
import numbers
import random
import types
import typing
from typing import Any

from .provenance import Provenance, unwrap


def _mro_closure(classes: list[type]) -> frozenset[type]:
    return frozenset(base for cls in classes for base in cls.__mro__)


def _typing_entry(alias: Any) -> type:
    (entry,) = alias.__mro_entries__((alias,))
    return entry


_NAMED_TUPLE_BASE = _typing_entry(typing.NamedTuple)
_TYPED_DICT_BASE = _typing_entry(typing.TypedDict)

_EXCEPTIONS = [value for name, value in vars(builtins).items() if not name.startswith("_")
               and isinstance(value, type) and issubclass(value, BaseException)]

ALLOWED_BASES: frozenset[type] = _mro_closure([
    object, int, float, complex, str, bytes, bytearray, list, dict, set, frozenset, tuple,
    *_EXCEPTIONS,
    collections.OrderedDict, collections.defaultdict, collections.Counter, collections.deque,
    collections.ChainMap, collections.UserDict, collections.UserList,
    *[getattr(collections.abc, name) for name in collections.abc.__all__],
    numbers.Number, numbers.Complex, numbers.Real, numbers.Rational, numbers.Integral,
    typing.Generic, typing.Protocol, _NAMED_TUPLE_BASE, _TYPED_DICT_BASE,
    enum.Enum, enum.IntEnum, enum.Flag, enum.IntFlag, enum.StrEnum,
    random.Random,
    decimal.Decimal, fractions.Fraction, datetime.date, datetime.datetime, datetime.time,
    datetime.timedelta, datetime.tzinfo, io.StringIO, io.BytesIO,
]) - {type}
"""Real classes a class statement may derive from (besides what the sandbox made), with every
class they derive from; ``type`` is never one of them. A subclass's instances are the cell's
to write, so a base is on the list only if its own methods call the attributes a subclass
controls with nothing but what the cell gave them (not ``string.Template``: ``substitute``
hands its inner ``convert`` function to ``self.pattern.sub``, whatever ``pattern`` is), and
only if its ``__init__`` stores nothing but what it was given and plain data on the instance
(not ``json.JSONDecoder``, which stores the module's inner scanner functions as
``parse_object``, ``scan_once``...; nor ``json.JSONEncoder`` with it: a subclass's fields,
``asdict`` or ``replace`` read them back). Cells still use these classes directly."""

ALLOWED_METACLASSES: frozenset[type] = frozenset({
    type, type(collections.abc.Mapping), enum.EnumType, type(typing.Protocol),
    type(_NAMED_TUPLE_BASE), type(_TYPED_DICT_BASE),
})
"""The metaclasses a class made by the sandbox may have."""

ALLOWED_BASE_IDS = frozenset(map(id, ALLOWED_BASES))
ALLOWED_METACLASS_IDS = frozenset(map(id, ALLOWED_METACLASSES))
"""The same, by identity (membership never calls a class's own ``__eq__``/``__hash__``)."""

_GENERIC_ALIAS: type = typing._GenericAlias  # type: ignore[attr-defined]
_BASE_GENERIC_ALIAS: type = typing._BaseGenericAlias  # type: ignore[attr-defined]

_ALIAS_TYPES: frozenset[type] = frozenset(type(alias) for alias in (
    typing.List, typing.List[int], list[int], typing.Callable, typing.Callable[[int], int],
    typing.Tuple, typing.Tuple[int], typing.Generic[typing.AnyStr],
    typing.Protocol[typing.AnyStr], typing.Annotated[int, 0], typing.Literal[0],
    typing.Union[int, str],
))
"""Types of typing's aliases, whose ``__mro_entries__`` the builder calls."""
_ENTRY_OBJECTS = (typing.NamedTuple, typing.TypedDict)
"""Objects with an ``__mro_entries__`` of their own that the builder calls."""


STATEMENT = object()
"""What the restricted compiler passes as every class statement's ``metaclass`` (the builtins'
``__metaclass__``): the mark of a plain class statement."""


class ClassBuilder:
    """The sandbox's ``__build_class__`` (see the module docstring)."""

    def __init__(self, provenance: Provenance) -> None:
        self.provenance = provenance

    def __call__(self, body: Any, name: Any, *bases: Any, **keywords: Any) -> Any:
        if keywords.pop("metaclass", STATEMENT) is not STATEMENT:
            raise TypeError("class statements cannot choose a metaclass in the sandbox")
        if type(body) is not types.FunctionType or not self.provenance.made_function(body):
            raise TypeError("__build_class__ takes the body of a class statement")
        for key in keywords:
            if type(key) is not str or key.startswith("_"):
                raise TypeError(f"class {name}: keyword {key!r} is not allowed in the sandbox")
        bases = tuple(unwrap(base) for base in bases)
        resolved = self.resolve(bases)
        metaclass = _derived_metaclass(resolved)
        if not _holds(ALLOWED_METACLASS_IDS, metaclass):
            raise TypeError(f"class {name}: its bases give it the metaclass "
                            f"{metaclass.__qualname__!r}, which the sandbox does not allow")
        checked = _CheckedNamespace(self, metaclass, bases, resolved)
        cls = builtins.__build_class__(body, name, *resolved, metaclass=checked, **keywords)
        if not isinstance(cls, type) or not _holds(ALLOWED_METACLASS_IDS, type(cls)) \
                or not all(self.allowed_base(base) for base in cls.__mro__[1:]):
            raise TypeError(f"class {name}: the class made is not one the sandbox allows")
        return self.provenance.record(cls)

    def resolve(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        """The classes ``bases`` stand for, each checked. A typing alias is resolved here
        (`_alias_entries`), comparing by identity only: typing's own ``__mro_entries__``
        compares the bases with ``==`` and ``in``, which calls a cell's ``__eq__`` with
        typing's internals."""
        resolved: list[type] = []
        for index, base in enumerate(bases):
            if isinstance(base, type):
                entries: tuple[Any, ...] = (base,)
            elif type(base) in _ALIAS_TYPES or any(base is entry for entry in _ENTRY_OBJECTS):
                entries = _alias_entries(base, bases, index)
            else:
                raise TypeError(f"a class can only derive from classes, not from "
                                f"{type(base).__name__!r} objects")
            for entry in entries:
                if not isinstance(entry, type) or not self.allowed_base(entry):
                    what = entry.__qualname__ if isinstance(entry, type) else repr(entry)
                    raise TypeError(
                        f"class bases: {what!r} is not a class the sandbox can derive from "
                        "(classes defined in the sandbox, builtin data types and exceptions, "
                        "collections, numbers, enum, typing's Generic/Protocol/NamedTuple/"
                        "TypedDict and a few stdlib classes; docs/sandbox.md lists them)")
            resolved.extend(entries)
        return tuple(resolved)

    def allowed_base(self, cls: type) -> bool:
        """Whether a class statement may derive from ``cls``."""
        return allowed_base(self.provenance, cls)


def allowed_base(provenance: Provenance, cls: Any) -> bool:
    """Whether the sandbox may derive a class from ``cls`` (by identity)."""
    return _holds(ALLOWED_BASE_IDS, cls) or provenance.made_class(cls) \
        or provenance.vetted_base(cls)


def _holds(ids: frozenset[int], obj: Any) -> bool:
    return id(obj) in ids


_PYTHON_KEYS: dict[str, type | tuple[type, ...]] = {
    "__module__": str, "__qualname__": str, "__doc__": (str, type(None)),
    "__annotations__": dict, "__classcell__": types.CellType, "__orig_bases__": tuple,
    "__firstlineno__": int, "__static_attributes__": tuple, "__type_params__": tuple,
}
"""Names starting with ``_`` that Python itself puts in a class body's namespace."""


class _CheckedNamespace:
    """What the class builder passes to ``__build_class__`` as the metaclass: the namespace
    comes from the real metaclass's ``__prepare__``; once the body has run, every name in it
    that starts with ``_`` must be Python's own (`_PYTHON_KEYS`), a function the cell defined
    (``def __eq__``: its parameters are admitted), or what the metaclass's ``__prepare__`` put
    there from a base, before the real metaclass makes the class. A decorator cannot turn a
    dunder into a C callable that Python would call with raw objects."""

    def __init__(self, builder: ClassBuilder, metaclass: type, bases: tuple[Any, ...],
                 resolved: tuple[type, ...]) -> None:
        self.builder, self.metaclass = builder, metaclass
        self.bases, self.resolved = bases, resolved

    def __prepare__(self, name: str, bases: tuple[Any, ...], **keywords: Any) -> Any:
        return self.metaclass.__prepare__(name, bases, **keywords)

    def __call__(self, name: str, bases: tuple[type, ...], namespace: Any,
                 **keywords: Any) -> Any:
        made_function = self.builder.provenance.made_function
        for key, value in dict.items(namespace):
            if type(key) is not str:
                raise TypeError(f"class {name}: a name in its body is not a string")
            if not key.startswith("_") or made_function(value):
                continue
            kinds = _PYTHON_KEYS.get(key)
            if kinds is not None and isinstance(value, kinds):
                continue
            if any(value is getattr(base, key, namespace) for base in self.resolved):
                continue  # the metaclass's __prepare__ copied it from a base
            raise TypeError(f"class {name}: {key!r} must be a function defined in the class "
                            "body in the sandbox")
        if self.bases != self.resolved:
            namespace["__orig_bases__"] = self.bases  # as __build_class__ does
        return self.metaclass(name, bases, namespace, **keywords)


def _contains(items: tuple[Any, ...], value: Any) -> bool:
    return any(item is value for item in items)


def _alias_entries(alias: Any, bases: tuple[Any, ...], index: int) -> tuple[Any, ...]:
    """What typing's ``__mro_entries__`` gives for ``alias`` at ``bases[index]``, computed with
    identity comparisons (typing 3.11's rules for the aliases it knows)."""
    if any(alias is entry for entry in _ENTRY_OBJECTS):
        return (_NAMED_TUPLE_BASE,) if alias is typing.NamedTuple else (_TYPED_DICT_BASE,)
    origin = object.__getattribute__(alias, "__origin__")
    if type(alias) is types.GenericAlias:
        return (origin,)
    later = bases[index + 1:]
    if issubclass(type(alias), _GENERIC_ALIAS):
        if isinstance(origin, typing._SpecialForm):  # type: ignore[attr-defined]
            raise TypeError(f"cannot subclass {alias!r}")
        if not object.__getattribute__(alias, "_name"):
            if origin is typing.Generic:
                if _contains(bases, typing.Protocol) or any(
                        issubclass(type(b), _BASE_GENERIC_ALIAS) and b is not alias
                        for b in later):
                    return ()
            return (origin,)
    # a generic ABC or builtin (typing.List[int], typing.Callable, typing.Tuple...)
    entries = [] if _contains(bases, origin) else [origin]
    if not any(issubclass(type(b), _BASE_GENERIC_ALIAS)
               or (isinstance(b, type) and issubclass(b, typing.Generic)) for b in later):
        entries.append(typing.Generic)
    return tuple(entries)


def _derived_metaclass(bases: tuple[type, ...]) -> type:
    """The metaclass Python gives a class with these bases (the most derived one)."""
    winner: type = type
    for base in bases:
        meta = type(base)
        if issubclass(winner, meta):
            continue
        if issubclass(meta, winner):
            winner = meta
            continue
        raise TypeError("metaclass conflict: the bases' metaclasses are unrelated")
    return winner
