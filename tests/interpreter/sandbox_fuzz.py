"""A generative fuzzer for the sandbox's first wall: programs, and the oracle that judges them.

:func:`programs` is a hypothesis strategy for short sequences of cells, each one statement that
composes what the sandbox exposes: module functions and classes, builtins, attribute chains
(plain and through ``getattr`` with private names), calls with what came before, subscripts,
``type()``, lambdas, decorators, and class statements with exotic bases (typing aliases such as
``typing.Type[int]``, ``Generic[T]``, ``NamedTuple``, the sandbox's ``type``, earlier results),
keywords and hook methods (``__init_subclass__``, ``__set_name__``, ``__mro_entries__``...). Each
cell runs in one :class:`~agentrt.interpreter.sandbox.Sandbox` in this process (no worker: the
first wall alone), and after each one :func:`violations` walks what the namespace holds.

A *violation* is holding the real ``type`` or any other metaclass (the sandbox's ``type``
aside), a builtins dict or a module's globals, a frame, code object, traceback or module, or a
Python function whose globals are not the sandbox's namespace; or a class the sandbox made
whose metaclass is not one of the allowed ones.
"""

from __future__ import annotations

import builtins
import signal
import sys
import types
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hypothesis import strategies as st

from agentrt.interpreter.sandbox import Sandbox
from agentrt.interpreter.sandbox.admission import public_machinery
from agentrt.interpreter.sandbox.classes import ALLOWED_METACLASSES
from agentrt.interpreter.sandbox.policy import is_sandbox_type

MODULES = ("typing", "enum", "dataclasses", "functools", "operator", "copy", "collections",
           "json", "numbers", "string", "re", "decimal", "fractions", "datetime", "io",
           "pprint", "textwrap", "statistics", "heapq", "bisect", "difflib", "math")
IMPORTS = "import " + ", ".join(MODULES) + "\nimport collections.abc\n"

NEVER_CALLED = frozenset({"sleep", "count", "cycle", "repeat", "input", "breakpoint",
                          "permutations", "combinations", "product", "pairwise"})
"""Names the fuzzer never calls (they only cost time, or loop forever in C)."""

ALIASES = ("typing.Type[int]", "typing.Type", "typing.List[int]", "list[int]", "typing.Generic[T]",
           "typing.Protocol", "typing.Protocol[T]", "typing.NamedTuple", "typing.TypedDict",
           "typing.Callable[[int], int]", "typing.Dict[str, int]", "typing.Any",
           "typing.Annotated[int, 0]", "collections.abc.Mapping", "enum.Enum", "enum.Flag",
           "type", "object", "dict", "str", "Exception", "typing.Generic")
PRIVATE_NAMES = ("__class__", "__globals__", "__dict__", "__mro__", "__bases__", "__base__",
                 "__subclasses__", "__builtins__", "__code__", "__closure__", "__func__",
                 "__self__", "__wrapped__", "__module__", "__qualname__", "__mro_entries__",
                 "__init_subclass__", "__set_name__", "__dataclass_fields__", "__annotations__",
                 "__reduce_ex__", "__get__", "__call__", "__init__", "__new__", "__getattribute__",
                 "__orig_bases__", "__origin__", "__args__", "__traceback__", "__context__")
PUBLIC_NAMES = ("mro", "register", "format", "format_map", "obj", "func", "args", "keywords",
                "type", "default", "default_factory", "fields", "name", "value", "values",
                "items", "keys", "get", "fromkeys", "copy", "real", "pattern", "parser",
                "gi_frame", "f_globals", "tb_frame", "co_code", "origin", "evaluate", "bound",
                "constraints", "getbuffer", "decoder", "encoder", "scan_once", "parse_object",
                "object_hook", "member", "cls", "owner", "wrapped", "cache_info", "_missing_")
HOOKS = ("__init_subclass__", "__set_name__", "__mro_entries__", "__class_getitem__",
         "__get__", "__getattr__", "__reduce__", "__eq__", "__init__", "__contains__")
