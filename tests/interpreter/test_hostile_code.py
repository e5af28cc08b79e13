"""Hostile cells: each one gets a clear error and the same REPL keeps working afterwards.

Add new escape attempts to HOSTILE_CELLS: (code, expected error type).
"""

from __future__ import annotations

import re

import pytest

from agentrt.interpreter import Repl, ReplLimits
from agentrt.interpreter.sandbox import Sandbox

pytestmark = pytest.mark.anyio

LIMITS = ReplLimits(cpu_s=1, wall_s=20, memory_mb=1024)

# Arbitrary code if it ever runs: a KeyError naming the worker's pid ("escaped:<pid>").
PAYLOAD = "payload = \"a,dict()['escaped:' + str(__import__('os').getpid())]\"\n"
# dataclasses generates __eq__/__repr__ source from field names: a crafted name is code.
RUN_DATACLASS_CODEGEN = ("Made = dataclasses.dataclass(init=False)(Target)\n"
                         "probe = Made()\nprobe.a = 1\nprobe == probe\n")
ENUM_ANNOTATIONS_CHAIN = PAYLOAD + (
    "import dataclasses, enum, functools\n"
    "Carrier = enum.Enum('Carrier', {'__annotations__': {payload: int}, 'X': 1})\n"
    "class Target:\n    pass\n"
    "try:\n    functools.update_wrapper(Target, Carrier)\nexcept AttributeError:\n    pass\n"
) + RUN_DATACLASS_CODEGEN
TYPEDDICT_ANNOTATIONS_CHAIN = PAYLOAD + (
    "import dataclasses, functools, typing\n"
    "Carrier = typing.TypedDict('Carrier', {payload: int})\n"
    "class Target:\n    pass\n"
    "try:\n    functools.update_wrapper(Target, Carrier)\nexcept AttributeError:\n    pass\n"
) + RUN_DATACLASS_CODEGEN
COPY_REDUCE_CHAIN = PAYLOAD + (
    "import copy, dataclasses, enum\n"
    "class Target:\n    pass\n"
    "def rebuild():\n    return Target\n"
    "Sneaky = enum.Enum('Sneaky', {'__copy__': None, 'M': 1, '__reduce_ex__': lambda self, p: "
    "(rebuild, (), (None, {'__annotations__': {payload: int}}))})\n"
    "copy.copy(Sneaky.M)\n"
) + RUN_DATACLASS_CODEGEN
FORMAT_VIA_SUPER_CHAIN = (
    "class Shout(str):\n    def render(self):\n        return super().format(self)\n"
    "Shout('{0.render.__globals__[__builtins__][getattr].__globals__[sys].modules[os]"
    ".environ}').render()\n")

# typing's introspection handed out the real ``type``; with it, a dict subclass that hides
# crafted annotation names from the dataclass check fed dataclasses' code generation.
REAL_TYPE = "import typing\nT = typing.get_origin(typing.Type[int])\n"
REAL_TYPE_DATACLASS_CHAIN = PAYLOAD + REAL_TYPE + (
    "import dataclasses\n"
    "Hiding = T('Hiding', (dict,), {'__iter__': lambda self: iter(['a'])})\n"
    "Target = T('Target', (), {'__annotations__': Hiding({payload: int})})\n"
) + RUN_DATACLASS_CODEGEN
HOOK_CLASSES = {
    "init-subclass-hook": "Hooked = T('Hooked', (), {'__init_subclass__': "
                          "classmethod(lambda cls: print('hook ran'))})\nclass Sub(Hooked):\n"
                          "    pass\n",
    "class-getitem-hook": "Hooked = T('Hooked', (), {'__class_getitem__': "
                          "classmethod(lambda cls, item: print('hook ran'))})\nHooked[1]\n",
    "descriptor-hook": "Getter = T('Getter', (), {'__get__': lambda *args: 'hook ran'})\n"
                       "Holder = T('Holder', (), {'value': Getter()})\nHolder().value\n",
}

GEN = "def gen():\n    yield 1\nit = gen()\nnext(it)\n"
CAUGHT = "try:\n    1 / 0\nexcept Exception as caught:\n    err = caught\n"

