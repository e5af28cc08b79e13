"""Lazy values and forcing: the placeholders a shadow run computes with.

A :class:`Lazy` wraps a node: a **call node**, whose value arrives from outside
(:meth:`LazyTable.resolve`) or never does (:meth:`LazyTable.fail`, :meth:`LazyTable.poison`), or a
**deferred node**, a function applied to arguments of which some are lazy, computed once when
first forced. Operations that can wait return new deferred lazies; operations that need a
concrete answer now *force* (block until the results arrive). Forcing a value that can never
arrive raises :class:`Abandoned`. The public API is re-exported by :mod:`.lazy`.
"""

from __future__ import annotations

import contextlib
import math
import operator
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

from RestrictedPython.Guards import safer_getattr_raise

from agentrt.errors import AgentrtError

CallId = Hashable

PENDING = "pending"
RESOLVED = "resolved"
FAILED = "failed"
POISONED = "poisoned"

# How long a receiver-side computation waits for a node lock held by another thread before it
# gives up and retries on the next event (see ``PendingLaunches``).
_NONBLOCKING_LOCK_WAIT_S = 0.1
# How many container elements the "does this argument hold a Lazy?" check looks at before it
# assumes the answer is no (keeps a shadow ``len(huge_list)`` in a loop cheap).
_SCAN_LIMIT = 10_000
# How many times force_deep looks again inside values that forcing produced.
_MAX_DEEP_ROUNDS = 32


class Abandoned(BaseException):
    """The shadow needs a value that will never arrive (poisoned or failed call, or failed
    deferred operation): the current statement must be abandoned.

    Derives from ``BaseException`` on purpose, so that ``except Exception`` in model code cannot
    swallow it.
    """


class _WouldBlock(AgentrtError):
    """Raised inside non-blocking computations (receiver thread) instead of waiting."""


def _is_nonblocking(node: _Node) -> bool:
    """Whether this thread may not wait for ``node`` (see `LazyTable.nonblocking`)."""
    table = node.table
    return table is not None and table.nonblocking_thread == threading.get_ident()


# ---------------------------------------------------------------------------------------------
# Nodes


class _CallNode:
    """A value that arrives from outside: the result of a launched tool call."""

    __slots__ = ("call_id", "table", "event", "state", "value", "error")

    def __init__(self, call_id: CallId, table: LazyTable) -> None:
        self.call_id = call_id
        self.table = table
        self.event = threading.Event()
        self.state = PENDING
        self.value: Any = None
        self.error = ""

    @property
    def done(self) -> bool:
        return self.state != PENDING

    def label(self) -> str:
        return f"call {self.call_id!r}"


class _DeferredNode:
    """A function applied to arguments containing lazy values, computed once when forced."""

    __slots__ = ("fn", "args", "kwargs", "inputs", "name", "table", "lock", "state", "value",
                 "error")

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, name: str) -> None:
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.name = name
        self.inputs = _lazy_leaves((args, kwargs))
        self.table = self.inputs[0].table if self.inputs else None
        self.lock = threading.Lock()
        self.state = PENDING
        self.value: Any = None
        self.error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self.state != PENDING

    def label(self) -> str:
        return f"deferred {self.name}"


_Node = _CallNode | _DeferredNode


def _children(item: Any, kind: type) -> Iterable[Any] | None:
    """The elements of a container the lazy machinery looks inside, or None for a leaf."""
    if kind is list or kind is set or kind is frozenset or issubclass(kind, tuple):
        return item
    if kind is dict:
        return [*item.keys(), *item.values()]
    if kind is slice:
        return (item.start, item.stop, item.step)
    return None


def _lazy_leaves(x: Any) -> list[_Node]:
    """Distinct nodes of the ``Lazy`` values found in ``x`` (containers walked, values not)."""
    found: list[_Node] = []
    seen: set[int] = set()
    stack = [x]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is Lazy:
            node = object.__getattribute__(item, "_lz_node")
            if id(node) not in seen:
                seen.add(id(node))
                found.append(node)
            continue
        children = _children(item, kind)
        if children is not None and id(item) not in seen:
            seen.add(id(item))
            stack.extend(children)
    return found


