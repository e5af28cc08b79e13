"""The worker side of a shadow run: speculative execution in a forked copy of the namespace.

The runtime forks the namespace holder and sends it a `Shadow` frame with the code to speculate on (the
unexecuted blocks of the response so far, the open tail repaired). This process then:

* turns the sandbox into shadow mode — code compiled with the lazy-deferring transform, RestrictedPython
  guards that defer or force lazies, ``print`` / ``FINAL`` silent;
* routes every tool call through one dispatcher, whatever name or object the code reaches the
  tool by: the installed tool names, and also the tool proxies the forked namespace still holds
  (aliases, default arguments, closures, containers, names rebound in earlier cells) — their
  tool channel is redirected here, so a shadow never sends a real tool call. The tool's own
  policy decides: a speculatable call is sent as a `Launch` (at once, or as soon as its lazy
  arguments resolve) and returns a `Lazy`; an effectful call is never run here: it returns a
  poisoned `Lazy` and, from then on, the scopes it writes are *pending*. A speculatable call
  that reads a pending scope is not launched either (the effect barrier: a read never
  overtakes a write it may observe; pure tools and reads of other scopes go out);
* runs the code statement by statement: a statement that is abandoned (it needed a value that
  will not arrive) poisons the names it assigns and the run goes on with the next one; a
  statement that raises an ordinary exception ends its block, as it ends the cell in the real
  run; ``FINAL`` / ``FINAL_VAR`` end the run after the current block (later blocks never run);
* reports `ShadowDone`, then stays alive so that pipelined launches still go out when their
  inputs arrive, until the runtime kills it.

A reader thread receives `EarlyResult` / `EarlyFailed` / `EarlyPoisoned` for the launched calls
and settles them in the `LazyTable`; any other frame stops the process (the runtime kills a
shadow with ``Exit`` or a signal).
"""

from __future__ import annotations

import ast
import os
import sys
import threading
from typing import Any

from agentrt.tools.scopes import ALL_SCOPES, overlaps

from .arg_limits import check_arguments
from .frames import (
    EXIT_PROTOCOL,
    EarlyFailed,
    EarlyPoisoned,
    EarlyResult,
    Exit,
    Launch,
    Shadow,
    ShadowDone,
    WorkerFrame,
)
from .lazy import (
    Abandoned,
    Lazy,
    LazyTable,
    PendingLaunches,
    lazy_aware_guards,
    shadow_helpers,
)
from .protocol import NotPlainDataError, to_plain
from .sandbox import SandboxPolicy
from .shadow_transform import compile_shadow

SHADOW_FILENAME = "<shadow>"
MAX_SHADOW_EFFECTS = 256
"""Effectful calls one shadow run passes (without running them); at the next it stops
launching (a runaway loop of effects, whose update has not streamed yet)."""


class _SilentPrinter:
    """``print`` in the shadow: prints nothing and forces nothing."""

    __slots__ = ()

    def _call_print(self, *objects: Any, **kwargs: Any) -> None:
        return None

    def __call__(self) -> str:
        return ""


_SILENT = _SilentPrinter()


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


class ShadowStopped(Abandoned):
    """The shadow stopped launching (it passed `MAX_SHADOW_EFFECTS` effectful calls), or a
    forked tool proxy tried to start a real tool call (never allowed in a shadow)."""


def assigned_names(stmt: ast.stmt) -> set[str]:
    """Names a top-level statement may bind (targets, loop variables, defs, imports)."""
    names: set[str] = set()
    for node in ast.walk(stmt):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            names.add(node.name)
    return names


