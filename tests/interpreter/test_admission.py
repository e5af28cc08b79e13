"""Admission: every door a value can reach a cell by admits it (doors.py, admission.py).

The escapes of the third to seventh red-team rounds, each a different path to a real object, and
the seventh round's residual risks, closed by construction, run here against the first wall
alone (an in-process sandbox, the fuzzer's oracle on what the namespace holds) and, for the
shadow's paths, in shadow mode with lazy values resolving. Then the doors themselves: each kind
of door is shown to admit, by a cell that would bind a real object through it if it did not.
"""

from __future__ import annotations

import threading
import time
import types

import pytest

from agentrt.interpreter.frames import Launch, Shadow
from agentrt.interpreter.sandbox import Sandbox
from agentrt.interpreter.sandbox.admission import AdmissionError, TypeView
from agentrt.interpreter.shadow_worker import ShadowRun
from sandbox_fuzz import violations

ESCAPE = "ESCAPED"

ROUND_THREE = {
    "copy-of-a-bound-method-with-a-chosen-name": """
import copy, typing
bind = type(getattr)
def f():
    pass
try:
    glb = copy.copy(bind(typing.NewType('__globals__', int), f))
    print('ESCAPED', glb['__builtins__']['__metaclass__'])
except Exception as e:
    print('refused', type(e).__name__)
""",
    "copy-of-a-classmethod-named-getattribute": """
import copy, typing
class A:
    m = classmethod(typing.NewType('__getattribute__', int))
ga = copy.copy(A.m)
try:
    real_type = ga(A, '__class__')
    print('ESCAPED', real_type)
except Exception as e:
    print('refused', type(e).__name__)
""",
    "eq-hook-sees-typings-origin": """
import typing
seen = []
class Catch:
    def __eq__(self, other):
        seen.append(other)
        return False
try:
    class X(typing.Type[int], Catch()):
        pass
except TypeError:
    pass
if any(s is not type and str(s) == "<class 'type'>" and s('E', (), {}) for s in seen):
    print('ESCAPED')
""",
    "eq-hook-through-a-crafted-alias": """
import typing
seen = []
class Catch:
    def __eq__(self, other):
        seen.append(other)
        return True
try:
    Alias = type(typing.List[int])
    crafted = Alias(Catch(), (int,), name='X')
    class X(crafted, typing.Type[int]):
        pass
except TypeError:
    pass
""",
    "deepcopy-with-a-memo-of-the-cells": """
import copy
class Memo(dict):
    def get(self, key, default=None):
        return dict.get(self, key, default)
memo = Memo()
try:
    copy.deepcopy(FINAL, memo)
except Exception as e:
    print('refused', type(e).__name__)
found = [dict.get(memo, k) for k in list(memo)]
""",
    "enum-names-that-change-between-reads": """
import enum
def hook(*args, **kwargs):
    print('ESCAPED hook ran')
class Names(str):
    def replace(self, a, b):
        return self
    def split(self):
        self.calls.append(1)
        return ['A'] if len(self.calls) == 1 else [('__get__', hook), ('A', 1)]
n = Names('A')
n.calls = []
E = enum.Enum('E', n)
class Holder:
    value = E.A
print(Holder().value)
""",
    "memoryview-through-a-digest-callback": """
import hashlib, io
class D:
    def update(self, data):
        print('ESCAPED', type(data))
    def digest(self):
        return b''
try:
    hashlib.file_digest(io.BytesIO(b'x'), D)
except Exception as e:
    print('refused', type(e).__name__)
""",
    "enum-mixin-of-any-class": """
import enum, difflib
try:
    E = enum.Enum('E', [], type=difflib.SequenceMatcher)
    print('ESCAPED', E)
except TypeError as e:
    print('refused')
""",
    "alias-class-writes-orig-class": """
import json
try:
    Alias = type(list[int])
    Alias(json.JSONDecoder, (int,))()
    print('ESCAPED')
except TypeError:
    print('refused')
""",
    "private-keywords": """
def f(**k):
    return k
try:
    f(**{'_x': 1})
    print('ESCAPED')
except TypeError:
    print('refused')
""",
    "final-var-with-a-str-subclass": """
class N(str):
    def strip(self):
        return '__builtins__'
    def startswith(self, prefix):
        return False
FINAL_VAR(N('x'))
""",
    "shared-class-state": """
import textwrap
table = textwrap.TextWrapper.unicode_whitespace_trans
table[32] = 'X'
if textwrap.TextWrapper.unicode_whitespace_trans.get(32) == 'X':
    print('ESCAPED shared state changed')
""",
    "type-hands-out-internal-classes": """
kinds = [type(getattr), type(print), type(type(list[int])), type(FINAL)]
for kind in kinds:
    try:
        kind(1, 2)
        print('ESCAPED', kind)
    except TypeError:
        pass
""",
}


