"""Lazy values for the shadow interpreter.

In the shadow run a call to a speculatable tool does not block: it is *launched* and returns a
:class:`Lazy` that stands for the result. A ``Lazy`` wraps a node:

* a **call node**, whose value arrives from outside (:meth:`LazyTable.resolve`), or never does
  (:meth:`LazyTable.fail`, :meth:`LazyTable.poison`);
* a **deferred node**: a function applied to arguments of which some are ``Lazy`` (also nested in
  lists, tuples, dicts, sets and slices). It is computed, once, when it is first forced.

Operations that can wait (arithmetic, comparisons, indexing, attribute access, method calls)
return new deferred ``Lazy`` values, so ``score(x) % 2`` does not block. Operations that must
produce a concrete answer now (truth tests, iteration, ``len``, ``str``, hashing, ``isinstance``)
*force* the value: the calling thread blocks until the call results it depends on arrive.
Forcing a value that can never arrive raises :class:`Abandoned`, a ``BaseException`` that model
code's ``except Exception`` does not swallow; the shadow then abandons the statement.

:class:`PendingLaunches` turns "launch tool T with these (possibly lazy) arguments" into a
``Lazy`` immediately, and hands the launch to a callback as soon as all arguments are known
(pipelining). The ``_lz_*_`` helpers at the end are what :mod:`.shadow_transform` rewrites
f-strings, operators, comparisons and a few pure calls into; :func:`shadow_helpers` returns them
for injection into the shadow namespace, and :func:`lazy_aware_guards` adapts RestrictedPython's
``_getattr_`` / ``_getitem_`` / ... guards so they defer or force instead of misbehaving.

The code lives in three modules by topic: :mod:`.lazy_values` (the values, their nodes and
forcing, the :class:`LazyTable`), :mod:`.lazy_launches` (:class:`PendingLaunches`) and
:mod:`.lazy_helpers` (the ``_lz_*_`` helpers and the lazy-aware guards). This module is their
public face.
"""

from __future__ import annotations

from .lazy_helpers import (
    PURE_METHOD_NAMES,
    lazy_aware_guards,
    shadow_helpers,
)
from .lazy_launches import PendingLaunches
from .lazy_values import (
    Abandoned,
    Lazy,
    LazyTable,
    deps,
    describe,
    force,
    force_deep,
    is_lazy,
    ready,
)

__all__ = [
    "PURE_METHOD_NAMES",
    "Abandoned",
    "Lazy",
    "LazyTable",
    "PendingLaunches",
    "deps",
    "describe",
    "force",
    "force_deep",
    "is_lazy",
    "lazy_aware_guards",
    "ready",
    "shadow_helpers",
]
