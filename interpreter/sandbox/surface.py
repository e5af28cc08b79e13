"""What the sandbox exposes, as data: the modules ``import`` may load, which of each module's
public names a facade shows, and the classes a cell may hold.

modules.py builds the facades from this (adding the vetted replacements), and admission.py
admits a class only if it is one of :func:`held_classes` (or the sandbox made it), so a class
a facade leaves out is not held either, however a cell comes across it.
"""

from __future__ import annotations

import builtins
import collections
import collections.abc
import dataclasses
import decimal
import enum
import functools
import importlib
import operator
import string
import types
import typing
from collections.abc import Iterator
from typing import Any

ALLOWED_MODULES = frozenset({
    "base64", "binascii", "bisect", "cmath", "collections", "collections.abc", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "enum", "fractions", "functools",
    "hashlib", "heapq", "html", "io", "itertools", "json", "math", "numbers", "operator",
    "pprint", "random", "re", "statistics", "string", "textwrap", "time", "typing",
    "unicodedata",
})
"""Modules ``import`` may load. All are pure computation; see docs/sandbox.md for why."""


@dataclasses.dataclass(frozen=True)
class Exposure:
    """Which public names of a module its facade shows."""

    only: tuple[str, ...] = ()
    """If given, these names alone."""
    deny: frozenset[str] = frozenset()
    """Names left out."""
    plain_results: bool = False
    """Its functions return only numbers, strings and containers of what they were given, so
    their results need no deep admission (kept fast)."""


EXPOSURES: dict[str, Exposure] = {
    "typing": Exposure(deny=frozenset({
        "get_type_hints", "ForwardRef",  # both evaluate strings
        "overload", "get_overloads", "clear_overloads",  # a process-wide registry
        "no_type_check_decorator"})),  # marks whatever its decorator returns
    "json": Exposure(plain_results=True),
    "csv": Exposure(deny=frozenset({  # the process-wide dialect registry and field limit
        "register_dialect", "unregister_dialect", "field_size_limit"})),
    "math": Exposure(plain_results=True),
    "cmath": Exposure(plain_results=True),
    "functools": Exposure(deny=frozenset({"singledispatch", "singledispatchmethod"})),
    "copy": Exposure(plain_results=True),  # the sandbox's own copying (copying.py)
    "operator": Exposure(deny=frozenset({"call"})),  # calls what a container holds
    "string": Exposure(deny=frozenset({"Formatter"})),  # unguarded field lookups
    "collections": Exposure(deny=frozenset({"UserString"})),  # .format() is raw str.format
    "enum": Exposure(deny=frozenset({
        "global_enum", "global_enum_repr", "global_flag_repr", "global_str", "EnumMeta",
        "EnumType", "ReprEnum", "pickle_by_global_name", "pickle_by_enum_name"})),
    "dataclasses": Exposure(deny=frozenset({"make_dataclass"})),
    "hashlib": Exposure(deny=frozenset({"file_digest"})),  # hands a memoryview to a callback
    "time": Exposure(only=("sleep", "time", "time_ns", "monotonic", "monotonic_ns",
                           "perf_counter", "perf_counter_ns", "gmtime", "localtime",
                           "strftime", "mktime", "struct_time")),
    "io": Exposure(only=("StringIO", "BytesIO")),
    "pprint": Exposure(only=("pformat", "saferepr", "isreadable", "isrecursive")),
    "html": Exposure(only=("escape", "unescape")),
}

MUTABLE_MODULE_VALUES = (types.ModuleType, dict, list, set, bytearray, decimal.Context)
"""Module attributes a facade never shows: submodules and shared mutable state (``decimal``'s
default contexts among them)."""


def exposure(name: str) -> Exposure:
    """The exposure of allowed module ``name``."""
    return EXPOSURES.get(name, Exposure())


def exposed_names(name: str, module: types.ModuleType) -> Iterator[str]:
    """The public names of ``module`` its facade may show (before vetted replacements)."""
    rule = exposure(name)
    names = rule.only or getattr(module, "__all__", None) or list(vars(module))
    for attr in names:
        if not attr.startswith("_") and attr not in rule.deny:
            yield attr


def _public_classes(name: str, module: types.ModuleType) -> Iterator[type]:
    for attr in exposed_names(name, module):
        value = getattr(module, attr, None)
        if isinstance(value, type) and not issubclass(value, type):
            yield value


NEVER_HELD: frozenset[type] = frozenset({
    memoryview, string.Formatter, collections.UserString, typing.ForwardRef,
    functools.singledispatchmethod, operator.attrgetter, operator.methodcaller,
    operator.itemgetter,
})
"""Classes no cell holds, whichever module shows them (the real ``attrgetter`` and
``methodcaller`` read any attribute, the real ``itemgetter`` subscripts where no door sees the
result: the facade's replacements are functions)."""


@functools.cache
def _exposed_classes() -> frozenset[type]:
    classes = {value for attr, value in vars(builtins).items() if not attr.startswith("_")
               and isinstance(value, type) and not issubclass(value, type)}
    for name in ALLOWED_MODULES:
        classes.update(_public_classes(name, importlib.import_module(name)))
    return frozenset(classes) - NEVER_HELD


def held_classes() -> frozenset[type]:
    """Classes a cell may hold as classes (besides those it made): the builtin types and the
    classes the facades show; never a metaclass, never one of :data:`NEVER_HELD`, never an
    ``Enum`` class (calling one with member names makes a new class with any attributes; the
    sandbox's own enum bases check them)."""
    return frozenset(cls for cls in _exposed_classes() if not issubclass(cls, enum.Enum))


def held_instance_classes() -> frozenset[type]:
    """Classes whose instances a cell may hold: the held classes and the facades' enums."""
    return _exposed_classes()


def mutable_module_value(value: Any) -> bool:
    """Whether a module attribute is shared state a facade must not show."""
    return isinstance(value, MUTABLE_MODULE_VALUES)


__all__ = ["ALLOWED_MODULES", "EXPOSURES", "Exposure", "NEVER_HELD", "exposed_names", "exposure",
           "held_classes", "held_instance_classes", "mutable_module_value"]
