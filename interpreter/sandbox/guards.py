"""The guards that depend on one sandbox's :class:`~.provenance.Provenance`: attribute reads
(``_getattr_``, ``getattr``, ``hasattr``, ``str.format`` field lookups) and writes
(``_write_``, ``setattr``, ``delattr``).

A read refuses private and internal names (policy.check_attribute_name), ``__init__`` except on
``super()`` of an instance the sandbox made, ABC registration and raw buffers, and passes what
it found through :meth:`Provenance.admit_attribute`. A write is allowed on the mutable builtin
containers and on what the sandbox made, decided by identity.
"""

from __future__ import annotations

import _string  # type: ignore[import-not-found]
import abc
import collections
import decimal
import functools
import io
import string
import types
from typing import Any, Final

from .policy import MISSING, check_attribute_name
from .provenance import Provenance

_WRITABLE_TYPES = (list, dict, set, bytearray, collections.deque, decimal.Context)


class Guards:
    """One sandbox's attribute guards (see the module docstring)."""

    def __init__(self, provenance: Provenance) -> None:
        self.provenance = provenance
        self._str_overrides: Final = {"format": self.format, "format_map": self.format_map}
        self._raw_str_format: Final = {str.format: self.format, str.format_map: self.format_map}

    # -- reads -----------------------------------------------------------------------------
    def getattr(self, obj: Any, name: str, default: Any = MISSING) -> Any:
        """``getattr`` for sandboxed code (see the module docstring)."""
        if name == "__init__" and type(obj) is super:
            owner = obj.__self__
            if isinstance(owner, type) or not self.provenance.made(owner):
                raise AttributeError("super().__init__ is available only on objects of classes "
                                     "defined in the sandbox")
            return obj.__init__
        check_attribute_name(obj, name)
        if name == "register" and isinstance(obj, abc.ABCMeta):
            raise AttributeError(f"{obj.__name__}.register() is not available in the sandbox "
                                 "(it changes what isinstance() answers for everyone)")
        if name in self._str_overrides:
            if isinstance(obj, str):
                return functools.partial(self._str_overrides[name], obj)
            if isinstance(obj, type) and issubclass(obj, str):
                return self._str_overrides[name]
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
            value = self.provenance.admit_attribute(value)
        except TypeError as exc:
            raise AttributeError(f'"{name}": {exc}') from None
        return self._without_raw_format(value)

    def _without_raw_format(self, value: Any) -> Any:
        """``value``, unless it is the raw ``str.format``/``format_map`` (reached e.g. through
        ``super()`` in a ``str`` subclass): then the guarded version."""
        if type(value) is types.BuiltinMethodType and isinstance(value.__self__, str) \
                and value.__name__ in self._str_overrides:
            return functools.partial(self._str_overrides[value.__name__], value.__self__)
        try:
            return self._raw_str_format.get(value, value)
        except TypeError:  # unhashable
            return value

    def hasattr(self, obj: Any, name: str) -> bool:
        """``hasattr`` that answers through :meth:`getattr`."""
        try:
            self.getattr(obj, name)
        except (AttributeError, TypeError):
            return False
        return True

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
        """``setattr`` for sandboxed code."""
        check_attribute_name(obj, name)
        setattr(self.write(obj), name, value)

    def delattr(self, obj: Any, name: str) -> None:
        """``delattr`` for sandboxed code."""
        check_attribute_name(obj, name)
        delattr(self.write(obj), name)


class _GuardedFormatter(string.Formatter):
    """The formatter behind :meth:`Guards.format`."""

    def __init__(self, guards: Guards) -> None:
        self._guards = guards

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> tuple[Any, Any]:
        first, rest = _string.formatter_field_name_split(field_name)
        obj = self.get_value(first, args, kwargs)
        for is_attribute, key in rest:
            obj = self._guards.getattr(obj, key) if is_attribute else obj[key]
        return obj, first
