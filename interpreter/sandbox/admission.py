"""Admission: the one check every value passes before sandboxed code can bind it.

Cell code only ever sees a value through a handful of doors: the result of a call or an
operator, an attribute read, a subscript, an item of an iteration or unpacking, a parameter of
its own function (whoever calls it), the target of ``with``, the value sent into a generator,
what a decorator returns. policy.py rewrites every one of those doors (after RestrictedPython's
own rewrite) to pass through :meth:`Admission.admit`, so *what a cell can hold is what admit
lets through*, whichever stdlib path produced it.

``admit`` is an allow-list, decided by identity and exact type, never by metadata a class's
maker chooses:

* plain data (numbers, strings, bytes, the builtin containers, ranges, slices) passes as it is;
  a container's items are admitted when the cell reads them. A dict that is a module's globals,
  the sandbox's namespace or a builtins dict is refused (by identity);
* a Python function is the cell's own (its globals are the namespace) or is held as a
  :class:`~.provenance.SandboxFunction` (callable, nothing to read); a bound method likewise;
* a C function bound to a module is one the sandbox hands out (the safe builtins and the module
  facades' functions, by identity); bound to an object, the object must pass and the name must
  be public; an unbound C method of a class the sandbox holds passes under a public name;
  ``str.format`` / ``format_map`` become the guarded versions; every other descriptor or slot
  wrapper (``object.__getattribute__``...) is refused;
* a class is one the sandbox made or a *held* class (the builtin types and exceptions, the
  classes the facades show: surface.py, and ``ToolError``); a metaclass becomes the sandbox's ``type``; any
  other class becomes a :class:`TypeView` (a name to print and compare, nothing to call);
* ``functools.partial`` passes if what it holds does; descriptors and caches (``property``,
  ``classmethod``, ``staticmethod``, ``cached_property``, ``partialmethod``, ``lru_cache``
  wrappers) only around a function the cell defined; their classes (`CHECKED_CLASSES`) are
  held as a :class:`CheckedClass`, which admits what it builds, so C code calling one
  (``map(property, [len])``) cannot build what admission refuses;
* any other object passes if its exact type is held or made by the sandbox (exceptions too);
  everything else (modules, frames, code, tracebacks, cells, mapping proxies of class
  dicts, memoryviews, the runtime's own objects) is refused with :class:`AdmissionError`.

:meth:`Admission.admit_deep` also walks containers (the results of module functions, which are
where stdlib reflection lives). :meth:`Admission.check_class` checks the class dict of every
class made for a cell as a whole (provenance.py runs it when the class is recorded).
"""

from __future__ import annotations

import builtins
import collections
import collections.abc
import csv
import dataclasses
import datetime
import decimal
import enum
import functools
import hashlib
import io
import itertools
import re
import statistics
import sys
import types
import typing
import unicodedata
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from agentrt.errors import AgentrtError

from .policy import is_sandbox_type, sandbox_type
from .provenance import Provenance, SandboxFunction
from .surface import held_classes, held_instance_classes

class AdmissionError(AgentrtError, TypeError):
    """A value the sandbox may not hold (cells see it as a ``TypeError``)."""


AdmissionError.__name__ = AdmissionError.__qualname__ = "TypeError"  # the name a cell's error shows


class _ClassStandIn:
    """What `TypeView` and `CheckedClass` share: a read-only stand-in for real class ``_cls``
    that prints, compares and hashes as the class and answers ``isinstance`` / ``issubclass``
    for it, and never leaves the sandbox."""

    __slots__ = ("_cls", "__weakref__")
    _READ_ONLY = "a class of the sandbox is read-only"
    _NO_EXPORT = "classes cannot leave the sandbox"

    def __init__(self, cls: type) -> None:
        object.__setattr__(self, "_cls", cls)

    def __setattr__(self, name: str, value: Any) -> None:
        raise TypeError(self._READ_ONLY)

    __delattr__ = __setattr__  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<class {self._cls.__qualname__!r}>"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._cls is self._cls  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._cls)

    def __instancecheck__(self, obj: Any) -> bool:
        return isinstance(obj, self._cls)

    def __subclasscheck__(self, cls: Any) -> bool:
        return isinstance(cls, type) and issubclass(cls, self._cls)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(self._NO_EXPORT)