ROUND_FOUR = {
    "decorated-dunder-collects-raw-operands": """
import typing, functools
box = []
def grab(f):
    return functools.partial(list.append, box)
try:
    class Catch:
        @grab
        def __eq__(self, other):
            pass
    typing.Type[int] == typing.Annotated[Catch(), 0]
except TypeError:
    print('refused')
""",
    "type-inside-a-c-pipeline": """
kinds = list(map(type, [FINAL, print, getattr, type]))
inner = list(map(map, kinds, [[type]] * 4))
made = [list(m) for m in inner]
for k in kinds:
    try:
        k(type)
        print('ESCAPED', k)
    except TypeError:
        pass
""",
    "abc-register-through-the-metaclass": """
import collections.abc
class Thing:
    pass
try:
    reg = list(map(getattr, map(type, [collections.abc.Mapping]), ['register']))[0]
    reg(collections.abc.Mapping, Thing)
except (TypeError, AttributeError):
    pass
if isinstance(Thing(), collections.abc.Mapping):
    print('ESCAPED registered')
""",
    "copy-state-writes-private-attributes": """
import copy, re
class E(Exception):
    pass
e = E('x')
try:
    copy.copy(e)
except TypeError:
    pass
if str(re.IGNORECASE) != 're.IGNORECASE':
    print('ESCAPED', re.IGNORECASE)
""",
    "print-bound-to-a-name": """
p = print
p('printed')
if repr(type(p)) != "<class 'SandboxFunction'>":
    print('ESCAPED', type(p))
""",
    "raw-memory-through-the-class": """
import io
try:
    views = list(map(io.BytesIO.getbuffer, [io.BytesIO(b'abc')]))
    print('ESCAPED', views)
except (TypeError, AttributeError):
    print('refused')
""",
    "process-wide-registries": """
import csv, typing
for name in ('register_dialect', 'unregister_dialect', 'field_size_limit'):
    try:
        getattr(csv, name)
        print('ESCAPED', name)
    except AttributeError:
        pass
try:
    typing.no_type_check_decorator
    print('ESCAPED no_type_check_decorator')
except AttributeError:
    pass
""",
    "the-full-chain": """
import typing, functools, copy, dataclasses
box = []
def grab(f):
    return functools.partial(list.append, box)
class Catch:
    @grab
    def __eq__(self, other):
        pass
typing.Type[int] == typing.Annotated[Catch(), 0]
rtype = next(list(map(map, map(type, [FINAL]), [box[-1:]]))[0])
Enew = rtype('Enew', (Exception,), {'__new__': functools.partial(dict.get, {})})
print('ESCAPED', Enew)
""",
}


ROUND_FIVE = {
    "abc-register-through-an-alias": """
import typing, collections.abc
try:
    typing.Mapping.register(int)
except AttributeError:
    pass
if isinstance(1, collections.abc.Mapping):
    print('ESCAPED registered')
""",
    "shared-class-state-through-an-alias": """
import typing, textwrap
try:
    t = typing.Annotated[textwrap.TextWrapper, 0].unicode_whitespace_trans
    t[32] = 'X'
except (AttributeError, TypeError):
    pass
if textwrap.fill('a b c') != 'a b c':
    print('ESCAPED shared state')
""",
    "unbound-method-writes-through-an-alias": """
import typing, random, json
try:
    random.Random.setstate(typing.Annotated[json.JSONDecoder, 0], (3, (), 'PAYLOAD'))
except (AttributeError, TypeError):
    pass
if getattr(json.JSONDecoder, 'gauss_next', None) == 'PAYLOAD':
    print('ESCAPED written')
""",
    "alias-call-writes-orig-class": """
import typing, operator, re
try:
    A = typing.Annotated[operator.itemgetter(0), 0]
    A([re.IGNORECASE])
except TypeError:
    print('refused')
""",
    "super-init-of-a-stdlib-base-is-admitted": """
import collections
class D(collections.UserDict):
    def __init__(self):
        init = super().__init__
        if repr(type(init)) != "<class 'SandboxFunction'>":
            print('ESCAPED', type(init))
        init()
D()
""",
}


