"""Resource limits of the REPL's sandboxed processes."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ReplLimits:
    """Resource limits of the sandbox.

    cpu_s: CPU time one cell may use (RLIMIT_CPU, whole seconds; exceeding it kills the
        cell and rolls it back).
    wall_s: wall-clock time one cell may take, tool calls included; also bounds the other
        commands (set/get variable, summary).
    memory_mb: address-space limit of each namespace process (RLIMIT_AS); allocations past
        it raise MemoryError inside the cell. 0 disables it.
    max_output_chars: printed output kept per cell; the rest is dropped with a note.
    recursion_limit: Python recursion limit inside the sandbox.
    start_timeout_s: how long starting or forking a worker process may take.
    jail: confine the worker processes in the OS jail (namespaces, seccomp, RLIMITs and,
        where the machine allows it, a cgroup; see interpreter/jail.py). None (default) and
        True require it: the REPL refuses to start where it cannot be built, saying why.
        False turns it off, which is unsafe for untrusted code; with None, the environment
        variable ``AGENTRT_JAIL=0`` does the same.
    disk_mb: size of the jail's private writable directory (a tmpfs, also the cwd) and the
        largest file a worker may write (RLIMIT_FSIZE, the worker's log included).
    """

    cpu_s: float = 10.0
    wall_s: float = 120.0
    memory_mb: int = 2048
    max_output_chars: int = 1_000_000
    recursion_limit: int = 1000
    start_timeout_s: float = 30.0
    jail: bool | None = None
    disk_mb: int = 64

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s", "start_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ReplLimits.{name} must be positive")
        if self.disk_mb < 1:
            raise ValueError("ReplLimits.disk_mb must be at least 1")
        if self.memory_mb < 0 or self.max_output_chars < 0:
            raise ValueError("ReplLimits.memory_mb and max_output_chars must be >= 0")
        if self.recursion_limit < 100:
            raise ValueError("ReplLimits.recursion_limit must be at least 100")