class TypeView(_ClassStandIn):
    """A class the sandbox does not hand out, as ``type()`` and attribute reads show it: its
    name, equality with the view of the same class, ``isinstance`` / ``issubclass`` checks;
    nothing to call, instantiate or read."""

    __slots__ = ()
    _READ_ONLY = "a class view is read-only"
    _NO_EXPORT = "class views cannot leave the sandbox"


class CheckedClass(_ClassStandIn):
    """A class whose objects admission may refuse (``property``, ``classmethod``,
    ``enum.member``...: `CHECKED_CLASSES`) as the cell holds it: calling it builds the object
    and admits it, so an object admission refuses is never built for a cell, whoever calls the
    constructor (``map(property, [len])`` raises as ``property(len)`` does). ``isinstance`` and
    ``issubclass`` forward to the real class; there is nothing else to read."""

    __slots__ = ("_admit",)

    def __init__(self, cls: type, admit: Callable[[Any], Any]) -> None:
        super().__init__(cls)
        object.__setattr__(self, "_admit", admit)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._admit(self._cls(*args, **kwargs))


CHECKED_CLASSES: tuple[type, ...] = (
    property, classmethod, staticmethod, enum.property, functools.cached_property,
    functools.partialmethod, enum.member, enum.nonmember, dataclasses.Field,
)
"""Held classes whose objects admission refuses around what they may not wrap: a cell holds
each as a `CheckedClass`."""


# --------------------------------------------------------------------------- what is held

_PLAIN: frozenset[type] = frozenset({
    int, float, complex, bool, str, bytes, type(None), type(...), type(NotImplemented),
    list, tuple, set, frozenset, bytearray, range, slice,
    collections.deque, collections.OrderedDict, collections.defaultdict, collections.Counter,
})
"""Exact types that pass as they are (dict is checked by identity, see `_dict`)."""

_PLAIN_ITEMS: frozenset[type] = frozenset({range, str, bytes, bytearray})
"""Exact types whose items are always plain (iterated without admission)."""

_FORMAT_NAMES = frozenset({"format", "format_map"})
_RAW_MEMORY = frozenset({"getbuffer"})

_ALIAS_TYPES: frozenset[type] = frozenset(
    type(alias) for alias in (
        typing.List, typing.List[int], typing.Union[int, str], typing.Callable,
        typing.Callable[[int], int], typing.Tuple, typing.Tuple[int], typing.Literal[0],
        typing.Annotated[int, 0], typing.Generic[typing.AnyStr], list[int]))
"""Types of typing's aliases (each has an ``__origin__``)."""
_ALIAS_ORIGINS = (typing._SpecialForm, typing._BaseGenericAlias,  # type: ignore[attr-defined]
                  typing.TypeVar, typing.ParamSpec)
"""What an alias may stand for besides a class: typing's own forms and aliases."""
"""C methods that hand out a view of raw memory (``BytesIO.getbuffer``)."""

_CONTAINERS: frozenset[type] = frozenset({
    list, tuple, set, frozenset, dict, collections.deque, collections.OrderedDict,
    collections.defaultdict, collections.Counter,
})
"""Exact container types :meth:`Admission.admit_deep` walks."""


