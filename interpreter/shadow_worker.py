"""The worker side of a shadow run: speculative execution in a forked copy of the namespace.

The runtime forks the namespace holder and sends ``shadow`` with the code to speculate on (the
unexecuted blocks of the response so far, the open tail repaired). This process then:

* turns the sandbox into shadow mode — code compiled with the lazy-deferring transform, RestrictedPython
  guards that defer or force lazies, ``print`` / ``FINAL`` silent;
* makes every speculatable tool a *launching* proxy: the call is sent as ``launch`` (at once, or
  as soon as its lazy arguments resolve) and returns a `Lazy`; other tools return a poisoned
  lazy (they never run early, and whatever needs their result is abandoned);
* runs the code statement by statement: a statement that fails or is abandoned poisons the
  names it assigns and the run goes on with the next one;
* reports ``shadow_done``, then stays alive so that pipelined launches still go out when their
  inputs arrive, until the runtime kills it.

A reader thread receives ``early_result`` / ``early_fail`` / ``early_poison`` for the launched
calls and settles them in the `LazyTable`.
"""

from __future__ import annotations

import ast
import sys
import threading
from typing import Any

from . import sandbox as sandbox_module
from .lazy import LazyTable, PendingLaunches, lazy_aware_guards, shadow_helpers
from .protocol import NotPlainDataError, to_plain
from .shadow_transform import compile_shadow

SHADOW_FILENAME = "<shadow>"


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

    def __init__(self, process: Any, message: dict[str, Any]) -> None:
        self.process = process
        self.sandbox = process._sandbox
        self.speculatable = set(message.get("speculatable", ()))
        self.table = LazyTable(force_timeout=message.get("force_timeout"))
        self.launches = PendingLaunches(self.table, self._send_launch)
        self._send_lock = threading.Lock()
        self._launch_info: dict[Any, tuple[int | None, list[Any]]] = {}
        self._next_id = 0

    # -- messages ------------------------------------------------------------------------------
    def send(self, message: dict[str, Any]) -> None:
        with self._send_lock:
            self.process.send(message)

    def _send_launch(self, call_id: Any, tool: str, args: tuple, kwargs: dict) -> None:
        lineno, deps = self._launch_info.pop(call_id, (None, []))
        try:
            plain_args, plain_kwargs = to_plain(tuple(args)), to_plain(dict(kwargs))
        except NotPlainDataError:
            self.table.poison(call_id, "arguments are not plain data")
            return
        self.send({"op": "launch", "call": call_id, "name": tool, "args": plain_args,
                   "kwargs": plain_kwargs, "lineno": lineno, "deps": deps})

    def _receive_loop(self) -> None:
        while True:
            message = self.process._receive()  # exits the process when the runtime is gone
            op = message.get("op")
            call = message.get("call")
            if op == "early_result":
                self.table.resolve(call, message.get("value"))
            elif op == "early_fail":
                self.table.fail(call, str(message.get("message", "")))
            elif op == "early_poison":
                self.table.poison(call, str(message.get("message", "not launched")))
            elif op == "exit":
                import os

                os._exit(0)

    # -- proxies ---------------------------------------------------------------------------------
    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _launching_proxy(self, name: str) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            call_id = self._new_id()
            deps = set(self.table.forced) | self.table.deps((args, kwargs))
            self._launch_info[call_id] = (_caller_line(), sorted(deps))
            return self.launches.launch(name, args, kwargs, call_id=call_id)

        launch.__name__ = launch.__qualname__ = name
        return launch

    def _poisoned_proxy(self, name: str) -> Any:
        def refuse(*args: Any, **kwargs: Any) -> Any:
            call_id = self._new_id()
            lazy = self.table.new_call(call_id)
            self.table.poison(call_id, f"{name} is not speculatable")
            return lazy

        refuse.__name__ = refuse.__qualname__ = name
        return refuse

    def _enter_shadow_mode(self) -> None:
        builtins = self.sandbox._builtins
        builtins.update(lazy_aware_guards(builtins))
        builtins.update(shadow_helpers())
        builtins.update({
            "_print_": lambda _getattr=None: _SILENT,
            "FINAL": _noop, "FINAL_VAR": _noop, "SHOW_VARS": _noop, "help": _noop,
        })
        for name in self.sandbox.tool_names():
            signature = self.sandbox._tools[name][0]
            proxy = (self._launching_proxy(name) if name in self.speculatable
                     else self._poisoned_proxy(name))
            self.sandbox.install_tool(name, signature, proxy)
        sandbox_module._current_output = None
        sandbox_module._active_sandbox = self.sandbox

    # -- running ---------------------------------------------------------------------------------
    def run(self, code: str) -> None:
        threading.Thread(target=self._receive_loop, daemon=True).start()
        self._enter_shadow_mode()
        executed = abandoned = 0
        try:
            tree = ast.parse(code)
        except SyntaxError:
            tree = ast.Module(body=[], type_ignores=[])
        namespace = self.sandbox.namespace
        for stmt in tree.body:
            module = ast.Module(body=[stmt], type_ignores=[])
            result = compile_shadow(module, SHADOW_FILENAME, policy=sandbox_module.SandboxPolicy)
            if result.code is None:
                abandoned += 1
                continue
            try:
                exec(result.code, namespace)
                executed += 1
            except BaseException:  # Abandoned included: the shadow goes on
                abandoned += 1
                for name in assigned_names(stmt):
                    namespace.pop(name, None)
        self.send({"op": "shadow_done", "executed": executed, "abandoned": abandoned,
                   "pending": self.launches.pending_count()})
        threading.Event().wait()  # keep serving pipelined launches until killed


def _caller_line() -> int | None:
    """Line number of the shadow code that called a tool proxy."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename == SHADOW_FILENAME:
            return frame.f_lineno
        frame = frame.f_back
    return None


def run_shadow(process: Any, message: dict[str, Any]) -> None:
    """Entry point from the worker's ``shadow`` command; never returns."""
    ShadowRun(process, message).run(str(message.get("code", "")))
