"""The only builtins a cell sees: a curated safe set, the guarded versions of the dangerous
ones, the restricted ``__import__``, and the functions compiled code calls: RestrictedPython's
guards (``_getattr_``, ``_write_``, ...) and the doors' admission (``_admit_``...: doors.py).
Built per sandbox, bound to its context."""

from __future__ import annotations

import builtins
from collections.abc import Callable
from typing import Any, Final

from RestrictedPython.Guards import guarded_iter_unpack_sequence, guarded_unpack_sequence

from agentrt.tools.errors import ToolError

from .admission import Admission
from .classes import STATEMENT, ClassBuilder
from .doors import ADMIT, ADMIT_ALL, ADMIT_EXCEPTION, ADMIT_KEYWORDS, DECORATE, ENTER
from .modules import SandboxModule, guarded_import
from .output import Printer, SandboxContext

_SAFE_BUILTIN_NAMES = (
    "abs", "all", "any", "ascii", "bin", "bool", "bytearray", "bytes", "callable", "chr",
    "classmethod", "complex", "dict", "divmod", "enumerate", "filter", "float", "format",
    "frozenset", "hash", "hex", "id", "int", "isinstance", "issubclass", "iter", "len",
    "list", "map", "max", "min", "next", "object", "oct", "ord", "pow", "property", "range",
    "repr", "reversed", "round", "set", "slice", "sorted", "staticmethod", "str", "sum",
    "super", "tuple", "zip", "None", "True", "False", "Ellipsis", "NotImplemented",
)

_UNAVAILABLE_BUILTINS: Final = {
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


def _filtered_dir(namespace: dict[str, Any]) -> Callable[..., list[str]]:
    def dir(*args: Any) -> list[str]:  # noqa: A001 - the sandbox's dir()
        """``dir()`` listing public names only (the namespace's without an argument)."""
        if len(args) > 1:
            raise TypeError("dir() takes at most one argument")
        names = builtins.dir(args[0]) if args else list(namespace)
        return sorted(name for name in names if not name.startswith("_"))

    return dir


def make_builtins(context: SandboxContext) -> dict[str, Any]:
    """The builtins dict for the sandbox namespace of ``context`` (without tools and answer
    helpers)."""
    table: dict[str, Any] = {name: getattr(builtins, name) for name in _SAFE_BUILTIN_NAMES}
    for name, value in vars(builtins).items():
        if isinstance(value, type) and issubclass(value, BaseException) and name[0] != "_":
            table[name] = value
    for name, reason in _UNAVAILABLE_BUILTINS.items():
        table[name] = _unavailable(name, reason)
    printer = Printer(context)
    guards = context.guards
    table.update({
        "type": context.admission.sandbox_type,
        "getattr": guards.getattr,
        "hasattr": guards.hasattr,
        "setattr": guards.setattr,
        "delattr": guards.delattr,
        "dir": _filtered_dir(context.namespace),
        "ToolError": ToolError,
    })
    admission = context.admission
    admission.hold(SandboxModule)
    admission.hold_class(ToolError)
    for value in table.values():
        admission.know_function(value)
    table = {name: admission.admit(value) for name, value in table.items()}
    table.update({  # what compiled code calls; cells cannot name them ("_" names)
        "__import__": guarded_import(context),
        "__build_class__": ClassBuilder(context.provenance),
        "__metaclass__": STATEMENT,  # the restricted compiler passes it to every class statement
        "_getattr_": guards.getattr,
        "_getitem_": guards.getitem,
        "_getiter_": admission.iterate,
        "_write_": guards.write,
        "_inplacevar_": guards.inplacevar,
        "_apply_": guards.apply,
        "_iter_unpack_sequence_": guarded_iter_unpack_sequence,
        "_unpack_sequence_": guarded_unpack_sequence,
        "_print_": lambda _getattr=None: printer,
        **doors(admission),
    })
    admission.refuse_dict(table)
    return table


def doors(admission: Admission) -> dict[str, Callable[..., Any]]:
    """The functions the doors call (doors.py)."""
    admit = admission.admit

    def admit_all(values: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(admit(value) for value in values)

    def admit_keywords(values: dict[str, Any]) -> dict[str, Any]:
        return {key: admit(value) for key, value in values.items()}

    def decorate(decorator: Any) -> Callable[[Any], Any]:
        return lambda target: admit(decorator(target))

    def enter(manager: Any) -> _AdmittedContext:
        return _AdmittedContext(manager, admit)

    return {ADMIT: admit, ADMIT_ALL: admit_all, ADMIT_KEYWORDS: admit_keywords,
            DECORATE: decorate, ENTER: enter, ADMIT_EXCEPTION: admission.admit_exception}


class _AdmittedContext:
    """A context manager whose ``__enter__`` result is admitted before ``with`` binds it."""

    __slots__ = ("_manager", "_enter", "_exit", "_admit")

    def __init__(self, manager: Any, admit: Callable[[Any], Any]) -> None:
        kind = type(manager)
        try:
            self._enter, self._exit = kind.__enter__, kind.__exit__
        except AttributeError:
            raise TypeError(f"{kind.__name__!r} object does not support the context manager "
                            "protocol") from None
        self._manager, self._admit = manager, admit

    def __enter__(self) -> Any:
        return self._admit(self._enter(self._manager))

    def __exit__(self, *exc_info: Any) -> Any:
        return self._exit(self._manager, *exc_info)