def _sample_types() -> set[type]:
    """Types of objects the held classes' methods and the allowed modules hand out whose
    classes are not public: iterators, views, typing's aliases, hash and csv objects..."""
    T = typing.TypeVar("T")
    ordered = collections.OrderedDict()
    samples: list[Any] = [
        iter([]), iter(()), iter(""), iter("é"), iter(b""), iter(bytearray()), iter(set()),
        iter(range(1)), iter(range(10 ** 20)), iter({}), iter({}.values()), iter({}.items()),
        reversed([]), reversed({}), reversed({}.values()), reversed({}.items()),
        {}.keys(), {}.values(), {}.items(),
        ordered.keys(), ordered.values(), ordered.items(), iter(ordered),
        iter(ordered.values()), iter(ordered.items()), reversed(ordered),
        iter(collections.deque()), reversed(collections.deque()),
        re.finditer("", ""), iter(lambda: 0, 0),
        hashlib.sha256(), hashlib.blake2b(), hashlib.blake2s(),
        csv.reader([]), csv.writer(io.StringIO()),
        functools.lru_cache(lambda: 0),
        next(itertools.groupby("a"))[1], itertools.tee("a")[0],
        typing.List, typing.List[int], typing.Union, typing.Union[int, str],
        typing.Callable, typing.Callable[[int], int], typing.Tuple, typing.Tuple[int],
        typing.Literal[0], typing.Annotated[int, 0], typing.Generic[T], list[int], int | str,
        typing.ParamSpec("P").args, typing.ParamSpec("P").kwargs,
        (i for i in ()),
        functools.lru_cache()(lambda: 0).cache_info(), functools.cmp_to_key(len),
        functools.cmp_to_key(len)(0), datetime.date(2000, 1, 1).isocalendar(),
        decimal.Decimal(1).as_tuple(), decimal.localcontext(), unicodedata.ucd_3_2_0,
        hashlib.shake_128(), statistics.linear_regression([1, 2], [1, 2]),
        dataclasses.MISSING, dataclasses.KW_ONLY,
    ]
    return {type(sample) for sample in samples}


@functools.cache
def held_instance_types() -> frozenset[type]:
    """Exact types of the objects a cell may hold (besides plain data and what it made)."""
    return held_instance_classes() | frozenset(_sample_types()) | {
        SandboxFunction, TypeView, types.GeneratorType}


_REFUSED: tuple[type, ...] = (
    types.ModuleType, types.FrameType, types.CodeType, types.TracebackType, types.CellType,
    memoryview, typing.ForwardRef, types.WrapperDescriptorType, types.GetSetDescriptorType,
    types.MemberDescriptorType, types.ClassMethodDescriptorType, types.CoroutineType,
    types.AsyncGeneratorType,
)


def _name_of(value: Any) -> str:
    name = getattr(value, "__name__", None)
    return name if isinstance(name, str) else "?"


# --------------------------------------------------------------------------- admission