HOSTILE_CELLS = [
    # imports
    pytest.param("import os", "ImportError", id="import-os"),
    pytest.param("from os import system", "ImportError", id="from-os-import-system"),
    pytest.param("import importlib", "ImportError", id="import-importlib"),
    pytest.param("import sys\nsys.modules", "ImportError", id="sys-modules"),
    pytest.param("import typing\ntyping.sys.modules", "AttributeError", id="sys-via-typing"),
    pytest.param("import subprocess", "ImportError", id="import-subprocess"),
    pytest.param("import os\nwhile True:\n    os.fork()", "ImportError", id="fork-bomb"),
    pytest.param("import multiprocessing", "ImportError", id="import-multiprocessing"),
    pytest.param("import threading", "ImportError", id="import-threading"),
    pytest.param("import pickle", "ImportError", id="import-pickle"),
    pytest.param("from . import worker", "ImportError", id="relative-import"),
    pytest.param("__import__('os')", "SyntaxError", id="dunder-import"),
    # files and dynamic code
    pytest.param("open('/etc/passwd').read()", "PermissionError", id="open"),
    pytest.param("o = open\no('/tmp/agentrt-hostile', 'w')", "PermissionError", id="open-alias"),
    pytest.param("import io\nio.open('/etc/passwd')", "AttributeError", id="io-open"),
    pytest.param("eval('1 + 1')", "SyntaxError", id="eval"),
    pytest.param("exec('x = 1')", "SyntaxError", id="exec"),
    pytest.param("e = eval\ne('1 + 1')", "PermissionError", id="eval-alias"),
    pytest.param("compile('1', 'f', 'eval')", "PermissionError", id="compile"),
    pytest.param("globals()", "PermissionError", id="globals"),
    pytest.param("vars()", "PermissionError", id="vars"),
    pytest.param("breakpoint()", "SyntaxError", id="breakpoint"),
    pytest.param("memoryview(b'x')", "PermissionError", id="memoryview"),
    # builtins
    pytest.param("__builtins__ = {}", "SyntaxError", id="rebind-builtins"),
    pytest.param("__builtins__['open']", "SyntaxError", id="read-builtins"),
    # introspection
    pytest.param("().__class__.__bases__[0].__subclasses__()", "SyntaxError", id="subclasses"),
    pytest.param("[].__class__", "SyntaxError", id="list-class"),
    pytest.param("(lambda: 0).__code__", "SyntaxError", id="lambda-code"),
    pytest.param("getattr(lambda: 0, '__code__')", "AttributeError", id="getattr-code"),
    pytest.param("def f():\n    pass\ngetattr(f, '__globals__')", "AttributeError",
                 id="getattr-globals"),
    pytest.param("getattr(getattr(1, '__class__'), '__subclasses__')", "AttributeError",
                 id="getattr-class"),
    pytest.param("int.mro()", "AttributeError", id="mro"),
    pytest.param("x = 1\nx.__init__", "AttributeError", id="init-outside-super"),
    pytest.param("getattr(print, '__self__')", "AttributeError", id="print-self"),
    pytest.param("getattr(FINAL, '__self__')", "AttributeError", id="final-self"),
    pytest.param(CAUGHT + "getattr(err, '__traceback__')", "AttributeError", id="traceback"),
    pytest.param(CAUGHT + "tb = err.__traceback__", "SyntaxError", id="traceback-attr"),
    pytest.param(CAUGHT + "getattr(err, '__context__')", "AttributeError", id="context"),
    pytest.param("getattr(AttributeError('x'), 'obj')", "AttributeError", id="exception-obj"),
    # str.format field lookups
    pytest.param("'{0.__class__}'.format(1)", "AttributeError", id="format-class"),
    pytest.param("'{0.__globals__}'.format(lambda: 0)", "AttributeError", id="format-globals"),
    pytest.param("str.format('{0.__class__.__base__}', 1)", "AttributeError", id="str-format"),
    pytest.param("'{x.__class__}'.format_map({'x': 1})", "AttributeError", id="format-map"),
    pytest.param(GEN + "'{0.gi_frame}'.format(it)", "AttributeError", id="format-gi-frame"),
    pytest.param("import string\nstring.Formatter", "AttributeError", id="string-formatter"),
    pytest.param("import collections\ncollections.UserString('{0.__class__}').format(1)",
                 "AttributeError", id="userstring-format"),
    # generator / frame walks
    pytest.param(GEN + "frame = it.gi_frame", "SyntaxError", id="gi-frame-attr"),
    pytest.param(GEN + "frame = getattr(it, 'gi_frame')", "AttributeError", id="gi-frame"),
    pytest.param(GEN + "getattr(it, 'gi_code')", "AttributeError", id="gi-code"),
    pytest.param(GEN + "getattr(getattr(it, 'gi' + '_frame'), 'f_back')", "AttributeError",
                 id="f-back"),
    pytest.param(GEN + "frame = it.gi_frame\nframe.f_globals", "SyntaxError", id="f-globals"),
    pytest.param(CAUGHT + "err.tb_frame", "SyntaxError", id="tb-frame-attr"),
    pytest.param("getattr(1, 'f_locals')", "AttributeError", id="f-locals"),
    pytest.param("getattr(len, 'co_code')", "AttributeError", id="co-code"),
    # stdlib helpers that evaluate strings or look up attributes by name
    pytest.param("import typing\ntyping.get_type_hints", "AttributeError", id="get-type-hints"),
    pytest.param("from typing import get_type_hints", "ImportError", id="import-type-hints"),
    pytest.param("import functools\nfunctools.singledispatch", "AttributeError",
                 id="singledispatch"),
    pytest.param("import functools\ndef f():\n    pass\ndef g():\n    pass\n"
                 "functools.update_wrapper(f, g, assigned=('__globals__',))", "ValueError",
                 id="update-wrapper"),
    pytest.param("import operator\noperator.attrgetter('__class__')(1)", "AttributeError",
                 id="attrgetter"),
    pytest.param("import operator\noperator.methodcaller('__reduce__')(1)", "AttributeError",
                 id="methodcaller"),
    pytest.param("import dataclasses\ndataclasses.make_dataclass('X', ['a'])", "AttributeError",
                 id="make-dataclass"),
    pytest.param("import random\ngetattr(random, '_os')", "AttributeError", id="module-private"),
    pytest.param("import json\njson.decoder", "AttributeError", id="submodule"),
    pytest.param("import json\njson.loads = print", "TypeError", id="patch-module"),
    pytest.param("import math\nsetattr(math, 'pi', 3)", "TypeError", id="setattr-module"),
    pytest.param("setattr(int, 'real', 1)", "TypeError", id="setattr-builtin-type"),
    # class creation tricks
    pytest.param("type('X', (), {'__eq__': lambda a, b: True})", "TypeError", id="type-3-args"),
    pytest.param("type(int)('X', (object,), {})", "TypeError", id="metaclass-of-int"),
    pytest.param("import enum\ntype(enum.Enum)('X', (), {})", "TypeError", id="enum-metaclass"),
    pytest.param("class A:\n    __slots__ = ()", "SyntaxError", id="dunder-in-class"),
    # class factories and attribute writers in allowed modules
    pytest.param("import enum\nAlways = enum.Enum('Always', {'__eq__': lambda a, b: True, "
                 "'ONE': 1})", "TypeError", id="enum-functional-dunder"),
    pytest.param("import enum\nenum.Enum('E', [('_sunder_', 1)])", "TypeError",
                 id="enum-functional-private"),
    pytest.param("import enum\nenum.EnumType", "AttributeError", id="enum-metaclass-attribute"),
    pytest.param(ENUM_ANNOTATIONS_CHAIN, "TypeError", id="enum-annotations-update-wrapper"),
    pytest.param(TYPEDDICT_ANNOTATIONS_CHAIN, "TypeError",
                 id="typeddict-annotations-update-wrapper"),
    pytest.param(PAYLOAD + "import dataclasses, typing\n"
                 "Target = typing.TypedDict('Target', {payload: int})\n" + RUN_DATACLASS_CODEGEN,
                 "TypeError", id="dataclass-crafted-field-name"),
    pytest.param(COPY_REDUCE_CHAIN, "TypeError", id="copy-reduce-setattr"),
    pytest.param(FORMAT_VIA_SUPER_CHAIN, "AttributeError", id="format-via-super"),
    pytest.param("class S(str):\n    def f(self):\n        return super().format_map({'x': 1})\n"
                 "S('{x.__class__}').f()", "AttributeError", id="format-map-via-super"),
    pytest.param("import io\nio.BytesIO(b'abc').getbuffer()", "AttributeError",
                 id="bytesio-getbuffer"),
    pytest.param("import collections\ncollections.namedtuple('P', 'a', module='os')",
                 "ValueError", id="namedtuple-module"),
    pytest.param("import functools\nclass A:\n    pass\ndef f(x: int):\n    pass\n"
                 "functools.update_wrapper(A, f)", "TypeError", id="update-wrapper-onto-class"),
    pytest.param("import functools, difflib\nfunctools.total_ordering(difflib.SequenceMatcher)",
                 "TypeError", id="total-ordering-stdlib-class"),
    pytest.param("import dataclasses, difflib\ndataclasses.dataclass(difflib.SequenceMatcher)",
                 "TypeError", id="dataclass-stdlib-class"),
    pytest.param("import typing, json\ntyping.final(json.dumps)", "TypeError",
                 id="typing-final-stdlib-function"),
    pytest.param("import abc", "ImportError", id="import-abc"),
    # real objects out of typing's introspection helpers, and what they opened
    # typing.Type is no longer in the facade (an alias of a metaclass): the first step fails
    pytest.param(REAL_TYPE + "T('X', (), {'__eq__': lambda a, b: True})", "AttributeError",
                 id="real-type-from-get-origin"),
    pytest.param("import typing\ntyping.get_args(typing.List['X'])", "TypeError",
                 id="forward-ref-from-get-args"),
    pytest.param(REAL_TYPE_DATACLASS_CHAIN, "AttributeError", id="real-type-dataclass-chain"),
    *[pytest.param(REAL_TYPE + code, "AttributeError", id=name)
      for name, code in HOOK_CLASSES.items()],
    # type() of a typing alias is a view (no class to pass to super())
    pytest.param("import typing\nsuper(type(typing.List), typing.List).__init__(int, name='X')",
                 "TypeError", id="super-init-stdlib-singleton"),
    pytest.param("import decimal\nc = decimal.getcontext()\nsuper(type(c), c).__init__(prec=3)",
                 "AttributeError", id="super-init-stdlib-object"),
    pytest.param("import collections.abc\ncollections.abc.Mapping.register(int)",
                 "AttributeError", id="abc-register"),
    pytest.param("import collections.abc\nclass M(collections.abc.Mapping):\n    pass\n"
                 "M.register(int)", "AttributeError", id="abc-register-via-subclass"),
    pytest.param("import numbers, functools\nfunctools.partial(getattr, numbers.Number, "
                 "'register')()(str)", "AttributeError", id="abc-register-via-getattr"),
    pytest.param("class A(metaclass=type):\n    pass", "SyntaxError", id="metaclass-keyword"),
    # class statements: every base resolved and checked by identity, no metaclass of the model's
    # typing.Type (an alias of a metaclass) is not in the facade: the first step fails now
    pytest.param("import typing\nclass M(typing.Type[int]):\n    pass\n"
                 "M('X', (), {'__module__': 'builtins'})", "AttributeError",
                 id="alias-metaclass-base"),
    pytest.param("import typing\nclass M(typing.Type):\n    pass", "AttributeError",
                 id="bare-type-alias-base"),
    pytest.param("class M(type):\n    pass", "TypeError", id="sandbox-type-base"),
    pytest.param("import typing\nclass A(typing.Any):\n    pass", "TypeError", id="any-base"),
    pytest.param("import json\nclass A(json.dumps):\n    pass", "TypeError", id="function-base"),
    pytest.param("import json\nclass A(type(json.dumps)):\n    pass", "TypeError",
                 id="module-function-class-base"),
    pytest.param("import difflib\nclass A(difflib.SequenceMatcher):\n    pass", "TypeError",
                 id="unlisted-stdlib-base"),
    pytest.param("import enum\nclass A(type(enum.Enum)):\n    pass", "TypeError",
                 id="enum-metaclass-base"),
    pytest.param("import json\ngetattr(json.dumps, '__globals__')", "AttributeError",
                 id="module-function-globals"),
    pytest.param("import json\njson.JSONDecoder.decode.__globals__", "SyntaxError",
                 id="method-globals-attr"),
    pytest.param("import json\nd = json.JSONDecoder().decode\nd.x = 1", "TypeError",
                 id="write-module-function"),
    pytest.param("import json, re\njson.JSONDecoder.decode(re.IGNORECASE, '1')", "TypeError",
                 id="stdlib-method-on-a-foreign-self"),
    pytest.param("import typing\ntyping.overload", "AttributeError", id="typing-overload"),
    pytest.param("import enum\nenum.pickle_by_global_name", "AttributeError",
                 id="enum-reduction-hook"),
    pytest.param("import operator, collections\n"
                 "operator.setitem(collections.UserDict(), 'a', 1)", "TypeError",
                 id="setitem-through-write-guard"),
    pytest.param("async def f():\n    pass", "SyntaxError", id="async-def"),
    # resource exhaustion
    pytest.param("while True:\n    pass", "TimeoutError", id="busy-loop"),
    pytest.param("sum(range(10**12))", "TimeoutError", id="c-level-loop"),
    pytest.param("x = 'x' * 10**10", "MemoryError", id="huge-string"),
    pytest.param("x = [0] * 10**9", "MemoryError", id="huge-list"),
    pytest.param("def f():\n    return f()\nf()", "RecursionError", id="recursion"),
    pytest.param("raise SystemExit(3)", "SystemExit", id="system-exit"),
    pytest.param("raise KeyboardInterrupt", "KeyboardInterrupt", id="keyboard-interrupt"),
]



