"""Walk everything model code can reach in the sandbox; report what it must never reach.

Loaded into a worker with ``Repl.extend("sandbox_crawler:install")``, it installs a builtin
``crawl(depth)`` that returns ``[violations, visited]``. It reaches objects the ways a cell can:
every public builtin and every name of every allowed module, then, level after level, their
public attributes (through the sandbox's own ``_getattr_`` and ``dir``), the result of calling
them without arguments, the items of containers, one ``next()`` of iterators, and the results of
calling builtins and module functions with typical arguments (plain values, classes, typing
aliases such as ``typing.Type[int]``, and the sandbox-made objects of the namespace).

A *violation* is reaching a module, frame, code object or traceback, a module's globals, the
real ``type`` or another metaclass, ``object.__subclasses__``, anything a module facade leaves
out or denies (``io.open``, ``typing.ForwardRef`` ...), or an object of a class from outside
the modules the sandbox offers.
"""

from __future__ import annotations

import builtins
import collections
import functools
import sys
import types
from typing import Any

import typing

from agentrt.interpreter import sandbox as sandbox_module
from agentrt.interpreter.sandbox import surface
from agentrt.interpreter.sandbox.admission import CheckedClass, TypeView

# Where the classes of the allowed modules are implemented (their C accelerators and private
# helpers); an object of one of these classes is part of what the sandbox offers.
IMPLEMENTATION_MODULES = frozenset({
    "builtins", "_collections", "_collections_abc", "_decimal", "_datetime", "_io", "_json",
    "_random", "_functools", "_operator", "_csv", "_hashlib", "_blake2", "_sha1", "_sha256",
    "_sha512", "_sha3", "_md5", "_sre", "re._parser", "re._constants", "_pydecimal",
    "_strptime", "_struct", "_string", "_abc", "_bisect", "_heapq", "_statistics",
    "unicodedata", "itertools", "binascii",
})
SANDBOX_CLASS_MODULES = frozenset({sandbox_module.SANDBOX_MODULE_NAME,
                                   *(f"agentrt.interpreter.sandbox.{part}" for part in (
                                       "policy", "modules", "cell_builtins", "output",
                                       "namespace", "provenance", "guards", "classes")),
                                   "agentrt.interpreter.worker", "agentrt.tools.errors",
                                   __name__})
"""Where the sandbox's own classes and functions live (``__name__``: classes that ``typing``'s
class factories name after their caller, here the walk itself)."""
EXTRA_CLASSES = frozenset({TypeView, CheckedClass}) | (
    frozenset({type(functools.cached_property(len).lock)})
    if hasattr(functools.cached_property(len), "lock") else frozenset())
"""The sandbox's view of a class it does not hand out, its checking constructors (``property``
as a cell holds it), and Python 3.11's ``functools.cached_property`` RLock (only the worker's
own thread can take it)."""
SKIPPED_CALLS = frozenset({"sleep"})  # time.sleep(1) and the like only cost the crawl time
PER_TYPE = 3
MAX_VISITS = 150_000


def install(sandbox: Any, channel: Any) -> None:
    sandbox.install_builtin("crawl", lambda depth=3: Crawler(sandbox).run(depth))