ROUND_SIX = {
    "stdlib-method-through-a-made-subclass-makes-a-class": """
import collections, collections.abc
class CM(collections.ChainMap):
    pass
class K:
    maps = [(collections.abc.Sized,), {'__len__': 0}]
try:
    made = CM.new_child(K, 'Field')
    print('ESCAPED', made)
except TypeError:
    print('refused')
""",
    "stdlib-methods-copied-onto-an-lru-wrapper": """
import collections, functools, textwrap
try:
    make = functools.lru_cache(collections.ChainMap).new_child
    print('ESCAPED', make)
except (TypeError, AttributeError):
    print('refused')
try:
    t = functools.lru_cache(textwrap.TextWrapper).unicode_whitespace_trans
    t[32] = 'X'
except (TypeError, AttributeError):
    pass
if textwrap.fill('a b') != 'a b':
    print('ESCAPED shared state')
""",
    "stdlib-setstate-on-a-shared-member": """
import random, re
class R(random.Random):
    pass
try:
    R.setstate(re.IGNORECASE, (3, (), 'w1'))
except TypeError:
    pass
if getattr(re.IGNORECASE, 'gauss_next', None) == 'w1':
    print('ESCAPED written')
""",
    "descriptor-around-a-c-callable-captures-raw-objects": """
import functools
box = {}
try:
    grab = classmethod(property(functools.partial(dict.setdefault, box)))
    print('ESCAPED', grab)
except TypeError:
    print('refused')
""",
    "dataclasses-replace-on-a-duck-typed-object": """
import dataclasses
class Fake:
    pass
try:
    dataclasses.replace(Fake())
    print('ESCAPED')
except TypeError:
    print('refused')
""",
}


ROUND_SEVEN = {
    "except-target-of-a-class-no-facade-shows": """
import io
try:
    io.StringIO().fileno()
except Exception as e:
    err = e
if repr(type(err)) != "<class 'OSError'>":
    print('ESCAPED', type(err))
""",
    "stdlib-base-hands-an-inner-function-to-an-attribute-of-self": """
import string
box = {}
try:
    class T(string.Template):
        pass
    class Holder:
        pass
    h = Holder()
    h.sub = box.setdefault
    t = T('x')
    t.pattern = h
    t.substitute({})
except TypeError:
    print('refused')
if box:
    print('ESCAPED', box)
""",
    "asdict-factory-gets-what-a-stdlib-init-stored": """
import dataclasses, json
@dataclasses.dataclass
class D(json.JSONDecoder):
    parse_object: int = dataclasses.field(init=False, default=0)
    parse_constant: int = dataclasses.field(init=False, default=0)
d = D()
super(D, d).__init__()
box = []
for convert in (dataclasses.asdict, dataclasses.astuple):
    try:
        convert(d, **{'dict_factory' if convert is dataclasses.asdict
                      else 'tuple_factory': box.extend})
    except TypeError:
        print('refused')
if repr(box).count('function JSONObject at') or 'method-wrapper' in repr(box) \
        or 'built-in method' in repr(box):
    print('ESCAPED', box)
""",
    "alias-of-the-sandboxs-type-writes-orig-class-into-a-stdlib-class": """
import typing, json
try:
    typing.Annotated[type, 0](json.JSONDecoder())
except TypeError:
    print('refused')
""",
    "setattr-called-by-c-code-with-a-descriptor-no-door-saw": """
import functools
box = {}
class C:
    pass
grab = functools.partial(dict.setdefault, box)
try:
    list(map(setattr, [C], ['x'], map(classmethod, map(property, [grab]))))
except TypeError:
    print('refused')
try:
    C.x
    print('ESCAPED', box)
except AttributeError:
    pass
""",
    "descriptor-no-door-saw-unwrapped-into-a-class": """
import functools, enum, dataclasses
box = {}
grab = functools.partial(dict.setdefault, box)
try:
    class E1(enum.Enum):
        A = 1
        x = list(map(enum.nonmember, map(property, [grab])))[0]
except TypeError:
    print('refused')
try:
    E2 = enum.Enum('E2', list(zip(['A', 'x'], [1, *map(property, [grab])])))
except TypeError:
    print('refused')
try:
    @dataclasses.dataclass
    class D:
        x: int = list(map(dataclasses.Field, map(property, [grab]), [dataclasses.MISSING],
                          [True], [True], [None], [True], [None], [False]))[0]
except TypeError:
    print('refused')
""",
    "alias-built-and-called-by-c-code-writes-orig-class": """
import typing, operator, json, copy
T = typing.TypeVar('T')
try:
    list(map(list, map(map, map(operator.getitem, [typing.Annotated], [(copy.copy, 0)]),
                       [[json.JSONDecoder]])))
except TypeError:
    print('refused')
try:
    list(map(list, map(map, map(operator.itemgetter(copy.copy), [typing.Annotated[T, 1]]),
                       [[json.JSONEncoder]])))
except TypeError:
    print('refused')
""",
    "replace-hands-what-a-stdlib-init-stored-to-a-base-init": """
import dataclasses, json, collections
box = []
@dataclasses.dataclass(init=False)
class D(collections.UserDict, json.JSONDecoder):
    parse_object: int = 0
    update = box.append
d = D()
super(collections.UserDict, d).__init__()
try:
    dataclasses.replace(d)
except TypeError:
    print('refused')
if 'function JSONObject at' in repr(box):
    print('ESCAPED', box)
""",
}