def _holds_lazy(x: Any, deep: bool = True) -> bool:
    """True if ``x`` is a ``Lazy`` or (``deep``) a container holding one.

    The scan gives up (answers False) after ``_SCAN_LIMIT`` elements.
    """
    if type(x) is Lazy:
        return True
    if not deep:
        return False
    budget = _SCAN_LIMIT
    stack = [x]
    while stack and budget > 0:
        item = stack.pop()
        budget -= 1
        kind = type(item)
        if kind is Lazy:
            return True
        children = _children(item, kind)
        if children is not None:
            stack.extend(children)
    return False


def _snapshot(x: Any, memo: dict[int, Any] | None = None) -> Any:
    """``x`` with its lists, dicts and sets copied (recursively, aliasing and cycles kept), so
    that mutating them later cannot change the input of a deferred operation."""
    if memo is None:
        memo = {}
    kind = type(x)
    if kind is list:
        if id(x) in memo:
            return memo[id(x)]
        copied: list = []
        memo[id(x)] = copied
        copied.extend(_snapshot(item, memo) for item in x)
        return copied
    if kind is dict:
        if id(x) in memo:
            return memo[id(x)]
        copied_dict: dict = {}
        memo[id(x)] = copied_dict
        for key, value in x.items():
            copied_dict[key] = _snapshot(value, memo)
        return copied_dict
    if kind is set:
        return set(x)
    if kind is tuple:
        items = tuple(_snapshot(item, memo) for item in x)
        return x if all(a is b for a, b in zip(items, x)) else items
    return x


def _node_of(x: Lazy) -> _Node:
    return object.__getattribute__(x, "_lz_node")


def _make_lazy(node: _Node) -> Lazy:
    lazy = object.__new__(Lazy)
    object.__setattr__(lazy, "_lz_node", node)
    return lazy


def _defer(fn: Callable[..., Any], args: tuple, kwargs: dict | None = None, name: str = "",
           snapshot: bool = True) -> Lazy:
    """A new deferred ``Lazy`` computing ``fn(*args, **kwargs)`` once its lazy inputs resolve.

    With ``snapshot`` the mutable containers among the arguments are copied now.
    """
    kwargs = kwargs or {}
    if snapshot:
        memo: dict[int, Any] = {}
        args, kwargs = _snapshot(args, memo), _snapshot(kwargs, memo)
    return _make_lazy(_DeferredNode(fn, args, kwargs, name or _name_of(fn)))


