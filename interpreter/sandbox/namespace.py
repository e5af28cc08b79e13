"""`Sandbox`: one persistent restricted namespace, and the cells run in it."""

from __future__ import annotations

import keyword
import re
import reprlib
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..protocol import NotPlainDataError, to_plain
from .cell_builtins import make_builtins
from .modules import ALLOWED_MODULES, SandboxModule, module_facade
from .output import OutputBuffer, SandboxContext
from .policy import MISSING, SANDBOX_MODULE_NAME, SandboxSyntaxError, compile_cell

MAX_TRACEBACK_FRAMES = 8
MAX_ERROR_MESSAGE_CHARS = 2000


@dataclass
class CellOutcome:
    """What one cell produced, as plain data."""

    stdout: str
    error: str | None = None
    error_type: str | None = None
    final: dict[str, Any] | None = None

    def to_message(self) -> dict[str, Any]:
        """Plain-data form sent to the runtime."""
        return {"stdout": self.stdout, "error": self.error, "error_type": self.error_type,
                "final": self.final}


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


class _ShortRepr(reprlib.Repr):
    """Bounded lengths and depth for :func:`short_repr`."""

    def __init__(self) -> None:
        super().__init__()
        self.maxstring = self.maxother = 80
        self.maxlist = self.maxtuple = self.maxset = self.maxdict = 6
        self.maxlevel = 3


def type_name(value: Any) -> str:
    """The name of ``value``'s type as the sandbox presents it."""
    return "module" if isinstance(value, SandboxModule) else type(value).__name__


def short_repr(value: Any) -> str:
    """A bounded repr with memory addresses removed (stable across processes)."""
    try:
        text = _ShortRepr().repr(value)
    except Exception:
        text = f"<{type(value).__name__} object>"
    return _ADDRESS.sub("", text)