LITERALS = ("0", "1", "2", "'a'", "'{0}'", "b'x'", "()", "[]", "{}", "None", "True", "(1, 2)",
            "['x', 'y']", "{'a': 1}", "{'__eq__': 1}", "[('x', int)]", "'x y'", "int", "str",
            "T", "ValueError('e')", "super", "print", "help", "FINAL", "getattr", "setattr",
            "dir", "isinstance", "issubclass", "classmethod", "staticmethod", "property",
            # names of the third round's gadgets: a callable whose __name__ is a dunder (copy
            # rebuilt bound methods with getattr(obj, name)), a memo for deepcopy
            "typing.NewType('__globals__', int)", "typing.NewType('__getattribute__', int)",
            "classmethod(typing.NewType('__class__', int))", "type(getattr)", "type(FINAL)",
            "{0: 0}")


def _exposed_names() -> list[str]:
    """``module.name`` for every public attribute of the facades the fuzzer imports."""
    sandbox = Sandbox()
    names = []
    for module in (*MODULES, "collections.abc"):
        for name in dir(sandbox.module_facade(module)):
            if not name.startswith("_") and name not in NEVER_CALLED and module != "math":
                names.append(f"{module}.{name}")
    return sorted(names)


EXPOSED = _exposed_names()


def _atoms(variables: int) -> st.SearchStrategy[str]:
    options = [st.sampled_from(EXPOSED), st.sampled_from(ALIASES), st.sampled_from(LITERALS)]
    if variables:
        options.append(st.integers(0, variables - 1).map(lambda i: f"v{i}"))
    return st.one_of(options)


def _expressions(variables: int) -> st.SearchStrategy[str]:
    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        name = st.sampled_from(PUBLIC_NAMES + PRIVATE_NAMES)
        return st.one_of(
            st.tuples(inner, st.sampled_from(PUBLIC_NAMES)).map(lambda t: f"({t[0]}).{t[1]}"),
            st.tuples(inner, name).map(lambda t: f"getattr({t[0]}, {t[1]!r})"),
            st.tuples(inner, st.lists(inner, max_size=3)).map(
                lambda t: f"({t[0]})({', '.join(t[1])})"),
            st.tuples(inner, st.sampled_from(("name", "cls", "total", "module", "default",
                                              "default_factory", "key", "names")), inner).map(
                lambda t: f"({t[0]})({t[1]}={t[2]})"),
            st.tuples(inner, inner).map(lambda t: f"({t[0]})[{t[1]}]"),
            inner.map(lambda e: f"type({e})"),
            inner.map(lambda e: f"(lambda *a, **k: {e})"),
            st.tuples(inner, inner).map(lambda t: f"[{t[0]}, {t[1]}]"),
            st.tuples(inner, inner).map(lambda t: f"super({t[0]}, {t[1]})"),
            st.tuples(name, inner).map(lambda t: f"{{{t[0]!r}: {t[1]}}}"),
        )

    return st.recursive(_atoms(variables), extend, max_leaves=4)


def _class_statement(index: int, variables: int) -> st.SearchStrategy[str]:
    expression = _expressions(variables)
    bases = st.lists(st.one_of(st.sampled_from(ALIASES), expression), max_size=2)
    keywords = st.lists(st.sampled_from(("total=False", "x=1", "metaclass=type")), max_size=1)
    member = st.one_of(
        expression.map(lambda e: f"    field = {e}"),
        expression.map(lambda e: f"    annotated: {e} = 0"),
        expression.map(lambda e: f"    def method(self, *a):\n        return {e}"),
        st.tuples(st.sampled_from(HOOKS), expression).map(
            lambda t: f"    def {t[0]}(self, *a, **k):\n        return {t[1]}"),
    )
    decorator = st.one_of(st.just(""), expression.map(lambda e: f"@{e}\n"))
    return st.tuples(decorator, bases, keywords, st.lists(member, min_size=1, max_size=3)).map(
        lambda t: (f"{t[0]}class C{index}({', '.join(t[1] + t[2])}):\n" + "\n".join(t[3])
                   + f"\nv{index} = C{index}"))


def _statement(index: int) -> st.SearchStrategy[str]:
    expression = _expressions(index)
    return st.one_of(
        expression.map(lambda e: f"v{index} = {e}"),
        expression.map(lambda e: f"v{index} = {e}"),
        _class_statement(index, index),
        st.tuples(expression, expression).map(
            lambda t: f"@{t[0]}\ndef f{index}(*a):\n    return {t[1]}\nv{index} = f{index}"),
        st.tuples(expression, st.sampled_from(PUBLIC_NAMES), expression).map(
            lambda t: f"setattr({t[0]}, {t[1]!r}, {t[2]})\nv{index} = None"),
    )