async def echo_tool(name: str, args: tuple, kwargs: dict):
    return list(args)


async def assert_repl_still_works(repl: Repl) -> None:
    after = await repl.execute("check = sentinel + 1\nprint(check, echo(check))")
    assert after.ok, after.error
    assert after.stdout == "43 [43]\n"


@pytest.mark.parametrize(("code", "error_type"), HOSTILE_CELLS)
async def test_hostile_cell_gets_a_clear_error(code: str, error_type: str):
    async with Repl(echo_tool, ["echo"], LIMITS) as repl:
        assert (await repl.execute("sentinel = 42")).ok
        result = await repl.execute(code)
        assert result.error_type == error_type, result.error
        assert result.error.startswith(error_type)
        assert not re.search(r"escaped:\d", result.error + result.stdout), result.error
        assert "\n" not in result.error.split("\n")[0]
        await assert_repl_still_works(repl)


async def test_syntax_error_mid_block_runs_nothing():
    async with Repl(echo_tool, ["echo"], LIMITS) as repl:
        await repl.execute("sentinel = 42")
        result = await repl.execute("first = 1\nsecond = = 2\nthird = 3")
        assert result.error_type == "SyntaxError"
        assert "line 2" in result.error and "second = = 2" in result.error
        with pytest.raises(KeyError):
            await repl.get_variable("first")
        await assert_repl_still_works(repl)