class ShadowRun:
    """One shadow run inside a forked worker process."""

    def __init__(self, process: Any, frame: Shadow) -> None:
        self.process = process
        self.sandbox = process.sandbox
        self.speculatable = frozenset(frame.speculatable)
        self.reads = {name: frozenset(scopes) for name, scopes in frame.reads}
        self.writes = {name: frozenset(scopes) for name, scopes in frame.writes}
        self.pending_writes: frozenset[str] = frozenset()
        """Scopes written by the effectful calls this run passed (they have not run yet)."""
        self.effects = 0
        self.table = LazyTable()
        self.launches = PendingLaunches(self.table, self._send_launch)
        self._send_lock = threading.Lock()
        self._launch_info: dict[Any, tuple[int | None, list[Any]]] = {}
        self._next_id = 0
        self.stopped = False
        """Past `MAX_SHADOW_EFFECTS`: nothing more is launched in this run."""
        self.final_called = False

    # -- messages ------------------------------------------------------------------------------
    def send(self, frame: WorkerFrame) -> None:
        with self._send_lock:
            self.process.send(frame)

    def _send_launch(self, call_id: Any, tool: str, args: tuple, kwargs: dict) -> None:
        lineno, deps = self._launch_info.pop(call_id, (None, []))
        try:
            plain_args, plain_kwargs = to_plain(tuple(args)), to_plain(dict(kwargs))
        except NotPlainDataError:
            self.table.poison(call_id, "arguments are not plain data")
            return
        self.send(Launch(call_id, tool, plain_args, plain_kwargs, lineno, tuple(deps)))

    def _receive_loop(self) -> None:
        while True:
            frame = self.process.receive()  # exits the process when the runtime is gone
            if isinstance(frame, EarlyResult):
                self.table.resolve(frame.call, frame.value)
            elif isinstance(frame, EarlyFailed):
                self.table.fail(frame.call, frame.message)
            elif isinstance(frame, EarlyPoisoned):
                self.table.poison(frame.call, frame.message)
            else:
                if not isinstance(frame, Exit):
                    print(f"shadow: unexpected frame {frame.op!r}", file=sys.stderr, flush=True)
                os._exit(0 if isinstance(frame, Exit) else EXIT_PROTOCOL)

    # -- proxies ---------------------------------------------------------------------------------
    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def dispatch(self, name: str, args: tuple, kwargs: dict) -> Any:
        """Every tool call of the shadow comes here, with the tool's real name."""
        if self.stopped:
            raise ShadowStopped("the shadow passed too many effectful calls")
        if name not in self.speculatable:
            if self.effects == MAX_SHADOW_EFFECTS:
                self.stopped = True
                raise ShadowStopped(f"more than {MAX_SHADOW_EFFECTS} effectful calls")
            self.effects += 1
            self.pending_writes |= self.writes.get(name, ALL_SCOPES)
            return self._not_launched(f"{name} has effects: it runs only in the real run")
        if overlaps(self.reads.get(name, ALL_SCOPES), self.pending_writes):
            return self._not_launched(f"{name} reads what an earlier effectful call writes")
        check_arguments(name, args, kwargs)  # too big: the same ToolError as in the real run
        call_id = self._new_id()
        deps = set(self.table.forced) | self.table.deps((args, kwargs))
        self._launch_info[call_id] = (_caller_line(), sorted(deps))
        return self.launches.request(name, args, kwargs, call_id=call_id)

    def _not_launched(self, reason: str) -> Any:
        """A call that never runs in the shadow: a poisoned `Lazy` (forcing it abandons)."""
        call_id = self._new_id()
        lazy = self.table.new_call(call_id)
        self.table.poison(call_id, reason)
        return lazy

    def _proxy(self, name: str) -> Any:
        def call_tool(*args: Any, **kwargs: Any) -> Any:
            return self.dispatch(name, args, kwargs)

        call_tool.__name__ = call_tool.__qualname__ = name
        return call_tool

    def _redirect_channel(self, channel: Any) -> None:
        """The forked namespace's own tool proxies call ``channel``: answer them here."""

        def call(name: str, args: tuple, kwargs: dict) -> Any:
            return self.dispatch(name, tuple(args), dict(kwargs))

        def refuse(*args: Any, **kwargs: Any) -> Any:
            raise ShadowStopped("a shadow never starts a real tool call")

        channel.call = call
        channel.start_call = refuse
        channel.wait = refuse

    def _final(self, *args: Any, **kwargs: Any) -> None:
        self.final_called = True

    def _enter_shadow_mode(self) -> None:
        sandbox = self.sandbox
        admission = sandbox.context.admission
        admission.hold(Lazy)  # lazy values are the shadow's own placeholders
        for signal in (Abandoned, ShadowStopped):  # ``except BaseException as e: raise e``
            admission.hold(signal)  # re-raises the shadow's own signal, not a stand-in
        guards = sandbox.context.guards
        self.table.admit = admission.admit_deep
        self.table.getattr, self.table.write = guards.getattr, guards.write
        guards = lazy_aware_guards({name: sandbox.builtin(name) for name in _GUARD_NAMES
                                    if _has_builtin(sandbox, name)})
        for name, value in {**guards, **shadow_helpers()}.items():
            sandbox.install_builtin(name, value)
        if "_getattr_" in guards:  # getattr(lazy, name) defers through the same guard
            sandbox.install_builtin("getattr", guards["_getattr_"])
        for name, value in {"_print_": lambda _getattr=None: _SILENT, "FINAL": self._final,
                            "FINAL_VAR": self._final, "SHOW_VARS": _noop,
                            "help": _noop}.items():
            sandbox.install_builtin(name, value)
        for name in sandbox.tool_names():
            sandbox.install_builtin(name, self._proxy(name))
        self._redirect_channel(self.process.channel)

    # -- running ---------------------------------------------------------------------------------
    def _compile_blocks(self, statements: tuple[tuple[int, int, str], ...]
                        ) -> list[tuple[int, ast.Module, Any]]:
        """(block, tree, code) of each statement; a block with a statement that does not
        compile is left out entirely (the real cell would not run any of it)."""
        compiled: list[tuple[int, ast.Module, Any]] = []
        broken: set[int] = set()
        for block, first_line, source in statements:
            try:
                tree = ast.parse(str(source))
            except SyntaxError:
                broken.add(block)
                continue
            ast.increment_lineno(tree, int(first_line) - 1)
            result = compile_shadow(tree, SHADOW_FILENAME, policy=SandboxPolicy)
            if result.code is None:
                broken.add(block)
                continue
            compiled.append((int(block), ast.parse(str(source)), result.code))
        return [item for item in compiled if item[0] not in broken]

    def run(self, statements: tuple[tuple[int, int, str], ...]) -> None:
        """Run the statements the runtime sent: ``(block, first line, source)`` each, in order."""
        threading.Thread(target=self._receive_loop, daemon=True).start()
        self._enter_shadow_mode()
        executed = abandoned = 0
        namespace = self.sandbox.namespace
        skip_block: int | None = None
        final_block: int | None = None
        faithful = True  # no statement abandoned yet: the state is the real run's
        for block, tree, code in self._compile_blocks(statements):
            if final_block is not None and block > final_block:
                break  # FINAL was called: the real run executes no later block
            if block == skip_block:
                continue
            try:
                exec(code, namespace)
                executed += 1
            except Abandoned:
                abandoned += 1
                faithful = False
                _forget(namespace, tree)
            except BaseException:  # the real cell stops here too (when the state is faithful)
                abandoned += 1
                _forget(namespace, tree)
                if faithful:
                    skip_block = block
            if self.final_called and final_block is None:
                final_block = block
            if self.stopped:
                break
        self.send(ShadowDone(executed, abandoned, self.launches.pending_count(), self.effects))
        threading.Event().wait()  # keep serving pipelined launches until killed


def _forget(namespace: dict[str, Any], tree: ast.Module) -> None:
    """Unbind what a failed or abandoned statement may have bound."""
    for stmt in tree.body:
        for name in assigned_names(stmt):
            namespace.pop(name, None)


_GUARD_NAMES = ("_getattr_", "_getitem_", "_inplacevar_", "_write_", "_getiter_",
                "_iter_unpack_sequence_", "_unpack_sequence_")


def _has_builtin(sandbox: Any, name: str) -> bool:
    try:
        sandbox.builtin(name)
    except KeyError:
        return False
    return True


def _caller_line() -> int | None:
    """Line number of the shadow code that called a tool proxy."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename == SHADOW_FILENAME:
            return frame.f_lineno
        frame = frame.f_back
    return None


def run_shadow(process: Any, frame: Shadow) -> None:
    """Entry point from the worker's `Shadow` frame; never returns."""
    ShadowRun(process, frame).run(frame.statements)