class Crawler:
    """One walk over the sandbox's reachable objects."""

    def __init__(self, sandbox: Any) -> None:
        self.sandbox = sandbox
        self.table = sandbox.namespace["__builtins__"]
        self.getattr = self.table["_getattr_"]
        self.dir = self.table["dir"]
        self.importer = self.table["__import__"]
        self.violations: list[str] = []
        self.keep: list[Any] = []  # keeps ids valid while the walk runs
        self.seen: set[int] = set()
        self.per_type: collections.Counter = collections.Counter()
        self.module_globals = {id(vars(module)) for module in list(sys.modules.values())
                               if module is not None}
        self.offered = self._offered()
        self.offered_bases = {id(base) for value in list(self.table.values()) + [
            value for name in sandbox_module.ALLOWED_MODULES for value in object.__getattribute__(
                sandbox.module_facade(name), "_attributes").values()]
            if isinstance(value, type) for base in value.__mro__}
        self.denied = self._denied_objects()
        self.visits = 0

    # -- the oracle ----------------------------------------------------------------------------
    def _offered(self) -> set[int]:
        """Ids of everything the builtins and the module facades hand out."""
        offered = {id(value) for value in self.table.values()}
        for name in sandbox_module.ALLOWED_MODULES:
            facade = self.sandbox.module_facade(name)
            offered |= {id(value) for value in
                        object.__getattribute__(facade, "_attributes").values()}
        return offered

    def _method_of_offered(self, function: Any) -> bool:
        """Whether ``function`` is defined in a class that an offered class derives from."""
        owner: Any = sys.modules.get(function.__module__)
        for part in function.__qualname__.split(".")[:-1]:
            owner = getattr(owner, part, None)
        return isinstance(owner, type) and id(owner) in self.offered_bases

    def _denied_objects(self) -> dict[int, str]:
        """What the module facades leave out on purpose (their deny and only lists), and the
        mutable state of every module, by id."""
        denied: dict[int, str] = {id(builtins.open): "builtins.open"}
        for name, rule in surface.EXPOSURES.items():
            module = sys.modules[name]
            facade = object.__getattribute__(self.sandbox.module_facade(name), "_attributes")
            names = set(rule.deny)
            if rule.only:
                names |= {attr for attr in vars(module) if not attr.startswith("_")
                          and attr not in rule.only and attr not in facade}
            for attr in names:
                value = getattr(module, attr, None)
                if callable(value) and id(value) not in self.offered:
                    denied[id(value)] = f"{name}.{attr}"
        for module in list(sys.modules.values()):
            for attr, value in list(vars(module).items()) if module is not None else ():
                if type(value) in (dict, list, set, bytearray) and id(value) not in self.offered:
                    denied.setdefault(id(value), f"{module.__name__}.{attr} (module state)")
        return denied

    def violation(self, obj: Any) -> str | None:
        if isinstance(obj, types.ModuleType):
            return f"a module ({obj.__name__})"
        if isinstance(obj, (types.FrameType, types.CodeType, types.TracebackType)):
            return f"a {type(obj).__name__} object"
        if obj is type:
            return "the real type"
        if isinstance(obj, type) and issubclass(obj, type) \
                and not sandbox_module.policy.is_sandbox_type(obj):
            return f"a metaclass ({obj.__qualname__})"
        if isinstance(obj, dict) and id(obj) in self.module_globals:
            return "a module's globals"
        if type(obj) is types.BuiltinMethodType and obj.__name__ == "__subclasses__":
            return "__subclasses__"
        if id(obj) in self.denied:
            return f"{self.denied[id(obj)]}, which the facade leaves out"
        if isinstance(obj, typing.ForwardRef):
            return "a typing.ForwardRef"
        if _module_function(obj) and id(obj) not in self.offered \
                and not _offered_module(obj.__module__) and not self._method_of_offered(obj):
            return f"function {obj.__module__}.{obj.__qualname__}"
        cls = obj if isinstance(obj, type) else type(obj)  # a class: where it comes from
        if id(cls) not in self.offered and cls not in EXTRA_CLASSES \
                and not _offered_module(getattr(cls, "__module__", None)):
            what = "class" if cls is obj else "an object of class"
            return f"{what} {cls.__module__}.{cls.__qualname__}"
        return None

    # -- the walk ------------------------------------------------------------------------------
    def roots(self) -> list[tuple[str, Any]]:
        found = [(name, value) for name, value in self.table.items()
                 if not name.startswith("_") and name != "crawl"]
        for name in sorted(sandbox_module.ALLOWED_MODULES):
            found.append((f"import {name}", self.importer(name, None, None, ("x",), 0)))
        found += list(self.sandbox.variables().items())
        return found

    def typical_arguments(self) -> list[tuple]:
        typing = self.importer("typing", None, None, ("x",), 0)
        arguments: list[tuple] = [(), (0,), (1,), ("a",), (b"a",), ([1, 2],), ({"a": 1},),
                                  (1, 2), ("a", "b"), (int,), (str, "a")]
        for alias in (typing.List[int], typing.Union[int, "X"],
                      typing.Callable[[int], str], typing.Annotated[int, "m"],
                      typing.ClassVar[int], typing.Optional["X"], typing.Tuple[int, ...]):
            arguments.append((alias,))
        arguments += [(value,) for value in self.sandbox.variables().values()
                      if not callable(value) or isinstance(value, type)]
        return arguments

    def first_visit(self, obj: Any) -> bool:
        if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType,
                            sandbox_module.SandboxModule)) or obj is None:
            key = id(obj)
        elif isinstance(obj, types.MethodType) or type(obj) is types.BuiltinMethodType:
            key = hash((type(getattr(obj, "__self__", None)), obj.__name__))
        else:
            self.per_type[type(obj)] += 1
            if self.per_type[type(obj)] > PER_TYPE:
                return False
            key = id(obj)
        if key in self.seen:
            return False
        self.seen.add(key)
        self.keep.append(obj)
        return True

    def children(self, obj: Any, path: str, with_arguments: bool
                 ) -> list[tuple[str, Any, bool]]:
        found: list[tuple[str, Any]] = []
        try:
            names = self.dir(obj)
        except Exception:
            names = []
        for name in names:
            try:
                found.append((f"{path}.{name}", self.getattr(obj, name)))
            except Exception:
                continue
        offered = len(found)  # a module's functions get the typical arguments too
        if callable(obj) and getattr(obj, "__name__", None) not in SKIPPED_CALLS:
            for arguments in (self.arguments if with_arguments else [()]):
                try:
                    found.append((f"{path}{_show(arguments)}", obj(*arguments)))
                except BaseException:
                    continue
        if type(obj) in (list, tuple, set, frozenset) or isinstance(obj, (list, tuple)):
            found += [(f"{path}[{i}]", item) for i, item in enumerate(list(obj)[:20])]
        elif isinstance(obj, dict):
            for i, (key, value) in enumerate(list(obj.items())[:20]):
                found += [(f"{path}.key{i}", key), (f"{path}[{key!r}]", value)]
        elif hasattr(type(obj), "__next__") and not isinstance(obj, type):
            try:
                found.append((f"next({path})", next(obj)))
            except BaseException:
                pass
        from_module = isinstance(obj, sandbox_module.SandboxModule)
        return [(child_path, child, from_module and index < offered)
                for index, (child_path, child) in enumerate(found)]

    def run(self, depth: int) -> list[Any]:
        self.arguments = self.typical_arguments()
        level = [(path, obj, True) for path, obj in self.roots()]
        for current in range(depth + 1):
            following: list[tuple[str, Any, bool]] = []
            for path, obj, offered in level:
                if self.visits >= MAX_VISITS:
                    self.violations.append(f"stopped after {MAX_VISITS} objects")
                    return [self.violations, self.visits]
                problem = self.violation(obj)
                if problem is not None:
                    self.violations.append(f"{path} -> {problem}")
                    continue
                if current == depth or not self.first_visit(obj):
                    continue
                self.visits += 1
                following += self.children(obj, path, offered)
            level = following
        return [self.violations, self.visits]


def _offered_module(name: Any) -> bool:
    """Whether ``name`` is an allowed module (or part of one), an implementation module or
    the sandbox's own; None is where builtin types keep their static methods."""
    if name is None:
        return True
    return name.partition(".")[0] in sandbox_module.ALLOWED_MODULES \
        or name in IMPLEMENTATION_MODULES or name in SANDBOX_CLASS_MODULES


def _module_function(obj: Any) -> bool:
    """A function of a module (not a method bound to an object of some class)."""
    if isinstance(obj, types.FunctionType):
        return True
    return type(obj) is types.BuiltinFunctionType and isinstance(
        getattr(obj, "__self__", None), (types.ModuleType, type(None)))


def _show(arguments: tuple) -> str:
    text = repr(arguments)
    return "(" + text[1:-1].rstrip(",") + ")" if len(text) < 60 else "(...)"