async def test_printing_100_mb_is_truncated():
    async with Repl(echo_tool, ["echo"], LIMITS) as repl:
        await repl.execute("sentinel = 42")
        result = await repl.execute("print('x' * 10**8)\nprint('tail')")
        assert result.ok, result.error
        assert len(result.stdout) < LIMITS.max_output_chars + 100
        assert result.stdout.endswith(f"[output truncated: {10**8 + 6 - 10**6} more characters]")
        await assert_repl_still_works(repl)


async def test_one_repl_survives_many_hostile_cells_in_a_row():
    slow = {"TimeoutError", "MemoryError"}
    async with Repl(echo_tool, ["echo"], LIMITS) as repl:
        await repl.execute("sentinel = 42")
        for param in HOSTILE_CELLS:
            code, error_type = param.values
            if error_type in slow:
                continue
            result = await repl.execute(code)
            assert result.error_type == error_type, (param.id, result.error)
        await assert_repl_still_works(repl)


async def test_reveal_type_flood_goes_to_the_capped_cell_output():
    async with Repl(echo_tool, ["echo"], LIMITS) as repl:
        await repl.execute("sentinel = 42")
        result = await repl.execute(
            "import typing\nfor i in range(60000):\n    typing.reveal_type(i)")
        assert result.ok, result.error
        assert result.stdout.startswith("Runtime type is 'int'\n")
        assert "[output truncated:" in result.stdout
        log = repl._tmpdir / "worker.log"
        assert not log.exists() or log.stat().st_size < 10_000
        await assert_repl_still_works(repl)