def _name_of(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or "operation"


# ---------------------------------------------------------------------------------------------
# Forcing


def _wait_call(node: _CallNode) -> None:
    nonblocking = _is_nonblocking(node)
    if not nonblocking:
        node.table.forced.add(node.call_id)
    if node.state == PENDING:
        if nonblocking:
            raise _WouldBlock(node.label())
        node.event.wait()
    if node.state == FAILED:
        raise Abandoned(f"{node.label()} failed: {node.error}")
    if node.state == POISONED:
        raise Abandoned(f"{node.label()} will not run: {node.error}")


def _compute_deferred(node: _DeferredNode) -> None:
    """Compute ``node`` (all inputs already done); records the value or the error."""
    if _is_nonblocking(node):
        if not node.lock.acquire(timeout=_NONBLOCKING_LOCK_WAIT_S):
            raise _WouldBlock(node.label())
    else:
        node.lock.acquire()
    try:
        if node.done:
            return
        for inp in node.inputs:
            if inp.state in (FAILED, POISONED):
                node.error = Abandoned(f"input of {node.label()} is unavailable")
                node.state = FAILED
                return
        try:
            args = _substitute(node.args)
            kwargs = _substitute(node.kwargs)
            value = node.fn(*args, **kwargs)
            if node.table is not None:
                value = node.table.admit(value)
        except (_WouldBlock, Abandoned):
            raise
        except Exception as exc:  # the operation itself failed: remember it, report on force
            node.error = exc
            node.state = FAILED
            return
        node.value = value
        node.state = RESOLVED
    finally:
        node.lock.release()


def _force_node(root: _Node) -> Any:
    """Iteratively compute ``root`` (no recursion: deferred chains can be thousands deep)."""
    stack: list[_Node] = [root]
    while stack:
        node = stack[-1]
        if type(node) is _CallNode:
            _wait_call(node)
            stack.pop()
            continue
        if node.done:
            stack.pop()
            continue
        inputs_missing = False
        for inp in node.inputs:
            if type(inp) is _CallNode:
                _wait_call(inp)  # raises if it can never arrive
            elif not inp.done:
                stack.append(inp)
                inputs_missing = True
            elif inp.state == FAILED:
                _raise_deferred_failure(inp)
        if not inputs_missing:
            _compute_deferred(node)
            stack.pop()
    if type(root) is _CallNode:
        return root.value
    if root.state == FAILED:
        _raise_deferred_failure(root)
    return root.value


def _raise_deferred_failure(node: _DeferredNode) -> None:
    error = node.error
    if isinstance(error, Abandoned):
        raise Abandoned(str(error)) from error
    raise Abandoned(f"{node.label()} raised {type(error).__name__}: {error}") from error


def _substitute(x: Any, memo: dict[int, Any] | None = None) -> Any:
    """``x`` with every ``Lazy`` (also inside containers) replaced by its value; containers
    without lazies are returned as they are."""
    kind = type(x)
    if kind is Lazy:
        return _force_node(_node_of(x))
    if _children(x, kind) is None:
        return x
    if memo is None:
        memo = {}
    if id(x) in memo:
        return memo[id(x)]
    memo[id(x)] = x  # a cycle back to x keeps the original object
    if kind is dict:
        pairs = [(_substitute(k, memo), _substitute(v, memo))
                 for k, v in x.items()]
        same = all(a is k and b is v for (a, b), (k, v) in zip(pairs, x.items()))
        result: Any = x if same else dict(pairs)
    elif kind is slice:
        start, stop, step = (_substitute(v, memo) for v in (x.start, x.stop, x.step))
        result = slice(start, stop, step)
    else:
        items = [_substitute(item, memo) for item in x]
        if all(a is b for a, b in zip(items, x)):
            result = x
        elif kind is list:
            result = items
        elif kind is tuple or kind is set or kind is frozenset:
            result = kind(items)
        elif hasattr(kind, "_make"):  # named tuple
            result = kind._make(items)
        else:  # another tuple subclass: a plain tuple keeps the values
            result = tuple(items)
    memo[id(x)] = result
    return result


def is_lazy(x: Any) -> bool:
    """True if ``x`` itself is a ``Lazy`` (does not force, does not look inside containers)."""
    return type(x) is Lazy


def force(x: Any) -> Any:
    """The concrete value of ``x``: computes deferred nodes, blocks until call results arrive.

    Non-lazy values are returned unchanged. Raises :class:`Abandoned` when the value can never
    arrive.
    """
    if type(x) is not Lazy:
        return x
    return _force_node(_node_of(x))


def force_deep(x: Any) -> Any:
    """Like :func:`force`, and also replaces lazies inside lists, tuples, dicts, sets and slices,
    including inside the values that forcing produces."""
    value = _substitute(x)
    # A forced value may itself be a container of lazies (e.g. a deferred list build); the
    # bound stops a container that holds itself and a lazy from looping forever.
    for _ in range(_MAX_DEEP_ROUNDS):
        if not _holds_lazy(value):
            break
        value = _substitute(value)
    return value


def _walk(x: Any, descend: Callable[[Any], bool]):
    """Every node ``x`` reaches once, descending into deferred nodes where ``descend`` says."""
    seen: set[int] = set()
    stack = _lazy_leaves(x)
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        yield node
        if type(node) is not _CallNode and descend(node):
            stack.extend(node.inputs)


def deps(x: Any) -> set[CallId]:
    """The call ids of every call node ``x`` depends on (through deferred nodes too)."""
    return {node.call_id for node in _walk(x, lambda node: True) if type(node) is _CallNode}


def _unfinished_calls(x: Any) -> tuple[list[_CallNode], bool]:
    """(pending call nodes ``x`` still waits for, whether some input can never arrive)."""
    pending: list[_CallNode] = []
    doomed = False
    for node in _walk(x, lambda node: node.state == PENDING):
        if type(node) is _CallNode:
            if node.state == PENDING:
                pending.append(node)
            elif node.state != RESOLVED:
                doomed = True
        elif node.state == FAILED:
            doomed = True
    return pending, doomed


def ready(x: Any) -> bool:
    """True if every call result ``x`` needs has arrived (forcing it will not wait)."""
    pending, doomed = _unfinished_calls(x)
    return not pending and not doomed


def describe(x: Any) -> str:
    """A short description that never forces: ``<Lazy call 'c1' pending>``, or ``repr(x)``."""
    if type(x) is not Lazy:
        return repr(x)
    node = _node_of(x)
    return f"<Lazy {node.label()} {node.state}>"


def _identity(value: Any) -> Any:
    return value


# ---------------------------------------------------------------------------------------------
# The Lazy placeholder


def _forced(self: Lazy) -> Any:
    return force(self)


def _deferring_binary(op: Callable[[Any, Any], Any], symbol: str) -> tuple[Callable, Callable]:
    def forward(self: Lazy, other: Any) -> Lazy:
        return _defer(op, (self, other), name=symbol)

    def reflected(self: Lazy, other: Any) -> Lazy:
        return _defer(op, (other, self), name=symbol)

    forward.__name__ = f"deferred {symbol}"
    reflected.__name__ = f"deferred reflected {symbol}"
    return forward, reflected


def _deferring_unary(op: Callable[[Any], Any], symbol: str) -> Callable:
    def method(self: Lazy) -> Lazy:
        return _defer(op, (self,), name=symbol)

    method.__name__ = f"deferred {symbol}"
    return method


def _deferring_forward(op: Callable[[Any, Any], Any], symbol: str) -> Callable:
    def method(self: Lazy, other: Any) -> Lazy:
        return _defer(op, (self, other), name=symbol)

    method.__name__ = f"deferred {symbol}"
    return method


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def _pow3(base: Any, exp: Any, mod: Any) -> Any:
    return pow(base, exp, mod)


def _round(value: Any, ndigits: Any = None) -> Any:
    return round(value) if ndigits is None else round(value, ndigits)


# Methods that change their receiver: calling one on a lazy value forces the receiver and calls
# the real method right away, so the mutation happens in program order (never deferred).
MUTATING_METHOD_NAMES = frozenset({
    "append", "extend", "insert", "remove", "pop", "clear", "update", "setdefault", "popitem",
    "add", "discard", "sort", "reverse", "difference_update", "intersection_update",
    "symmetric_difference_update", "write", "writelines", "send", "close", "put", "set",
    "delete", "move_to_end", "appendleft", "extendleft", "popleft", "rotate",
})


def _check_public(name: str) -> None:
    if name.startswith("_"):
        raise AttributeError(f'"{name}" is an invalid attribute name because it starts with "_"')


def _guarded_attribute(value: Any, name: str) -> Any:
    return safer_getattr_raise(value, name)


def _attribute_reader(lazy: Lazy) -> Callable[[Any, str], Any]:
    """How ``lazy``'s table reads an attribute of a value (RestrictedPython's guard without
    a table)."""
    table = _node_of(lazy).table
    return table.getattr if table is not None else _guarded_attribute


def _writable(lazy: Lazy) -> Any:
    """The value of ``lazy`` (forced), if its table's write guard allows writing into it."""
    table = _node_of(lazy).table
    value = _forced(lazy)
    return table.write(value) if table is not None else value


class Lazy:
    """A placeholder for a value that is not known yet (see the module docstring).

    A ``Lazy`` has no public attributes of its own: every attribute and operation is forwarded
    to the value it stands for, deferred where possible, forced where not. Use the module
    functions (:func:`force`, :func:`ready`, :func:`describe`, ...) to inspect one.
    """

    __slots__ = ("_lz_node",)

    def __init__(self) -> None:
        raise TypeError("Lazy values are created by a LazyTable, not directly")

    # -- forcing: the answer must be concrete now --------------------------------------------
    def __bool__(self) -> bool:
        return bool(_forced(self))

    def __len__(self) -> int:
        return len(_forced(self))

    def __iter__(self):
        return iter(_forced(self))

    def __reversed__(self):
        return reversed(_forced(self))

    def __next__(self):
        return next(_forced(self))

    def __contains__(self, item: Any) -> bool:
        return item in _forced(self)

    def __str__(self) -> str:
        return str(_forced(self))

    def __repr__(self) -> str:
        return repr(_forced(self))

    def __format__(self, spec: str) -> str:
        return format(_forced(self), spec)

    def __bytes__(self) -> bytes:
        return bytes(_forced(self))

    def __hash__(self) -> int:
        return hash(_forced(self))

    def __index__(self) -> int:
        return operator.index(_forced(self))

    def __int__(self) -> int:
        return int(_forced(self))

    def __float__(self) -> float:
        return float(_forced(self))

    def __complex__(self) -> complex:
        return complex(_forced(self))

    def __dir__(self) -> list[str]:
        return dir(_forced(self))

    def __enter__(self):
        return _forced(self).__enter__()

    def __exit__(self, *exc_info: Any):
        return _forced(self).__exit__(*exc_info)

    def __reduce_ex__(self, protocol: int) -> tuple:
        return (_identity, (force_deep(self),))

    def __reduce__(self) -> tuple:
        return (_identity, (force_deep(self),))

    @property
    def __class__(self) -> type:  # type: ignore[override]
        """The type of the value (forces), so ``isinstance(lazy, str)`` answers for the value;
        for a value that is itself a class, ``Lazy`` (never a metaclass, which code calling
        ``self.__class__(...)`` would use to make classes)."""
        cls = type(_forced(self))
        return Lazy if issubclass(cls, type) else cls

    # -- mutation: forced, applied to the real value in program order ------------------------
    def __setitem__(self, key: Any, value: Any) -> None:
        _writable(self)[force(key)] = value

    def __delitem__(self, key: Any) -> None:
        del _writable(self)[force(key)]

    def __setattr__(self, name: str, value: Any) -> None:
        _check_public(name)
        setattr(_writable(self), name, value)

    def __delattr__(self, name: str) -> None:
        _check_public(name)
        delattr(_writable(self), name)

    # -- deferred: a new Lazy standing for the result ----------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        read = _attribute_reader(self)
        if name in MUTATING_METHOD_NAMES:
            return read(_forced(self), name)
        return _defer(read, (self, name), name=f".{name}")

    def __getitem__(self, key: Any) -> Lazy:
        return _defer(operator.getitem, (self, key), name="[]")

    def __call__(self, *args: Any, **kwargs: Any) -> Lazy:
        return _defer(_call, (self, *args), kwargs, name="call")

    def __round__(self, ndigits: Any = None) -> Lazy:
        return _defer(_round, (self, ndigits), name="round")

    def __pow__(self, other: Any, mod: Any = None) -> Lazy:
        if mod is None:
            return _defer(operator.pow, (self, other), name="**")
        return _defer(_pow3, (self, other, mod), name="pow")

    def __rpow__(self, other: Any, mod: Any = None) -> Lazy:
        if mod is None:
            return _defer(operator.pow, (other, self), name="**")
        return _defer(_pow3, (other, self, mod), name="pow")

    def __ipow__(self, other: Any) -> Lazy:
        return _defer(operator.ipow, (self, other), name="**=")

    __add__, __radd__ = _deferring_binary(operator.add, "+")
    __sub__, __rsub__ = _deferring_binary(operator.sub, "-")
    __mul__, __rmul__ = _deferring_binary(operator.mul, "*")
    __matmul__, __rmatmul__ = _deferring_binary(operator.matmul, "@")
    __truediv__, __rtruediv__ = _deferring_binary(operator.truediv, "/")
    __floordiv__, __rfloordiv__ = _deferring_binary(operator.floordiv, "//")
    __mod__, __rmod__ = _deferring_binary(operator.mod, "%")
    __divmod__, __rdivmod__ = _deferring_binary(divmod, "divmod")
    __lshift__, __rlshift__ = _deferring_binary(operator.lshift, "<<")
    __rshift__, __rrshift__ = _deferring_binary(operator.rshift, ">>")
    __and__, __rand__ = _deferring_binary(operator.and_, "&")
    __xor__, __rxor__ = _deferring_binary(operator.xor, "^")
    __or__, __ror__ = _deferring_binary(operator.or_, "|")

    __iadd__ = _deferring_forward(operator.iadd, "+=")
    __isub__ = _deferring_forward(operator.isub, "-=")
    __imul__ = _deferring_forward(operator.imul, "*=")
    __imatmul__ = _deferring_forward(operator.imatmul, "@=")
    __itruediv__ = _deferring_forward(operator.itruediv, "/=")
    __ifloordiv__ = _deferring_forward(operator.ifloordiv, "//=")
    __imod__ = _deferring_forward(operator.imod, "%=")
    __ilshift__ = _deferring_forward(operator.ilshift, "<<=")
    __irshift__ = _deferring_forward(operator.irshift, ">>=")
    __iand__ = _deferring_forward(operator.iand, "&=")
    __ixor__ = _deferring_forward(operator.ixor, "^=")
    __ior__ = _deferring_forward(operator.ior, "|=")

    __eq__ = _deferring_forward(operator.eq, "==")
    __ne__ = _deferring_forward(operator.ne, "!=")
    __lt__ = _deferring_forward(operator.lt, "<")
    __le__ = _deferring_forward(operator.le, "<=")
    __gt__ = _deferring_forward(operator.gt, ">")
    __ge__ = _deferring_forward(operator.ge, ">=")

    __neg__ = _deferring_unary(operator.neg, "unary -")
    __pos__ = _deferring_unary(operator.pos, "unary +")
    __invert__ = _deferring_unary(operator.invert, "~")
    __abs__ = _deferring_unary(abs, "abs")
    __trunc__ = _deferring_unary(math.trunc, "trunc")
    __floor__ = _deferring_unary(math.floor, "floor")
    __ceil__ = _deferring_unary(math.ceil, "ceil")


# ---------------------------------------------------------------------------------------------
# The table of call results


Listener = Callable[[CallId, str], None]


class LazyTable:
    """Thread-safe registry of call nodes: the shadow's main thread creates and forces lazies,
    a receiver thread delivers results with :meth:`resolve` / :meth:`fail`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[CallId, _CallNode] = {}
        self._listeners: list[Listener] = []
        self.forced: set[CallId] = set()
        """Calls whose values the program needed (forced outside a receiver thread): the
        control and data dependencies of whatever it launches next."""
        self.nonblocking_thread: int | None = None
        """The thread inside :meth:`nonblocking`, if one is."""
        self.admit: Callable[[Any], Any] = _identity
        """What every deferred value passes once computed (the sandbox's admission: what a
        deferred operation yields is what the same operation would give the cell)."""
        self.getattr: Callable[[Any, str], Any] = _guarded_attribute
        """How a lazy value's attribute is read once its value is known (the sandbox's guard)."""
        self.write: Callable[[Any], Any] = _identity
        """What a write into a lazy value's value goes through (the sandbox's write guard)."""

    # -- creating and settling calls ---------------------------------------------------------
    def new_call(self, call_id: CallId) -> Lazy:
        """Register call ``call_id`` and return the ``Lazy`` for its result."""
        with self._lock:
            if call_id in self._calls:
                raise ValueError(f"call id {call_id!r} is already registered")
            node = _CallNode(call_id, self)
            self._calls[call_id] = node
        return _make_lazy(node)

    def resolve(self, call_id: CallId, value: Any) -> bool:
        """Deliver the result of ``call_id``; False if the id is unknown or already settled."""
        return self._settle(call_id, RESOLVED, value, "")

    def fail(self, call_id: CallId, text: str) -> bool:
        """Record that ``call_id`` raised (``text`` describes the error); forcing it abandons."""
        return self._settle(call_id, FAILED, None, text)

    def poison(self, call_id: CallId,
               reason: str = "the call is not launched in the shadow") -> bool:
        """Record that ``call_id`` will never run (e.g. a non-speculatable tool)."""
        return self._settle(call_id, POISONED, None, reason)

    def _settle(self, call_id: CallId, state: str, value: Any, error: str) -> bool:
        with self._lock:
            node = self._calls.get(call_id)
            if node is None or node.state != PENDING:
                return False
            node.value = value
            node.error = error
            node.state = state
            node.event.set()
            listeners = list(self._listeners)
        for listener in listeners:
            listener(call_id, state)
        return True

    # -- listening and forcing -----------------------------------------------------------------
    def subscribe(self, listener: Listener) -> None:
        """Call ``listener(call_id, state)`` after every settle (on the settling thread)."""
        with self._lock:
            self._listeners.append(listener)

    @contextlib.contextmanager
    def nonblocking(self) -> Iterator[None]:
        """Within the block, forcing a value of this table on this thread raises an internal
        ``_WouldBlock`` instead of waiting (a receiver thread computing launch arguments must
        never wait for a result only it can deliver); such forces are not recorded in
        :attr:`forced`."""
        previous, self.nonblocking_thread = self.nonblocking_thread, threading.get_ident()
        try:
            yield
        finally:
            self.nonblocking_thread = previous

    def deps(self, x: Any) -> set[CallId]:
        """See :func:`deps`."""
        return deps(x)

