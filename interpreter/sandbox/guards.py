"""The guards that depend on one sandbox: attribute reads (``_getattr_``, ``getattr``,
``hasattr``, ``str.format`` field lookups), subscripts, calls written with ``*``/``**``,
augmented assignment, and writes (``_write_``, ``setattr``, ``delattr``).

A read refuses private and internal names (policy.check_attribute_name), ``__init__`` except on
``super()`` of an instance the sandbox made, ABC registration, raw buffers, any attribute of a
typing alias (aliases forward reads and writes to what they alias); what it found passes
:meth:`Admission.admit`, and a mutable container read off a class (shared by every instance)
comes as a copy. A write is allowed on the mutable builtin containers and on what the sandbox
made, decided by identity.
"""

from __future__ import annotations

import _string  # type: ignore[import-not-found]
import abc
import collections
import decimal
import functools
import io
import operator
import string
import types
import typing
from collections.abc import Callable
from typing import Any, Final

from .admission import Admission, AdmissionError
from .policy import MISSING, check_attribute_name
from .provenance import Provenance, SandboxFunction

_WRITABLE_TYPES = (list, dict, set, bytearray, collections.deque, decimal.Context)
_ALIASES = (typing._BaseGenericAlias, types.GenericAlias)  # type: ignore[attr-defined]
"""typing's aliases, which forward attribute reads and writes to what they alias."""
_SHARED_CONTAINERS = frozenset({list, dict, set, bytearray, collections.deque,
                                collections.OrderedDict, collections.defaultdict,
                                collections.Counter})

_INPLACE_OPERATORS: Final[dict[str, Callable[[Any, Any], Any]]] = {
    "+=": operator.iadd, "-=": operator.isub, "*=": operator.imul, "/=": operator.itruediv,
    "//=": operator.ifloordiv, "%=": operator.imod, "**=": operator.ipow,
    "<<=": operator.ilshift, ">>=": operator.irshift, "|=": operator.ior,
    "^=": operator.ixor, "&=": operator.iand, "@=": operator.imatmul,
}