class _Target:
    pass


class _RebuildsAClass:
    """Not makeable in the sandbox (it needs a dunder method): stands for any object whose
    reduction a future bypass could control."""

    def __reduce_ex__(self, protocol):
        return (lambda: _Target, (), (None, {"public": 1}))


class _SetsADunder:
    def __reduce_ex__(self, protocol):
        return (_Target, (), (None, {"__class__": _Target}))


def test_copy_never_runs_the_reduction_of_an_object_the_sandbox_may_not_hold():
    copy = Sandbox().module_facade("copy")
    for function in (copy.copy, copy.deepcopy):
        for obj in (_RebuildsAClass(), _SetsADunder()):
            with pytest.raises(TypeError, match="cannot be copied"):
                function(obj)
    assert "public" not in vars(_Target)
    assert copy.deepcopy({"x": [1, 2]}) == {"x": [1, 2]}


class _Probe:
    """Records what the stdlib ``copy`` module's reconstruction step is while it is copied."""

    seen: list = []

    def __reduce_ex__(self, protocol):
        import copy

        return (lambda: _Probe.seen.append(copy._reconstruct) or _Probe(), ())


def test_the_sandbox_copies_with_its_own_code_and_leaves_the_stdlib_module_alone():
    import copy as stdlib_copy

    original = stdlib_copy._reconstruct
    copy = Sandbox().module_facade("copy")
    _Probe.seen.clear()
    for function in (copy.copy, copy.deepcopy):
        with pytest.raises(TypeError, match="cannot be copied"):
            function(_Probe())
    assert _Probe.seen == [] and stdlib_copy._reconstruct is original  # never reduced
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.deepcopy([[_RebuildsAClass()]])
    assert stdlib_copy.deepcopy(_SetsADunder()).__class__ is _Target  # stdlib: unchecked