class Sandbox:
    """One persistent restricted namespace; runs cells in it."""

    def __init__(self, *, max_output_chars: int = 1_000_000) -> None:
        # Stdlib helpers such as dataclasses look up a class's module in sys.modules; give
        # them an empty placeholder (the namespace itself is never registered there).
        sys.modules.setdefault(SANDBOX_MODULE_NAME, types.ModuleType(SANDBOX_MODULE_NAME))
        self._max_output_chars = max_output_chars
        self.namespace: dict[str, Any] = {"__name__": SANDBOX_MODULE_NAME}
        self.context = SandboxContext(self.namespace)
        """What this sandbox's builtins and module facades share (output.py)."""
        self._builtins = make_builtins(self.context)
        for name, helper in {"FINAL": self._final_answer, "FINAL_VAR": self._final_variable,
                             "SHOW_VARS": self._show_variables, "help": self._help}.items():
            self.install_builtin(name, helper)
        self.namespace["__builtins__"] = self._builtins
        self._tools: dict[str, tuple[str, Any]] = {}
        self.compiler: Callable[[str, str], types.CodeType] = compile_cell
        """Turns (source, filename) into code; raises SandboxSyntaxError. Replaceable."""
        self._sources: dict[str, list[str]] = {}
        self._cells_run = 0
        self._final: dict[str, Any] | None = None

    # -- extension points ----------------------------------------------------
    def install_builtin(self, name: str, value: Any) -> None:
        """Add or replace a builtin visible to cells (guards such as ``_getattr_`` too); one a
        cell can name is admitted first (a Python function is held as a SandboxFunction)."""
        admit = self.context.admission.admit
        self._builtins[name] = value if name.startswith("_") else admit(value)

    def builtin(self, name: str) -> Any:
        """The current builtin ``name`` (KeyError if there is none)."""
        return self._builtins[name]

    def install_tool(self, name: str, signature: str, proxy: Callable[..., Any]) -> None:
        """Expose ``proxy`` as builtin ``name``; ``signature`` is shown by ``help()``."""
        self.install_builtin(name, proxy)
        self._tools[name] = (signature, self._builtins[name])

    def tool_names(self) -> list[str]:
        """Names of the installed tools."""
        return list(self._tools)

    def module_facade(self, name: str) -> SandboxModule:
        """What ``import name`` gives a cell of this sandbox (ImportError if not allowed)."""
        return module_facade(self.context, name)

    # -- running -------------------------------------------------------------
    def execute(self, source: str, name: str = "cell") -> CellOutcome:
        """Run ``source`` in the namespace; errors become part of the outcome."""
        self._cells_run += 1
        filename = f"<{name}#{self._cells_run}>"
        self._final = None
        error = error_type = None
        with self.context.running(OutputBuffer(self._max_output_chars)) as output:
            try:
                code = self.compiler(source, filename)
                self._sources[filename] = source.splitlines()
                exec(code, self.namespace)
            except SandboxSyntaxError as exc:
                error, error_type = f"SyntaxError: {exc}", "SyntaxError"
            except BaseException as exc:  # the cell's own errors, including SystemExit
                error, error_type = self._describe(exc), type(exc).__name__
        return CellOutcome(output.getvalue(), error, error_type, self._final)

    def _describe(self, exc: BaseException) -> str:
        try:
            message = str(exc)
        except Exception:
            message = "<unprintable message>"
        if len(message) > MAX_ERROR_MESSAGE_CHARS:
            message = message[:MAX_ERROR_MESSAGE_CHARS] + "..."
        lines = [f"{type(exc).__name__}: {message}" if message else type(exc).__name__]
        frames = []
        tb = exc.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            if code.co_filename in self._sources:
                frames.append((code.co_filename, tb.tb_lineno, code.co_name))
            tb = tb.tb_next
        if frames:
            lines.append("Traceback (most recent call last):")
            if len(frames) > MAX_TRACEBACK_FRAMES:
                lines.append(f"  ... {len(frames) - MAX_TRACEBACK_FRAMES} earlier frames omitted")
                frames = frames[-MAX_TRACEBACK_FRAMES:]
            for filename, lineno, function in frames:
                lines.append(f'  File "{filename}", line {lineno}, in {function}')
                source = self._sources[filename]
                if 0 < lineno <= len(source) and source[lineno - 1].strip():
                    lines.append(f"    {source[lineno - 1].strip()}")
        return "\n".join(lines)

    # -- variables -------------------------------------------------------------
    def set_variable(self, name: str, value: Any) -> None:
        """Bind ``name`` in the namespace."""
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) \
                or name.startswith("_"):
            raise ValueError(f"invalid variable name: {name!r}")
        self.namespace[name] = value

    def get_variable(self, name: str) -> Any:
        """The variable's value as plain data (KeyError if unbound, TypeError if not plain)."""
        if not isinstance(name, str) or name.startswith("_") or name not in self.namespace:
            raise KeyError(name)
        return to_plain(self.namespace[name])

    def variables(self) -> dict[str, Any]:
        """The user-visible variables (names not starting with ``_``)."""
        return {k: v for k, v in self.namespace.items() if not k.startswith("_")}

    def summary(self) -> dict[str, list[str]]:
        """``{name: [type name, short repr]}`` for every user-visible variable."""
        return {name: [type_name(value), short_repr(value)]
                for name, value in self.variables().items()}

    # -- helpers visible in the sandbox ---------------------------------------
    def _final_answer(self, answer: Any) -> None:
        """FINAL(answer): record the final answer of the run."""
        self._final = self._final_record(answer, None)

    def _final_variable(self, name: Any) -> None:
        """FINAL_VAR("name"): record the value of variable ``name`` as the final answer."""
        if not isinstance(name, str):
            raise TypeError("FINAL_VAR expects the variable's name as a string, "
                            "e.g. FINAL_VAR('answer')")
        name = "".join([name]).strip()  # a plain str: a subclass's own strip() is not called
        if name.startswith("_") or name not in self.namespace:
            raise NameError(f"FINAL_VAR: no variable named {name!r}")
        self._final = self._final_record(self.namespace[name], name)

    def _final_record(self, value: Any, variable: str | None) -> dict[str, Any]:
        try:
            return {"value": to_plain(value), "is_repr": False, "variable": variable}
        except (NotPlainDataError, RecursionError):
            text = repr(value)
            if len(text) > self._max_output_chars:
                text = text[:self._max_output_chars] + "..."
            return {"value": text, "is_repr": True, "variable": variable}

    def _show_variables(self) -> None:
        """SHOW_VARS(): print the variables defined so far with their types."""
        variables = self.variables()
        if not variables:
            self.context.write("No variables defined yet.\n")
            return
        listing = ", ".join(f"{name} ({type_name(value)})" for name, value in variables.items())
        self.context.write(f"Variables: {listing}\n")

    def _help(self, obj: Any = MISSING) -> None:
        """help(): list the tools and helpers; help(tool) shows that tool's signature."""
        write = self.context.write
        for name, (signature, proxy) in self._tools.items():
            if obj is proxy or obj == name:
                write(f"{signature}\n")
                return
        if obj is not MISSING:
            doc = getattr(obj, "__doc__", None)
            if not isinstance(doc, str) or not doc.strip():
                doc = "no help available"
            write(f"{short_repr(obj)}: {doc.strip().split(chr(10) * 2)[0]}\n")
            return
        lines = ["Tools:"] + [f"  {signature}" for signature, _ in self._tools.values()]
        if not self._tools:
            lines.append("  (none)")
        lines += ["Helpers:", "  FINAL(answer)  FINAL_VAR('name')  SHOW_VARS()  help(tool)",
                  "Modules: " + ", ".join(sorted(ALLOWED_MODULES))]
        write("\n".join(lines) + "\n")