class Guards:
    """One sandbox's guards (see the module docstring)."""

    def __init__(self, provenance: Provenance, admission: Admission) -> None:
        self.provenance = provenance
        self.admission = admission
        self._format: Final = SandboxFunction(self.format)
        self._format_map: Final = SandboxFunction(self.format_map)
        admission.format_guard = self.guarded_format

    # -- reads -----------------------------------------------------------------------------
    def getattr(self, obj: Any, name: str, default: Any = MISSING) -> Any:
        """``getattr`` for sandboxed code (see the module docstring)."""
        if name == "__init__" and type(obj) is super:
            owner = obj.__self__
            if isinstance(owner, type) or not self.provenance.made(owner):
                raise AttributeError("super().__init__ is available only on objects of classes "
                                     "defined in the sandbox")
            return self.admission.admit(obj.__init__)
        check_attribute_name(obj.__self__ if type(obj) is super else obj, name)
        if isinstance(obj, _ALIASES):
            raise AttributeError(f'"{name}": typing\'s aliases have no attributes in the '
                                 "sandbox (they would read the attributes of what they alias)")
        if name == "register" and (isinstance(obj, abc.ABCMeta) or obj is abc.ABCMeta):
            raise AttributeError(f"{obj.__name__}.register() is not available in the sandbox "
                                 "(it changes what isinstance() answers for everyone)")
        if name == "getbuffer" and isinstance(obj, io.BytesIO):
            raise AttributeError('"getbuffer" is not accessible in the sandbox (no raw memory '
                                 'access)')
        try:
            value = getattr(obj, name)
        except AttributeError:
            if default is MISSING:
                raise
            return default
        try:
            value = self.admission.admit(value)
        except AdmissionError as exc:
            raise AttributeError(f'"{name}": {exc}') from None
        if type(value) in _SHARED_CONTAINERS and self._shared(obj, name):
            value = _shallow_copy(value)
        return value

    def _shared(self, obj: Any, name: str) -> bool:
        """Whether attribute ``name`` of ``obj`` is state shared beyond ``obj``: a class
        attribute of a class the sandbox did not make."""
        if self.provenance.made(obj):
            return False
        if isinstance(obj, type):
            return True
        try:
            own = object.__getattribute__(obj, "__dict__")
        except AttributeError:
            return False
        if type(own) is dict and name in own:
            return False
        return any(name in vars(cls) for cls in type(obj).__mro__)

    def hasattr(self, obj: Any, name: str) -> bool:
        """``hasattr`` that answers through :meth:`getattr`."""
        try:
            self.getattr(obj, name)
        except (AttributeError, TypeError):
            return False
        return True

    def getitem(self, obj: Any, key: Any) -> Any:
        """``obj[key]``, admitted."""
        return self.admission.admit(obj[key])

    def apply(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Calls written with ``*args`` / ``**kwargs``: what was unpacked is admitted, and the
        result; keyword names starting with ``_`` are refused."""
        admit = self.admission.admit
        for key in kwargs:
            if key.startswith("_"):
                raise TypeError(f'keyword argument "{key}" is not allowed in the sandbox: '
                                'names starting with "_" are private')
        return admit(function(*[admit(arg) for arg in args],
                              **{key: admit(value) for key, value in kwargs.items()}))

    def inplacevar(self, op: str, target: Any, value: Any) -> Any:
        """``target op= value`` for plain names, admitted."""
        return self.admission.admit(_INPLACE_OPERATORS[op](target, value))

    # -- the guarded str.format ----------------------------------------------------------------
    def format(self, template: str, /, *args: Any, **kwargs: Any) -> str:
        """``str.format`` whose field lookups (``{0.attr}``, ``{0[key]}``) are guarded."""
        if not isinstance(template, str):
            raise TypeError("format() needs a str template")
        return _GuardedFormatter(self).vformat(template, args, kwargs)

    def format_map(self, template: str, mapping: Any, /) -> str:
        """``str.format_map`` with guarded field lookups."""
        if not isinstance(template, str):
            raise TypeError("format_map() needs a str template")
        return _GuardedFormatter(self).vformat(template, (), mapping)

    def guarded_format(self, template: str | None, name: str) -> Any:
        """The guarded ``format`` or ``format_map``, bound to ``template`` when given."""
        function = self._format if name == "format" else self._format_map
        return function if template is None else functools.partial(function, template)

    # -- writes ----------------------------------------------------------------------------
    def writable(self, obj: Any) -> bool:
        """Whether sandboxed code may write items or attributes of ``obj``."""
        return isinstance(obj, _WRITABLE_TYPES) or self.provenance.made(obj)

    def write(self, obj: Any) -> Any:
        """``_write_``: ``obj`` if the sandbox may write into it, else TypeError."""
        if self.writable(obj):
            return obj
        raise TypeError(
            f"cannot modify {type(obj).__name__!r} objects in the sandbox (only lists, dicts, "
            "sets and objects of classes defined in the sandbox can be changed)")

    def setattr(self, obj: Any, name: str, value: Any) -> None:
        """``setattr`` for sandboxed code. The value is admitted too: C code can call this
        function with a value no door saw (``map(setattr, [C], ['x'], map(property, [len]))``
        built a descriptor admission refuses and put it on a class the cell made)."""
        check_attribute_name(obj, name)
        setattr(self.write(obj), name, self.admission.admit(value))

    def delattr(self, obj: Any, name: str) -> None:
        """``delattr`` for sandboxed code."""
        check_attribute_name(obj, name)
        delattr(self.write(obj), name)


def _shallow_copy(value: Any) -> Any:
    if type(value) is collections.deque:
        return collections.deque(value, value.maxlen)
    if type(value) is collections.defaultdict:
        return collections.defaultdict(value.default_factory, value)
    return type(value)(value)


class _GuardedFormatter(string.Formatter):
    """The formatter behind :meth:`Guards.format`."""

    def __init__(self, guards: Guards) -> None:
        self._guards = guards

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> tuple[Any, Any]:
        first, rest = _string.formatter_field_name_split(field_name)
        obj = self.get_value(first, args, kwargs)
        for is_attribute, key in rest:
            obj = self._guards.getattr(obj, key) if is_attribute else self._guards.getitem(obj,
                                                                                          key)
        return obj, first