LEGITIMATE_USES = """
import collections, copy, dataclasses, enum, functools, typing

class Color(enum.Enum):
    RED = 1
    GREEN = 2
Shape = enum.Enum('Shape', 'CIRCLE SQUARE')
Perm = enum.IntFlag('Perm', {'R': 4, 'W': 2})

@dataclasses.dataclass(frozen=True, order=True)
class Point:
    x: int
    y: int = 0

@dataclasses.dataclass(frozen=True)
class Point3(Point):
    z: int = 0

def logged(function):
    @functools.wraps(function)
    def wrapper(*args):
        return function(*args)
    return wrapper

@logged
def add(a: int, b: int) -> int:
    "Add two numbers."
    return a + b

class Box:
    def __init__(self, items):
        self.items = items

box = Box([1, [2]])
deep = copy.deepcopy(box)
deep.items[1].append(3)
Pair = collections.namedtuple('Pair', 'left right', defaults=[0])
typing.reveal_type(Color.RED)
print(Color(2).name, Shape.SQUARE.value, int(Perm.R | Perm.W), Point(1) < Point(2),
      Point3(1, 2, 3), add(2, 3), box.items, copy.copy(box).items is box.items, Pair(1), dataclasses.asdict(Point(5, 6)))
print(dataclasses.asdict(Point3(1, 2, 3), dict_factory=lambda pairs: sorted(pairs)[::-1]),
      dataclasses.astuple(Point(7)), copy.deepcopy(Pair([1], {'k': Point(1)})))
import datetime
print(datetime.datetime.strptime('2024-05-01 13:30', '%Y-%m-%d %H:%M').isoformat(),
      datetime.date.fromisoformat('2024-05-01').strftime('%d %b %Y'))
"""


async def test_wrapped_modules_still_serve_ordinary_code():
    async with Repl(echo_tool, ["echo"], LIMITS) as repl:
        result = await repl.execute(LEGITIMATE_USES)
        assert result.ok, result.error
        assert result.stdout == (
            "Runtime type is 'Color'\n"
            "GREEN 2 6 True Point3(x=1, y=2, z=3) 5 [1, [2]] True "
            "Pair(left=1, right=0) {'x': 5, 'y': 6}\n"
            "[('z', 3), ('y', 2), ('x', 1)] (7, 0) Pair(left=[1], right={'k': Point(x=1, y=0)})\n"
            "2024-05-01T13:30:00 01 May 2024\n")


async def test_stdlib_state_is_unchanged_after_the_attempts():
    """The attempts above that would have changed global state in the worker did not."""
    async with Repl(echo_tool, ["echo"], LIMITS) as repl:
        for code in ("import typing\nsuper(type(typing.List), typing.List).__init__(int, "
                     "name='Hacked')",
                     "import collections.abc\ncollections.abc.Mapping.register(int)"):
            assert not (await repl.execute(code)).ok
        result = await repl.execute("import typing, collections.abc\n"
                                    "print(typing.List, isinstance(1, collections.abc.Mapping))")
        assert result.stdout == "typing.List False\n", result.error