class Admission:
    """One sandbox's admission (see the module docstring)."""

    def __init__(self, provenance: Provenance) -> None:
        self.provenance = provenance
        self.namespace = provenance.namespace
        self._held_instance_ids: set[int] = set(map(id, held_instance_types()))
        self._held_class_ids: set[int] = set(map(id, held_classes()))
        self._held_keep: list[type] = []  # keeps the ids of classes held later valid
        self._known_functions: set[int] = set()
        self._known_keep: list[Any] = []  # keeps the ids in `_known_functions` valid
        self._views: weakref.WeakKeyDictionary[type, TypeView] = weakref.WeakKeyDictionary()
        self._builtins_dicts: list[dict[str, Any]] = []
        self._checked: dict[int, CheckedClass] = {
            id(cls): CheckedClass(cls, self.admit) for cls in CHECKED_CLASSES}
        self.sandbox_type = sandbox_type(self.admit_class)
        """This sandbox's ``type`` (``type(x)`` answers what :meth:`admit_class` admits)."""
        self.format_guard: Callable[[Any, str], Any] | None = None
        """Turns a raw ``str.format`` / ``format_map`` (bound to a string, or unbound) into
        the guarded version (set by guards.py)."""
        self._rules: dict[type, Callable[[Any], Any]] = {
            dict: self._dict,
            types.FunctionType: self._function,
            types.MethodType: self._method,
            types.BuiltinFunctionType: self._builtin,
            types.MethodDescriptorType: self._descriptor,
            types.MethodWrapperType: self._method_wrapper,
            types.MappingProxyType: dict,  # a copy: its items are admitted when read
            functools.partial: self._partial,
            property: self._property,
            enum.property: self._property,
            enum.member: self._wrapped_value,
            enum.nonmember: self._wrapped_value,
            dataclasses.Field: self._field,
            classmethod: self._wrapped_function,
            staticmethod: self._wrapped_function,
            functools.cached_property: self._wrapped_func,
            functools.partialmethod: self._wrapped_func,
            type(functools.lru_cache(lambda: 0)): self._lru_wrapper,
        }
        for alias_type in _ALIAS_TYPES:
            self._rules[alias_type] = self._alias
        for kind in _REFUSED:
            self._rules[kind] = self._refuse
        self.hold_class(AdmissionError)  # what a cell catches when admission refuses
        self.hold(CheckedClass)
        provenance.check_class = self.check_class

    # -- registration ------------------------------------------------------------------------
    def hold(self, kind: type) -> None:
        """Let objects of exact type ``kind`` in (the shadow's lazy values, for one)."""
        self._held_instance_ids.add(id(kind))
        self._held_keep.append(kind)

    def hold_class(self, cls: type) -> None:
        """Let class ``cls`` in as a class, and its instances (``ToolError``, for one)."""
        self.hold(cls)
        self._held_class_ids.add(id(cls))

    def know_function(self, function: Any) -> None:
        """A C function bound to a module that the sandbox hands out (a builtin, a facade's
        function): it passes by identity."""
        if type(function) is types.BuiltinFunctionType and id(function) not in \
                self._known_functions:
            self._known_functions.add(id(function))
            self._known_keep.append(function)

    def refuse_dict(self, mapping: dict[str, Any]) -> None:
        """Refuse ``mapping`` by identity (the sandbox's builtins dict)."""
        self._builtins_dicts.append(mapping)

    # -- the check ---------------------------------------------------------------------------
    def admit(self, value: Any) -> Any:
        """``value`` as the cell may hold it (maybe a wrapper or a view), or AdmissionError."""
        kind = type(value)
        if kind in _PLAIN:
            return value
        rule = self._rules.get(kind)
        if rule is not None:
            return rule(value)
        if id(kind) in self._held_instance_ids or self.provenance.made_class(kind):
            return value
        if isinstance(value, type):
            return self.admit_class(value)
        raise AdmissionError(f"a {kind.__qualname__!r} object cannot enter the sandbox")

    def admit_exception(self, exc: BaseException) -> BaseException:
        """What ``except ... as name`` binds: ``exc`` if it passes as it is, else an exception
        of the nearest class in its MRO the cell may hold, with its arguments if they pass
        (else its message): stdlib code raises exceptions of classes no facade shows
        (``io.UnsupportedOperation``), whose methods and state are not the cell's to use."""
        if self.admissible(exc):
            return exc
        try:
            args: tuple[Any, ...] = tuple(self.admit(arg) for arg in exc.args) \
                if type(exc.args) is tuple else ()
        except AdmissionError:
            args = (str(exc),)
        for cls in type(exc).__mro__:
            if issubclass(cls, BaseException) and self.admit_class(cls) is cls:
                try:
                    stand_in = cls(*args)
                except Exception:
                    continue
                if type(stand_in) is cls:
                    return stand_in
        return Exception(*args)

    def admissible(self, value: Any) -> bool:
        """Whether ``value`` passes as it is (no wrapper, no view)."""
        try:
            return self.admit(value) is value
        except AdmissionError:
            return False

    def admit_class(self, cls: type) -> Any:
        """A class as the cell may hold it: itself, the sandbox's ``type`` for a metaclass, a
        `CheckedClass` for one of `CHECKED_CLASSES`, or a `TypeView`."""
        if issubclass(cls, type):
            return self.sandbox_type
        checked = self._checked.get(id(cls))
        if checked is not None:
            return checked
        provenance = self.provenance
        if id(cls) in self._held_class_ids or provenance.made_class(cls) \
                or provenance.vetted_base(cls) or cls is self.sandbox_type:
            return cls
        view = self._views.get(cls)
        if view is None:
            view = self._views[cls] = TypeView(cls)
        return view

    def check_class(self, cls: type) -> None:
        """Raise unless every value in the own class dict of ``cls``, a class just made for a
        cell, is one the sandbox allows there: whatever path wrote it (the class body,
        ``setattr``, a class factory, a wrapper a metaclass unwraps), a class the cell made
        holds no object admission refuses. Under a public name (what a cell reads, what a
        class factory writes the cell's values under), a value passes as it is, or is a slot
        of ``cls`` itself or a named tuple's field getter. Under a name starting with ``_``
        (which Python calls with raw objects: ``__eq__``, ``__init__``), a value is the
        cell's own function, data that passes as it is (no callable but a class), or what
        Python and the stdlib's class machinery write there (`_machinery`); a C callable
        (``box.append``, a partial, a descriptor around one) never is."""
        namespace = type.__dict__["__dict__"].__get__(cls)
        made_function = self.provenance.made_function
        for key, value in list(namespace.items()):
            if type(key) is not str:
                raise AdmissionError(f"class {cls.__name__}: a name in its dict is not a "
                                     "string")
            if key.startswith("_"):
                ok = made_function(value) or _machinery(cls, value) or (
                    self.admissible(value) and (isinstance(value, type) or not callable(value)))
            else:
                ok = self.admissible(value) or public_machinery(cls, key, value)
            if not ok:
                raise AdmissionError(f"class {cls.__name__}: {key!r} holds a "
                                     f"{type(value).__qualname__!r} object the sandbox does "
                                     "not allow in a class it made")

    def admit_deep(self, value: Any) -> Any:
        """:meth:`admit`, also of every item of the builtin containers inside ``value`` (a
        container whose items changed is rebuilt; the others are returned as they are)."""
        return self._deep(value, {})

    def _deep(self, value: Any, memo: dict[int, Any]) -> Any:
        kind = type(value)
        if kind not in _CONTAINERS:
            return self.admit(value)
        if id(value) in memo:
            return memo[id(value)]
        memo[id(value)] = value
        if kind is dict or kind is collections.OrderedDict or kind is collections.defaultdict \
                or kind is collections.Counter:
            self._dict(value)
            pairs = [(self._deep(k, memo), self._deep(v, memo)) for k, v in value.items()]
            if any(a is not k or b is not v for (a, b), (k, v) in zip(pairs, value.items())):
                value.clear()
                value.update(pairs)
            return value
        items = [self._deep(item, memo) for item in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        if kind is list:
            value[:] = items
            return value
        if kind is collections.deque:
            value.clear()
            value.extend(items)
            return value
        rebuilt = kind(items)  # tuple, set, frozenset
        memo[id(value)] = rebuilt
        return rebuilt

    def iterate(self, iterable: Any) -> Iterator[Any]:
        """``iter(iterable)`` whose items are admitted (``for`` loops, comprehensions,
        unpacking)."""
        if type(iterable) in _PLAIN_ITEMS:
            return iter(iterable)
        return map(self.admit, iter(iterable))

    # -- rules by kind -----------------------------------------------------------------------
    def _refuse(self, value: Any) -> Any:
        raise AdmissionError(f"a {type(value).__name__} object cannot enter the sandbox")

    def _dict(self, value: dict[str, Any]) -> Any:
        if value is self.namespace or any(value is d for d in self._builtins_dicts) \
                or _is_module_globals(value):
            raise AdmissionError("a module's globals, the namespace or a builtins dict cannot "
                                 "enter the sandbox")
        return value

    def _function(self, value: types.FunctionType) -> Any:
        if value.__globals__ is self.namespace:
            return value
        return SandboxFunction(value, self.admit_deep)

    def _method(self, value: types.MethodType) -> Any:
        function, owner = value.__func__, value.__self__
        if type(function) is types.FunctionType and function.__globals__ is self.namespace \
                and self.admissible(owner):
            return value
        return SandboxFunction(value, self.admit_deep)

    def _builtin(self, value: types.BuiltinFunctionType) -> Any:
        owner = value.__self__
        if type(owner) in _PLAIN:  # the hot path: a method of a string or a container
            name = value.__name__
            if name[0] == "_":
                raise AdmissionError(f"the method {name!r} cannot enter the sandbox")
            if name in _FORMAT_NAMES and type(owner) is str and self.format_guard is not None:
                return self.format_guard(owner, name)
            return value
        if owner is None or type(owner) is types.ModuleType:
            if id(value) in self._known_functions:
                return value
            raise AdmissionError(f"the function {_name_of(value)!r} is not one the "
                                 "sandbox hands out")
        name = _name_of(value)
        if isinstance(owner, str) and name in ("format", "format_map") \
                and self.format_guard is not None:
            return self.format_guard(owner, name)
        if name == "__init__" and self.provenance.made(owner):
            return value  # super().__init__ (guards.py)
        if name.startswith("_") or name in _RAW_MEMORY:
            raise AdmissionError(f"the method {name!r} cannot enter the sandbox")
        if isinstance(owner, type):
            if self.admit_class(owner) is not owner:
                raise AdmissionError(f"a method of {owner.__qualname__!r} cannot enter the "
                                     "sandbox")
            return value
        if not self.admissible(owner):
            raise AdmissionError(f"a method of a {type(owner).__qualname__!r} object cannot "
                                 "enter the sandbox")
        if type(owner) is property:  # getter/setter/deleter build a property: admitted
            return SandboxFunction(value, self.admit)
        return value

    def _descriptor(self, value: Any) -> Any:
        name, owner = value.__name__, value.__objclass__
        if name.startswith("_") or name in _RAW_MEMORY or self.admit_class(owner) is not owner:
            raise AdmissionError(f"the method {owner.__qualname__}.{name} cannot enter the "
                                 "sandbox")
        if owner is str and name in ("format", "format_map") and self.format_guard is not None:
            return self.format_guard(None, name)
        return value

    def _method_wrapper(self, value: Any) -> Any:
        if value.__name__ == "__init__" and self.provenance.made(value.__self__):
            return value  # super().__init__ of an object the sandbox made (guards.py)
        return self._refuse(value)

    def _partial(self, value: functools.partial) -> Any:
        func = self.admit(value.func)
        args = tuple(self.admit(arg) for arg in value.args)
        keywords = {key: self.admit(arg) for key, arg in value.keywords.items()}
        if func is value.func and all(a is b for a, b in zip(args, value.args)) \
                and all(keywords[k] is v for k, v in value.keywords.items()):
            return value
        return functools.partial(func, *args, **keywords)

    def _cell_function(self, inner: Any, what: str) -> None:
        """Descriptors and caches wrap only the cell's own functions: Python calls what a
        descriptor wraps with raw objects (the instance, the class being made), and a cell's
        function admits its parameters, a C callable or a stdlib function does not."""
        if inner is not None and not self.provenance.made_function(inner):
            raise AdmissionError(f"a {what} in the sandbox wraps only a function defined in "
                                 "the sandbox")

    def _property(self, value: Any) -> Any:
        for inner in (value.fget, value.fset, value.fdel):
            self._cell_function(inner, type(value).__name__)
        return value

    def _wrapped_function(self, value: Any) -> Any:
        self._cell_function(value.__func__, type(value).__name__)
        return value

    def _wrapped_func(self, value: Any) -> Any:
        self._cell_function(value.func, type(value).__name__)
        if isinstance(value, functools.partialmethod):
            for arg in (*value.args, *value.keywords.values()):
                self.admit(arg)
        return value

    def _inner_as_is(self, inner: Any, what: str) -> None:
        if not self.admissible(inner):
            raise AdmissionError(f"a {what} around an object the sandbox may not hold")

    def _wrapped_value(self, value: Any) -> Any:
        """``enum.member`` / ``enum.nonmember``: the class being made unwraps the value into
        its namespace (a ``nonmember`` becomes a class attribute, a descriptor one too), so it
        must pass as it is (C code builds one around any value: ``map(enum.nonmember, ...)``)."""
        self._inner_as_is(value.value, type(value).__name__)
        return value

    def _field(self, value: dataclasses.Field) -> Any:
        """``dataclasses.Field``: ``dataclass`` sets its default as a class attribute and calls
        its default factory, so both must pass as they are (``dataclasses.Field`` can be built
        by C code around any value)."""
        for inner in (value.default, value.default_factory):
            self._inner_as_is(inner, "dataclasses.Field")
        return value

    def _lru_wrapper(self, value: Any) -> Any:
        self._cell_function(value.__wrapped__, "lru_cache wrapper")
        return value

    def _alias(self, value: Any) -> Any:
        """A typing alias (``List[int]``, ``Annotated[X, m]``, ``list[int]``): only over what
        calling it may construct (calling an alias calls what it aliases and then writes
        ``__orig_class__`` into the result, which must not be a class or a shared member).
        The sandbox's ``type`` is no such class: it answers with existing classes
        (``Annotated[type, 0](json.JSONDecoder())`` wrote into ``json.JSONDecoder``)."""
        origin = object.__getattribute__(value, "__origin__")
        if isinstance(origin, type):
            if issubclass(origin, (type, enum.Enum)) or is_sandbox_type(origin) \
                    or self.admit_class(origin) is not origin:
                raise AdmissionError(f"typing alias of {origin.__qualname__!r} cannot enter "
                                     "the sandbox")
        elif not isinstance(origin, _ALIAS_ORIGINS):
            raise AdmissionError("a typing alias of this object cannot enter the sandbox")
        return value


_TUPLE_GETTER: type = type(vars(collections.namedtuple("P", "x"))["x"])
"""What ``namedtuple`` puts under each field name: reads one item of the tuple."""
_DATACLASS_PARAMS: type = type(vars(dataclasses.dataclass(type("P", (), {})))[
    "__dataclass_params__"])
_ABC_DATA: type = type(vars(collections.abc.Mapping)["_abc_impl"])


def _own_slot(cls: type, value: Any) -> bool:
    """A slot, ``__dict__`` or ``__weakref__`` descriptor Python made for ``cls`` itself."""
    return type(value) in (types.MemberDescriptorType, types.GetSetDescriptorType) \
        and value.__objclass__ is cls


def public_machinery(cls: type, key: str, value: Any) -> bool:
    """What Python and the stdlib's class machinery write into ``cls`` under a public name
    that admission would not let in as it is: a slot of ``cls`` itself, a named tuple's field
    getter, an enum member's redirect."""
    return _own_slot(cls, value) or type(value) is _TUPLE_GETTER \
        or _enum_redirect(cls, key, value)


def _enum_redirect(cls: type, key: str, value: Any) -> bool:
    """The ``enum.property`` that ``EnumType`` puts under a member's name which a base
    defines as a descriptor (a member called ``name``): it holds the member and that
    descriptor's own functions."""
    if type(value) is not enum.property or type(vars(value).get("member")) is not cls:
        return False
    inherited = [vars(base).get(key) for base in cls.__mro__[1:]]
    return all(function is None or any(function is getattr(d, attr, None) for d in inherited)
               for attr in ("fget", "fset", "fdel")
               for function in (getattr(value, attr),))


def _machinery(cls: type, value: Any) -> bool:
    """What Python and the stdlib's class machinery (``type``, ``ABCMeta``, ``EnumType``,
    typing's metaclasses, ``namedtuple``, ``dataclass``) write under a name starting with
    ``_``: the class's own slots, Python functions (generated or the stdlib's: a cell holds
    none raw, only as a `SandboxFunction`), the static or class methods around them and such
    functions bound to ``cls``, the slot wrappers and the ``__new__`` of a class ``cls``
    derives from, a named tuple's field getters (``rename=True`` names them ``_1``...), an
    ABC's cache, a dataclass's parameters."""
    kind = type(value)
    if kind is types.MethodType and value.__self__ is cls:  # a flag's _iter_member_
        value, kind = value.__func__, type(value.__func__)
    if kind in (staticmethod, classmethod):
        value, kind = value.__func__, type(value.__func__)
    if kind in (types.FunctionType, _TUPLE_GETTER, _DATACLASS_PARAMS, _ABC_DATA):
        return True
    if kind in (types.WrapperDescriptorType, types.MethodDescriptorType):
        return any(value.__objclass__ is base for base in cls.__mro__)
    if kind is types.BuiltinFunctionType:  # an enum's _new_member_
        return value.__name__ == "__new__" and any(value.__self__ is b for b in cls.__mro__)
    return _own_slot(cls, value)


class _ModuleGlobals:
    """Recognises the globals dict of a loaded module (and the builtins' dict) by identity."""

    def __init__(self) -> None:
        self._ids: set[int] = set()
        self._count = -1

    def holds(self, value: dict[str, Any]) -> bool:
        if value is vars(builtins) or "__builtins__" in value:
            return True
        if len(sys.modules) != self._count:
            modules = list(sys.modules.values())
            self._ids = {id(vars(module)) for module in modules if module is not None}
            self._count = len(sys.modules)
        return id(value) in self._ids


_is_module_globals = _ModuleGlobals().holds


__all__ = ["CHECKED_CLASSES", "Admission", "AdmissionError", "CheckedClass", "TypeView",
           "held_instance_types", "public_machinery"]
