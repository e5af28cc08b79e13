"""Restricted execution of model-written Python inside a worker process: the first wall.

The pieces, in the order code meets them:

* ``policy`` -- :func:`compile_cell` compiles a cell with RestrictedPython (every attribute
  read, subscript and write goes through a guard; names starting with ``_`` are refused),
  then ``doors`` rewrites every other way a value reaches a name to pass admission;
* ``admission`` -- the one check on what a cell may hold (an allow-list by identity), and
  ``guards``, ``provenance`` (what the sandbox made) and ``classes`` (the one class path);
* ``cell_builtins`` -- the only builtins a cell sees: a curated safe set, guarded
  ``getattr``/``setattr``/``type``/``dir``, the restricted ``__import__`` and the hooks the
  compiled code calls;
* ``surface`` and ``modules`` -- what ``import`` gives: read-only facades of
  :data:`ALLOWED_MODULES` with vetted replacements of the functions that evaluate strings or
  generate code (``copying`` is the sandbox's own ``copy``);
* ``output`` -- the running cell: its capped output and the :class:`SandboxContext` the
  builtins and facades of one sandbox share (no module globals);
* ``namespace`` -- :class:`Sandbox`, one persistent namespace, which runs cells and records
  ``FINAL`` / ``FINAL_VAR`` answers.

The worker process around it adds CPU, memory and wall-clock limits, a fork per cell, and the
OS jail (jail.py) that holds when this layer is bypassed (see docs/sandbox.md).
"""

from agentrt.tools.errors import ToolError

from .modules import ALLOWED_MODULES, SandboxModule
from .namespace import CellOutcome, Sandbox, short_repr, type_name
from .output import OutputBuffer, SandboxContext
from .policy import SANDBOX_MODULE_NAME, SandboxPolicy, SandboxSyntaxError, compile_cell

__all__ = [
    "ALLOWED_MODULES", "CellOutcome", "OutputBuffer", "SANDBOX_MODULE_NAME", "Sandbox",
    "SandboxContext", "SandboxModule", "SandboxPolicy", "SandboxSyntaxError", "ToolError",
    "compile_cell", "short_repr", "type_name",
]