class _Singleton:
    """Stands for a stdlib object the sandbox did not make (a module-level singleton)."""


SINGLETON = _Singleton()


class _WritesIntoASingleton:
    """A reduction a bypass could control: it "rebuilds" an existing object and sets state."""

    def __reduce_ex__(self, protocol):
        return (lambda: SINGLETON, (), (None, {"_private": "written"}))


def test_copy_never_writes_into_an_object_the_sandbox_did_not_make():
    copy = Sandbox().module_facade("copy")
    for function in (copy.copy, copy.deepcopy):
        with pytest.raises(TypeError, match="cannot be copied"):
            function(_WritesIntoASingleton())
    assert not hasattr(SINGLETON, "_private")
    import random

    twin = copy.copy(random.Random(5))  # a stdlib object's own reduction still copies it
    assert twin.random() == random.Random(5).random()


def test_dataclass_checks_inherited_fields_and_refuses_foreign_bases():
    """Field names from a base reach dataclasses' generated source too."""
    import dataclasses

    from agentrt.interpreter.sandbox import SANDBOX_MODULE_NAME

    crafted = dataclasses.field()
    crafted.name = "a,dict()['escaped:crafted']"
    crafted._field_type = dataclasses._FIELD
    base = type("Base", (), {"__module__": SANDBOX_MODULE_NAME,
                             "__dataclass_fields__": {crafted.name: crafted}})
    target = type("Target", (base,), {"__module__": SANDBOX_MODULE_NAME})
    sandbox = Sandbox()
    dataclass = sandbox.module_facade("dataclasses").dataclass
    with pytest.raises(TypeError, match="was not defined in the sandbox"):
        dataclass(init=False)(target)
    for cls in (base, target):  # as if the sandbox had made them: the field itself is refused
        sandbox.context.provenance.record(cls)
    with pytest.raises(TypeError, match="not allowed in the sandbox"):
        dataclass(init=False)(target)


def test_trust_reads_no_metadata_the_model_could_write():
    """A class that claims the sandbox's module, or builtins, is still not the sandbox's: only
    the classes the vetted path recorded are (by identity)."""
    import dataclasses

    from agentrt.interpreter.sandbox import SANDBOX_MODULE_NAME

    sandbox = Sandbox()
    guards, dataclass = sandbox.context.guards, sandbox.module_facade("dataclasses").dataclass
    crafted = dataclasses.field()
    crafted.name = "a,dict()['escaped:crafted']"
    crafted._field_type = dataclasses._FIELD
    for module in (SANDBOX_MODULE_NAME, "builtins"):
        claims = type("Claims", (), {"__module__": module,
                                     "__dataclass_fields__": {crafted.name: crafted}})
        with pytest.raises(TypeError, match="cannot modify"):
            guards.write(claims())
        with pytest.raises(TypeError, match="was not defined in the sandbox"):
            dataclass(init=False)(type("Target", (claims,), {"__module__": SANDBOX_MODULE_NAME}))
    outcome = sandbox.execute("def f():\n    pass\nclass A:\n    pass\nf.x = A.y = A().z = 1")
    assert outcome.error is None, outcome.error


def test_a_cell_holds_no_real_python_function():
    """Module functions and the sandbox's helpers reach the cell without globals to read; the
    cell's own functions stay plain functions it can write to."""
    import types

    sandbox = Sandbox()
    outcome = sandbox.execute(
        "import json, operator, dataclasses\n"
        "held = [json.dumps, json.JSONDecoder().decode, operator.attrgetter('a'), getattr, dir,\n"
        "        help, dataclasses.dataclass(frozen=True), sorted]\n"
        "def own():\n    return json.dumps([1])\n")
    assert outcome.error is None, outcome.error
    held = sandbox.namespace["held"]
    assert not [value for value in held if type(value) is types.FunctionType]
    assert type(sandbox.namespace["own"]) is types.FunctionType
    assert sandbox.execute("print(own(), held[0]({'a': 1}))").stdout == '[1] {"a": 1}\n'
