"""A cgroup (v2) per REPL: the jail's memory and process count bounded as a whole.

Per-process limits do not add up to a bound: every process of a jail may use ``memory_mb``, and
memory the kernel holds for a process (pipe and socket buffers) is not in its address space.
Where the machine offers a delegated cgroup v2 with the ``memory`` and ``pids`` controllers,
each REPL gets a cgroup of its own below it, with ``memory.max``, ``memory.swap.max`` = 0 and
``pids.max``; the root worker moves there before it runs anything, so every process of its jail
is inside; the cgroup is killed and removed with the REPL.

The parent is the directory named by ``AGENTRT_CGROUP``, else the runtime's own cgroup; it
qualifies when it is on a cgroup v2 mount, enables ``memory`` and ``pids`` for its children
(``cgroup.subtree_control``) and is writable. A cgroup that holds processes itself cannot enable
controllers for children (except the root), so in practice this means a prepared parent: see
docs/security.md. Where none qualifies, one warning says so and per-process limits stay the only
ones.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import secrets
import time

CGROUP_ENV = "AGENTRT_CGROUP"
"""A delegated cgroup v2 directory under which each REPL gets a cgroup of its own."""
_NEEDED = {"memory", "pids"}

logger = logging.getLogger(__name__)


def _own_cgroup() -> str | None:
    """This process's cgroup v2 directory, or None (no cgroup v2 mount or membership)."""
    try:
        with open("/proc/self/cgroup") as file:
            relative = next((line.strip()[3:] for line in file if line.startswith("0::")), None)
        with open("/proc/self/mountinfo") as file:
            mounts = [line.split() for line in file]
    except OSError:
        return None
    for fields in mounts:
        separator = fields.index("-")
        if fields[separator + 1] == "cgroup2" and relative is not None:
            return os.path.join(fields[4], relative.lstrip("/"))
    return None


def parent_problem(path: str | None) -> str | None:
    """Why ``path`` cannot hold the REPLs' cgroups, or None when it can."""
    if not path:
        return "no cgroup v2 here"
    try:
        with open(os.path.join(path, "cgroup.subtree_control")) as file:
            enabled = set(file.read().split())
    except OSError as exc:
        return f"{path} is not a cgroup v2 directory ({exc.strerror})"
    missing = _NEEDED - enabled
    if missing:
        return f"{path} does not enable {' and '.join(sorted(missing))} for its children"
    if not os.access(path, os.W_OK):
        return f"{path} is not writable"
    return None


@functools.cache
def find_parent() -> tuple[str | None, str | None]:
    """(parent directory, None) where REPL cgroups can be made, else (None, why not)."""
    path = os.environ.get(CGROUP_ENV) or _own_cgroup()
    problem = parent_problem(path)
    return (path, None) if problem is None else (None, problem)


@functools.cache
def _note_once(problem: str) -> None:
    logger.warning("agentrt: no cgroup for the sandbox (%s; see %s in docs/security.md): "
                   "memory and processes are bounded per process only", problem, CGROUP_ENV)


class ReplCgroup:
    """One REPL's cgroup. :meth:`create` returns None where the machine offers none."""

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def create(cls, memory_bytes: int | None, max_processes: int) -> ReplCgroup | None:
        """Make a cgroup with these limits (``memory_bytes`` None: no memory limit)."""
        parent, problem = find_parent()
        if parent is None:
            _note_once(problem or "unknown")
            return None
        path = os.path.join(parent, f"agentrt-{os.getpid()}-{secrets.token_hex(4)}")
        try:
            os.mkdir(path)
            cgroup = cls(path)
            cgroup._write("memory.max", "max" if memory_bytes is None else str(memory_bytes))
            with contextlib.suppress(FileNotFoundError):  # no swap accounting configured
                cgroup._write("memory.swap.max", "0")
            cgroup._write("pids.max", str(max_processes))
        except OSError as exc:
            _note_once(f"cannot set up {path}: {exc.strerror}")
            with contextlib.suppress(OSError):
                os.rmdir(path)
            return None
        return cgroup

    def add(self, pid: int | None) -> bool:
        """Move process ``pid`` (and so the children it starts later) into the cgroup."""
        if pid is None:
            return False
        try:
            self._write("cgroup.procs", str(pid))
        except OSError as exc:
            _note_once(f"cannot move the sandbox into {self.path}: {exc.strerror}")
            return False
        return True

    def remove(self) -> None:
        """Kill whatever is left in the cgroup and remove it."""
        with contextlib.suppress(OSError):
            self._write("cgroup.kill", "1")
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.02)  # its last processes are still exiting
        logger.warning("agentrt: could not remove cgroup %s", self.path)

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as file:
            file.write(value)
