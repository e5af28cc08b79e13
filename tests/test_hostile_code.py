"""Hostile cells: each one gets a clear error and the same kernel keeps working afterwards.

Add new escape attempts to HOSTILE_CELLS: (code, expected error type).
"""

from __future__ import annotations

import pytest

from agentrt.interpreter import Kernel, KernelLimits

pytestmark = pytest.mark.anyio

LIMITS = KernelLimits(cpu_s=1, wall_s=20, memory_mb=1024)

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
    pytest.param("class A(metaclass=type):\n    pass", "SyntaxError", id="metaclass-keyword"),
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


@pytest.fixture
def anyio_backend():
    return "asyncio"


async def echo_tool(name: str, args: tuple, kwargs: dict):
    return list(args)


async def assert_kernel_still_works(kernel: Kernel) -> None:
    after = await kernel.execute("check = sentinel + 1\nprint(check, echo(check))")
    assert after.ok, after.error
    assert after.stdout == "43 [43]\n"


@pytest.mark.parametrize(("code", "error_type"), HOSTILE_CELLS)
async def test_hostile_cell_gets_a_clear_error(code: str, error_type: str):
    async with Kernel(echo_tool, ["echo"], LIMITS) as kernel:
        assert (await kernel.execute("sentinel = 42")).ok
        result = await kernel.execute(code)
        assert result.error_type == error_type, result.error
        assert result.error.startswith(error_type)
        assert "\n" not in result.error.split("\n")[0]
        await assert_kernel_still_works(kernel)


async def test_syntax_error_mid_block_runs_nothing():
    async with Kernel(echo_tool, ["echo"], LIMITS) as kernel:
        await kernel.execute("sentinel = 42")
        result = await kernel.execute("first = 1\nsecond = = 2\nthird = 3")
        assert result.error_type == "SyntaxError"
        assert "line 2" in result.error and "second = = 2" in result.error
        with pytest.raises(KeyError):
            await kernel.get_variable("first")
        await assert_kernel_still_works(kernel)


async def test_printing_100_mb_is_truncated():
    async with Kernel(echo_tool, ["echo"], LIMITS) as kernel:
        await kernel.execute("sentinel = 42")
        result = await kernel.execute("print('x' * 10**8)\nprint('tail')")
        assert result.ok, result.error
        assert len(result.stdout) < LIMITS.max_output_chars + 100
        assert result.stdout.endswith(f"[output truncated: {10**8 + 6 - 10**6} more characters]")
        await assert_kernel_still_works(kernel)


async def test_one_kernel_survives_many_hostile_cells_in_a_row():
    slow = {"TimeoutError", "MemoryError"}
    async with Kernel(echo_tool, ["echo"], LIMITS) as kernel:
        await kernel.execute("sentinel = 42")
        for param in HOSTILE_CELLS:
            code, error_type = param.values
            if error_type in slow:
                continue
            result = await kernel.execute(code)
            assert result.error_type == error_type, (param.id, result.error)
        await assert_kernel_still_works(kernel)