ALL_ROUNDS = {**ROUND_THREE, **ROUND_FOUR, **ROUND_FIVE, **ROUND_SIX, **ROUND_SEVEN}


@pytest.mark.parametrize("name", sorted(ALL_ROUNDS))
def test_red_team_escapes_are_contained(name):
    sandbox = Sandbox()
    outcome = sandbox.execute(ALL_ROUNDS[name])
    assert ESCAPE not in outcome.stdout, outcome.stdout
    assert violations(sandbox) == []
    if outcome.final is not None:
        assert "__builtins__" not in str(outcome.final)
    if name == "shared-class-state":
        import textwrap

        assert textwrap.TextWrapper.unicode_whitespace_trans.get(32) != "X"
    if name in ("alias-of-the-sandboxs-type-writes-orig-class-into-a-stdlib-class",
                "alias-built-and-called-by-c-code-writes-orig-class"):
        import json

        assert "__orig_class__" not in vars(json.JSONDecoder)
        assert "__orig_class__" not in vars(json.JSONEncoder)


# -- the shadow's paths ------------------------------------------------------------------------

class _InProcessShadow:
    """A `ShadowRun` in this process: launches of ``echo`` resolve to their first argument on
    another thread, launches of ``leak`` are recorded."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self.channel = types.SimpleNamespace()
        self.leaked: list = []
        self.run: ShadowRun | None = None

    def send(self, frame) -> None:
        if isinstance(frame, Launch):
            if frame.name == "leak":
                self.leaked.extend(frame.args)
            run = self.run
            assert run is not None
            value = frame.args[0] if frame.args else None
            threading.Timer(0.01, run.table.resolve, (frame.call, value)).start()

    def receive(self):
        time.sleep(3600)


def run_in_shadow(code: str) -> tuple[Sandbox, list]:
    sandbox = Sandbox()
    for tool in ("echo", "leak"):
        sandbox.install_tool(tool, f"{tool}(x)", lambda *a, **k: None)
    process = _InProcessShadow(sandbox)
    run = process.run = ShadowRun(process, Shadow(((0, 1, code),), ("echo", "leak"), 5.0))
    run._enter_shadow_mode()
    for _block, _tree, compiled in run._compile_blocks(((0, 1, code),)):
        try:
            exec(compiled, sandbox.namespace)
        except BaseException:  # an abandoned or failed statement ends the block, as in a shadow
            break
    time.sleep(0.1)
    return sandbox, process.leaked


SHADOW_ROUND_THREE = {
    "lazy-attribute-through-attrgetter": """
import operator, json
r = echo(1)
L = ([json.JSONDecoder] * r)[0]
for f in [operator.attrgetter('decode')(L)] * r:
    pass
leak(repr(type(f)))
""",
    "lazy-str-format-through-super": """
import operator
r = echo(1)
class S(str):
    def sup(self):
        return super()
fmt = operator.attrgetter('format')(([S('{0.__class__}').sup()] * r)[0])
leak(repr(fmt))
""",
    "lazy-read-of-shared-class-state": """
import operator, textwrap
r = echo(1)
L = ([textwrap.TextWrapper] * r)[0]
t = operator.attrgetter('unicode_whitespace_trans')(L)
t[32] = 'X'
leak(str(t[32]))
""",
    "lazy-self-makes-a-class": """