@st.composite
def programs(draw: Any, max_cells: int = 8) -> list[str]:
    """A list of cells: the imports, then up to ``max_cells`` statements binding v0, v1..."""
    count = draw(st.integers(1, max_cells))
    return ["T = typing.TypeVar('T')"] + [draw(_statement(i)) for i in range(count)]


# --------------------------------------------------------------------------- running

class CellTimeout(BaseException):
    """A fuzzed cell ran past its time."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def expire(signum: int, frame: Any) -> None:
        raise CellTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_program(cells: list[str], sandbox: Sandbox | None = None) -> list[str]:
    """Run the cells in one sandbox; the violations found after each (empty if none)."""
    sandbox = sandbox or Sandbox(max_output_chars=10_000)
    sandbox.execute(IMPORTS)
    found: list[str] = []
    for cell in cells:
        try:
            with time_limit(2.0), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # e.g. "'list' object is not callable"
                sandbox.execute(cell)
        except CellTimeout:
            continue
        found += [f"after {cell!r}: {problem}" for problem in violations(sandbox)]
        if found:
            break
    return found


# --------------------------------------------------------------------------- the oracle

def _module_globals() -> set[int]:
    return {id(vars(module)) for module in list(sys.modules.values()) if module is not None}


def violation(obj: Any, sandbox: Sandbox, module_globals: set[int]) -> str | None:
    """What is wrong with the sandbox holding ``obj`` (None: nothing)."""
    if issubclass(type(obj), type) and issubclass(obj, type) and not is_sandbox_type(obj):
        return f"a metaclass ({obj.__qualname__})"
    if isinstance(obj, (types.ModuleType, types.FrameType, types.CodeType,
                        types.TracebackType)):
        return f"a {type(obj).__name__} object"
    if type(obj) is dict and (obj is vars(builtins) or obj is sandbox.namespace
                              or obj is sandbox.namespace.get("__builtins__")
                              or id(obj) in module_globals):
        return "a builtins dict or a module's globals"
    if type(obj) is types.FunctionType and obj.__globals__ is not sandbox.namespace:
        return f"a real function ({obj.__module__}.{obj.__qualname__})"
    if issubclass(type(obj), type) and obj in sandbox.context.provenance.classes \
            and type(obj) not in ALLOWED_METACLASSES:
        return f"class {obj.__qualname__} with metaclass {type(obj).__qualname__}"
    return None


def _held(value: Any, depth: int, made: Any) -> Iterator[Any]:
    """``value`` and what it holds: container items and a sandbox class's own public
    attributes (its private ones, such as the hooks typing adds, no cell can read)."""
    yield value
    if depth == 0:
        return
    if type(value) in (list, tuple, set, frozenset):
        items: list[Any] = list(value)[:50]
    elif type(value) is dict:
        items = [item for pair in list(value.items())[:50] for item in pair]
    elif issubclass(type(value), type) and value in made:
        items = [item for name, item in type.__dict__["__dict__"].__get__(value).items()
                 if not name.startswith("_")  # what a cell can read of it, but for what
                 and not public_machinery(value, name, item)][:50]  # Python put there
    else:
        return
    for item in items:
        yield from _held(item, depth - 1, made)


def violations(sandbox: Sandbox) -> list[str]:
    """Every violation among what the sandbox's namespace holds: one of the objects above, or
    anything admission would not let in as it is (a raw object inside a container)."""
    module_globals = _module_globals()
    admit = sandbox.context.admission.admit
    found = []
    for name, value in sandbox.variables().items():
        for obj in _held(value, 3, sandbox.context.provenance.classes):
            problem = violation(obj, sandbox, module_globals)
            # A dict is judged by identity above: admission also refuses a dict the cell
            # wrote itself when it has a '__builtins__' key, which holds nothing real.
            if problem is None and type(obj) is not dict:
                try:
                    if admit(obj) is not obj:
                        problem = f"a {type(obj).__qualname__} admission would not let in"
                except TypeError as exc:
                    problem = f"a {type(obj).__qualname__} admission refuses ({exc})"
            if problem is None and sandbox.context.provenance.made_class(obj):
                try:  # its class dict as a whole, as when it was made
                    sandbox.context.admission.check_class(obj)
                except TypeError as exc:
                    problem = f"a class whose dict admission refuses ({exc})"
            if problem is not None:
                found.append(f"{name} holds {problem}")
    return found
