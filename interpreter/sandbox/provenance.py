"""What the sandbox made: trust by identity, never by metadata.

A :class:`Provenance` answers "did the sandbox make this?" from facts model code cannot write:
a function's ``__globals__`` *is* the sandbox namespace (a read-only attribute, fixed when the
function is made), a class is one of the classes the vetted class path recorded (identity, in
a weak set), an instance's ``type()`` is such a class. Nothing it decides reads ``__module__``,
``__qualname__``, a ``__dict__`` entry or ``__dataclass_fields__``, which a class's maker
chooses.

A real Python function a cell may call is held as a :class:`SandboxFunction`, which calls it
but has no ``__globals__``, ``__code__``, ``__closure__`` or defaults to read (admission.py
decides what a cell may hold).
"""

from __future__ import annotations

import sys
import types
import weakref
from collections.abc import Callable
from typing import Any


class SandboxFunction:
    """A real (trusted) Python function as the sandbox holds it: callable, with its name and
    documentation, and nothing else. Its results pass through ``check`` when one is given.

    A method defined in a class body (``ChainMap.new_child``, however it was reached: off the
    class, a subclass, a copy of the class's dict, bound by a descriptor such as a
    ``classmethod`` wrapped around it) runs only on a ``self`` of that class, by its real type:
    a stdlib method does what it likes with ``self`` (sets attributes on it, calls
    ``self.__class__``). It does not bind as a method (no ``__get__``): stored on a class it
    stays a plain callable.
    """

    __slots__ = ("_function", "_check", "_owner", "__weakref__")

    def __init__(self, function: Callable[..., Any],
                 check: Callable[[Any], Any] | None = None) -> None:
        if type(function) is types.MethodType:  # bound by a descriptor: the same rule
            owner = method_owner(function.__func__)
            if owner is not None and not issubclass(type(function.__self__), owner):
                raise TypeError(f"{owner.__qualname__}.{function.__func__.__name__}() runs "
                                f"only on a {owner.__qualname__!r} object")
        object.__setattr__(self, "_function", function)
        object.__setattr__(self, "_check", check)
        object.__setattr__(self, "_owner", method_owner(function))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        owner = self._owner
        if owner is not None and (not args or not issubclass(type(args[0]), owner)):
            raise TypeError(f"{self.__qualname__}() runs only on a {owner.__qualname__!r} "
                            "object (call it on one)")
        result = self._function(*args, **kwargs)
        return result if self._check is None else self._check(result)

    def __setattr__(self, name: str, value: Any) -> None:
        raise TypeError("functions of the sandbox's modules are read-only")

    __delattr__ = __setattr__  # type: ignore[assignment]

    def __getattr__(self, name: str) -> str:
        if name in ("__name__", "__qualname__"):
            value = getattr(self._function, name, None)
            return value if isinstance(value, str) else "function"
        raise AttributeError(name)

    @property
    def __doc__(self) -> str | None:  # type: ignore[override]
        doc = getattr(self._function, "__doc__", None)
        return doc if isinstance(doc, str) else None

    def __eq__(self, other: object) -> bool:
        return type(other) is SandboxFunction and other._function is self._function

    def __hash__(self) -> int:
        return hash(self._function)

    def __repr__(self) -> str:
        return f"<function {self.__qualname__}>"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("functions cannot leave the sandbox")


def method_owner(function: Any) -> type | None:
    """The class in whose body ``function`` is defined as a plain method (its module's class
    at its qualified name holds this very function), or None."""
    if type(function) is not types.FunctionType:
        return None
    owner: Any = sys.modules.get(function.__module__)
    parts = function.__qualname__.split(".")
    for part in parts[:-1]:
        if part == "<locals>" or owner is None:
            return None
        owner = getattr(owner, part, None)
    if not isinstance(owner, type):
        return None
    return owner if vars(owner).get(parts[-1]) is function else None


def unwrap(value: Any) -> Any:
    """The real function behind a :class:`SandboxFunction` (trusted code only), else ``value``."""
    return value._function if type(value) is SandboxFunction else value


class Provenance:
    """What one sandbox made (see the module docstring)."""

    def __init__(self, namespace: dict[str, Any]) -> None:
        self.namespace = namespace
        self._classes = _ClassesById()
        """Classes made through the vetted paths: class statements and the class factories."""
        self._vetted_bases = _ClassesById()
        """Classes the facades made for this sandbox that a class statement may derive from
        (the enum classes), beside the fixed allow-list of classes.py; not writable."""
        self.check_class: Callable[[type], None] = lambda cls: None
        """Raises unless the class dict of a class just made holds only what the sandbox
        allows there (set by admission.py: `Admission.check_class`)."""

    def record(self, cls: Any) -> Any:
        """Record ``cls`` as made by the sandbox, once its own class dict passes
        `check_class`; returns it. Every path that makes a class for a cell ends here (the
        class statement, the class factories, ``dataclass``)."""
        if isinstance(cls, type):
            self._classes.add(cls)  # first: the check admits the class's own members
            try:
                self.check_class(cls)
            except BaseException:
                self._classes.discard(cls)
                raise
        return cls

    def vet_base(self, cls: type) -> None:
        """Let class statements derive from ``cls`` (a class a facade made)."""
        self._vetted_bases.add(cls)

    def made_class(self, cls: Any) -> bool:
        """Whether ``cls`` is a class the sandbox made (by identity)."""
        return self._classes.holds(cls)

    def vetted_base(self, cls: Any) -> bool:
        """Whether ``cls`` is a class a facade made for class statements to derive from."""
        return self._vetted_bases.holds(cls)

    @property
    def classes(self) -> list[type]:
        """The classes the sandbox made that are still alive."""
        return self._classes.alive()

    def made_function(self, obj: Any) -> bool:
        """Whether ``obj`` is a function defined by a cell of this sandbox."""
        return type(obj) is types.FunctionType and obj.__globals__ is self.namespace

    def made(self, obj: Any) -> bool:
        """Whether ``obj`` is a function, a class, or an instance of a class the sandbox made."""
        if type(obj) is types.FunctionType:
            return obj.__globals__ is self.namespace
        return self._classes.holds(obj if isinstance(obj, type) else type(obj))


class _ClassesById:
    """A weak set of classes whose membership is decided by identity: looking a class up
    never calls its metaclass's ``__eq__`` or ``__hash__``."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[type]] = {}

    def add(self, cls: type) -> None:
        key = id(cls)

        def forget(ref: weakref.ref[type], key: int = key) -> None:
            if self._refs.get(key) is ref:
                del self._refs[key]

        self._refs[key] = weakref.ref(cls, forget)

    def discard(self, cls: type) -> None:
        if self.holds(cls):
            del self._refs[id(cls)]

    def holds(self, cls: Any) -> bool:
        ref = self._refs.get(id(cls))
        return ref is not None and ref() is cls

    def alive(self) -> list[type]:
        return [cls for ref in list(self._refs.values()) if (cls := ref()) is not None]