import collections, collections.abc
class K:
    maps = [(collections.abc.Mapping,), {'x': 1}]
LK = [K][echo(0)]
try:
    made = collections.ChainMap.new_child(LK, 'Made')
    leak(repr(made))
except AttributeError:
    leak('refused')
""",
    "lazy-copy-of-a-classmethod": """
import copy, typing
r = echo(1)
class A:
    m = classmethod(typing.NewType('__class__', int))
cp = copy.copy
T = cp(([A.m] * r)[0])
leak(repr(T))
""",
}


@pytest.mark.parametrize("name", sorted(SHADOW_ROUND_THREE))
def test_round_three_shadow_escapes_are_contained(name):
    sandbox, leaked = run_in_shadow(SHADOW_ROUND_THREE[name])
    assert violations(sandbox) == []
    import textwrap

    assert textwrap.TextWrapper.unicode_whitespace_trans.get(32) != "X"
    assert not any(violations(sandbox))
    for text in leaked:
        assert " at 0x" not in text and "<class 'function'>" not in text, leaked
        assert "<method 'format' of 'str' objects>" not in text, leaked


def test_the_shadow_harness_sees_what_a_shadow_sends():
    """What the checks above read: resolved values reach the arguments of later launches."""
    sandbox, leaked = run_in_shadow("r = echo(1)\nleak(r + 1)\nleak(repr(r))")
    assert leaked == [2, "1"]


# -- each door ---------------------------------------------------------------------------------

class _Real:
    """A real object of a class the sandbox does not hold."""

    def method(self):
        return self


DOORS = {
    "call result": "v = give()",
    "operator result": "v = give_op + 1",
    "attribute": "v = holder.real",
    "subscript": "v = box[0]",
    "iteration": "for v in box:\n    pass",
    "unpacking": "v, w = box + [1]",
    "comprehension": "v = [x for x in box][0] if False else [x for x in box]",
    "parameter": "def f(x):\n    return x\nv = list(map(f, box))",
    "lambda parameter": "v = list(map(lambda x: x, box))",
    "with target": "with ctx as v:\n    pass",
    "decorator": "@deco\ndef v():\n    pass",
    "generator send": "def g():\n    x = yield 1\n    yield x\n"
                      "it = g()\nnext(it)\nv = it.send(item)",
}


class _Holder:
    def __init__(self, real):
        self.real = real


class _Context:
    def __init__(self, real):
        self.real = real

    def __enter__(self):
        return self.real

    def __exit__(self, *exc):
        return False


class _RealError(Exception):
    """An exception of a class the sandbox does not hold."""


def _raise_real():
    raise _RealError("real")


class _Adds:
    def __add__(self, other):
        return _Real()


@pytest.mark.parametrize("door", sorted(DOORS))
def test_every_door_admits(door):
    real = _Real()
    sandbox = Sandbox()
    sandbox.namespace.update({
        "give": lambda: real, "give_op": _Adds(), "box": [real],
        "item": real, "deco": lambda function: real, "raise_real": _raise_real,
    })
    sandbox.context.admission.hold(_Holder)
    sandbox.context.admission.hold(_Context)
    sandbox.context.admission.hold(_Adds)
    sandbox.namespace["holder"] = _Holder(real)
    sandbox.namespace["ctx"] = _Context(real)
    outcome = sandbox.execute(DOORS[door])
    assert outcome.error is not None and "cannot enter the sandbox" in outcome.error, \
        (door, outcome)
    held = sandbox.namespace.get("v")
    assert held is not real and not (type(held) is list and real in held)


def test_the_except_door_admits():
    """An exception of a class the sandbox does not hold is bound as one of the nearest class
    it holds, with its arguments (or its message, when they do not pass)."""
    sandbox = Sandbox()
    sandbox.namespace["raise_real"] = _raise_real
    outcome = sandbox.execute("try:\n    raise_real()\nexcept Exception as e:\n    v = e\n"
                              "print(type(v), v)")
    assert outcome.error is None and outcome.stdout == "<class 'Exception'> real\n", outcome
    assert type(sandbox.namespace["v"]) is Exception
    del sandbox.namespace["raise_real"]  # the test's own raw function
    assert violations(sandbox) == []


def test_admission_maps_and_refuses():
    sandbox = Sandbox()
    admit = sandbox.context.admission.admit
    assert admit(type) is sandbox.context.admission.sandbox_type
    assert isinstance(admit(types.FunctionType), TypeView)
    assert admit([1, "a"]) == [1, "a"] and admit(int) is int
    for refused in (sandbox.namespace, sandbox.namespace["__builtins__"], vars(types),
                    types.ModuleType("m"), memoryview(b"x"), object.__getattribute__,
                    (lambda: 0).__code__, eval):
        with pytest.raises(AdmissionError):
            admit(refused)
    assert type(admit(len)) is type(len)  # a builtin the sandbox hands out
    assert repr(admit(types.FunctionType)) == "<class 'function'>"


def test_the_except_door_keeps_the_shadows_signals():
    """``except BaseException as e: raise e`` in a shadow re-raises the shadow's own signal."""
    from agentrt.interpreter.lazy import Abandoned

    sandbox, _ = run_in_shadow("x = 1")
    signal = Abandoned("never arrives")
    assert sandbox.context.admission.admit_exception(signal) is signal


def test_a_stdlib_method_bound_to_a_foreign_self_is_refused():
    """A class-body function bound by a descriptor to what is not an instance of its class
    (``classmethod(ChainMap.new_child)`` on a class the cell made: ``self.__class__`` would be
    the real ``type``) is refused, however it reached admission."""
    import collections

    sandbox = Sandbox()
    sandbox.execute("class K:\n    pass")
    bound = types.MethodType(collections.ChainMap.new_child, sandbox.namespace["K"])
    with pytest.raises(TypeError):
        sandbox.context.admission.admit(bound)
    chain = collections.ChainMap()
    assert sandbox.context.admission.admit(chain.new_child)() == collections.ChainMap({}, {})


# -- round 7 residuals: closed by construction ---------------------------------------------------

ROUND_SEVEN_RESIDUALS = {
    "c-code-builds-descriptors-admission-refuses": """
import functools, enum, dataclasses
def f(self):
    return 1
box = {}
grab = functools.partial(dict.setdefault, box)
held = []
for build in (property, classmethod, staticmethod, functools.cached_property,
              functools.partialmethod, enum.property, property(f).setter):
    for inner in (len, grab):
        try:
            held.append(list(map(build, [inner])))
            print('ESCAPED built', build)
        except TypeError:
            pass
for build in (enum.member, enum.nonmember, dataclasses.Field):
    try:
        held.append(list(map(build, map(property, [grab]))))
        print('ESCAPED built', build)
    except TypeError:
        pass
""",
}


@pytest.mark.parametrize("name", sorted(ROUND_SEVEN_RESIDUALS))
def test_round_seven_residuals_are_contained(name):
    sandbox = Sandbox()
    outcome = sandbox.execute(ROUND_SEVEN_RESIDUALS[name])
    assert outcome.error is None, outcome.error
    assert ESCAPE not in outcome.stdout, outcome.stdout
    assert violations(sandbox) == []


def test_checked_classes_build_only_what_admission_lets_in():
    """``property``, ``classmethod``... as a cell holds them build and admit: C code cannot make
    one admission refuses (``map(property, [len])``), and ``isinstance``/``type()`` still
    answer as before."""
    sandbox = Sandbox()
    outcome = sandbox.execute("""
import functools, enum, dataclasses
try:
    x = list(map(property, [len]))
except TypeError as e:
    print('refused:', e)
def f(self):
    return 1
p = property(f)
print(isinstance(p, property), type(p) is property, repr(property))
class C:
    @property
    def v(self):
        return 5
    @v.setter
    def v(self, x):
        pass
    @classmethod
    def k(cls):
        return 2
    @staticmethod
    def s():
        return 3
    @functools.cached_property
    def c(self):
        return 4
class E(enum.Enum):
    A = enum.member(1)
    b = enum.nonmember(2)
@dataclasses.dataclass
class D:
    x: list = dataclasses.field(default_factory=list)
print(C().v, C.k(), C.s(), C().c, E.A.value, E.b, D(),
      isinstance(dataclasses.fields(D)[0], dataclasses.Field))
""")
    assert outcome.error is None, outcome.error
    assert outcome.stdout.splitlines() == [
        "refused: a property in the sandbox wraps only a function defined in the sandbox",
        "True True <class 'property'>", "5 2 3 4 1 2 D(x=[]) True"], outcome.stdout
    assert "x" not in sandbox.namespace and violations(sandbox) == []


def test_a_class_whose_dict_holds_what_admission_refuses_is_not_made():
    """Whatever wrote it, a class made for a cell holds nothing admission refuses: the check
    after every class is made (`Provenance.record`) is the guarantee, not each sink's own."""
    import functools

    sandbox = Sandbox()
    record = sandbox.context.provenance.record
    for namespace in ({"x": property(len)}, {"x": classmethod(functools.partial(len))},
                      {"__eq__": [].append}, {"_y": functools.partial(len)},
                      {"__init__": _Foreign()}):
        cls = type("B", (), namespace)
        with pytest.raises(TypeError, match="does not allow in a class it made"):
            record(cls)
        assert not sandbox.context.provenance.made_class(cls)


class _Foreign:
    """An object of a class the sandbox does not hold."""

    def __call__(self, *args):
        return args


def test_the_class_machinery_passes_the_class_dict_check():
    """What Python and the vetted class factories write into a class passes the check."""
    sandbox = Sandbox()
    outcome = sandbox.execute("""
import collections, dataclasses, enum, typing, collections.abc, numbers, random
class A: pass
class B(collections.abc.Mapping):
    def __init__(self): pass
P = collections.namedtuple('P', 'x def', rename=True)
@dataclasses.dataclass(frozen=True, slots=True, order=True)
class D:
    x: int = 0
class E(enum.Enum):
    A = 1
    name = 2
F = enum.IntFlag('F', {'R': 4, 'W': 2})
class N(typing.NamedTuple):
    x: int
class T(typing.TypedDict):
    x: int
N2 = typing.NamedTuple('N2', [('x', int)])
V = typing.TypeVar('V')
class G(typing.Generic[V]): pass
class Pr(typing.Protocol):
    def f(self): pass
class R(random.Random): pass
class Nu(numbers.Number): pass
class C(collections.UserDict): pass
print(P(1, 2), D(1) < D(2), E.name.value, F.R | F.W, N(1), G(), C(a=1))
""")
    assert outcome.error is None, outcome.error
    assert violations(sandbox) == []


@pytest.mark.parametrize("base", ["JSONDecoder", "JSONEncoder"])
def test_bases_whose_init_stores_stdlib_internals_are_refused(base):
    """``json.JSONDecoder.__init__`` stores the module's inner scanner functions on the
    instance; a subclass's fields, ``asdict`` and ``replace`` read them back. Such classes are
    no allowed base; cells still use them directly."""
    sandbox = Sandbox()
    outcome = sandbox.execute(f"import json\nclass D(json.{base}):\n    pass")
    assert "not a class the sandbox can derive from" in (outcome.error or ""), outcome
    outcome = sandbox.execute("print(json.JSONDecoder().decode('[1]'), "
                              "json.JSONEncoder().encode([2]))")
    assert outcome.error is None and outcome.stdout == "[1] [2]\n", outcome


# -- round 8 ------------------------------------------------------------------------------------

def test_update_wrapper_admits_what_it_copies():
    """``functools.update_wrapper`` copied ``wrapped.__dict__``'s public attributes onto the
    cell's function as they were: ``json.JSONDecoder()`` put its C scanner (``scan_once``) and
    the module's inner parser functions on it, objects admission refuses. What it copies is
    admitted now, as the builtin ``setattr`` admits what it writes."""
    sandbox = Sandbox()
    outcome = sandbox.execute("""
import functools, json
def f():
    pass
try:
    functools.update_wrapper(f, json.JSONDecoder())
except TypeError as e:
    print('refused')
class Box:
    pass
b = Box()
try:
    functools.wraps(json.JSONDecoder())(b)
except TypeError:
    print('refused')
def k(self):
    return 1
def m():
    pass
try:  # a cached_property holds an RLock under a public name; C code calls update_wrapper
    list(map(functools.update_wrapper, [m], [functools.cached_property(k)]))
except TypeError:
    print('refused')
def g():
    pass
g.tag = [1]
@functools.wraps(g)
def h():
    pass
print(h.tag, 'h')
""")
    assert outcome.error is None, outcome.error
    assert outcome.stdout.splitlines() == ["refused", "refused", "refused", "[1] h"], outcome.stdout
    admissible = sandbox.context.admission.admissible
    for holder in (sandbox.namespace["f"], sandbox.namespace["b"], sandbox.namespace["m"]):
        for name, value in vars(holder).items():
            assert admissible(value), (name, value)
    assert violations(sandbox) == []
