"""Warm workers: root worker processes started ahead of use, so that a REPL's start does not
wait for Python to start and load the worker.

A :class:`StartedWorker` is a root worker process (in the jail, where the REPL's jail plan says
so) started in a directory of its own; once loaded it says so and waits for the hello token of
the REPL that takes it (worker.py). :func:`start_worker` starts one. A :class:`WorkerPool`
keeps a few of them ready per :class:`WorkerSpec` for whoever reserved them
(:meth:`WorkerPool.reserve`), refilling in a background thread, one start at a time and at
most ``max_workers`` idle at once. A worker serves one REPL: the REPL that takes one owns it
(and its directory) until it closes, and the pool starts a fresh one in its place; a worker
that died while idle is discarded, never handed out.

:func:`shared_pool` is the process-wide pool (`Agent` uses it; closed at interpreter exit).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

from .. import jail
from . import process_tree
from .limits import ReplLimits

WORKER_MODULE = "agentrt.interpreter.worker"
SOCKET_NAME = "repl.sock"
MAX_WARM_WORKERS = 4
"""Idle warm workers a pool holds at most (all specs together)."""
CHECK_INTERVAL_S = 0.5
"""How often the pool's thread looks for idle workers that died."""
EXIT_GRACE_S = 1.0
"""How long a worker let go (end of its input) may take to exit before it is killed."""


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """How a root worker is started: in the jail's namespaces or not, the size of the jail's
    private directory, and its ``PYTHONPATH`` (where a REPL's extensions are imported from)."""

    namespaces: bool
    disk_mb: int
    pythonpath: str = ""

    @classmethod
    def of(cls, plan: jail.JailPlan, limits: ReplLimits) -> WorkerSpec:
        """The spec of the root worker for ``limits`` under jail plan ``plan``, with this
        process's ``PYTHONPATH`` now (a worker started before it changed is not taken)."""
        return cls(plan.namespaces, limits.disk_mb if plan.namespaces else 0,
                   os.environ.get("PYTHONPATH", ""))

    @classmethod
    def for_limits(cls, limits: ReplLimits) -> WorkerSpec:
        """The spec for ``limits`` (plans the jail: blocking, and `jail.JailUnavailable` where
        it cannot be built)."""
        return cls.of(jail.plan_jail(limits.jail), limits)


class StartedWorker:
    """A root worker process started in ``directory`` (``work/`` its working directory,
    ``sock/`` the folder of the REPL's socket, ``worker.log`` its stderr), waiting for the
    hello token of the REPL it is to serve."""

    def __init__(self, spec: WorkerSpec, directory: Path, process: subprocess.Popen) -> None:
        self.spec = spec
        self.directory = directory
        self.process = process
        self._pidfd = os.pidfd_open(process.pid)
        self._loaded = False
        os.set_blocking(process.stdout.fileno(), False)

    @property
    def pid(self) -> int:
        """The process's pid (bubblewrap's, in the jail)."""
        return self.process.pid

    @property
    def socket_path(self) -> str:
        """Where the worker connects once it has its token."""
        return socket_path(self.directory)

    @property
    def log(self) -> Path:
        """The worker's stderr."""
        return self.directory / "worker.log"

    @property
    def returncode(self) -> int | None:
        """The exit status once the process has ended (reaped), else None."""
        return self.process.poll()

    @property
    def loaded(self) -> bool:
        """Whether the worker has said it is loaded (it may have died since)."""
        if not self._loaded:
            with contextlib.suppress(BlockingIOError, OSError, ValueError):
                self._loaded = bool(os.read(self.process.stdout.fileno(), 64))
        return self._loaded

    def alive(self) -> bool:
        """Whether the process is running."""
        return self.process.poll() is None

    def hand_token(self, token: str) -> None:
        """Tell the worker its hello token: it connects to the socket with it."""
        with contextlib.suppress(OSError, ValueError):  # it died: its REPL sees it not start
            self.process.stdin.write(token.encode("ascii") + b"\n")
            self.process.stdin.flush()
        self._close_pipes()

    async def wait(self) -> int:
        """Wait, without blocking the event loop, until the process ends; its exit status."""
        if self.process.poll() is None:
            watched = os.dup(self._pidfd)  # one registration per waiter
            try:
                await process_tree.exited(watched)
            finally:
                os.close(watched)
        return self.process.wait()

    def let_go(self) -> None:
        """End the worker's input: a worker that has no token yet exits."""
        self._close_pipes()

    def discard(self) -> None:
        """Stop the worker (it is let go, then killed if still running after
        :data:`EXIT_GRACE_S`) and remove its directory. Blocking."""
        self.let_go()
        try:
            self.process.wait(EXIT_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.release()
        shutil.rmtree(self.directory, ignore_errors=True)

    def release(self) -> None:
        """Close what the runtime holds of the process (pipes, pidfd); it is not stopped."""
        self._close_pipes()
        pidfd, self._pidfd = self._pidfd, -1
        if pidfd >= 0:
            with contextlib.suppress(OSError):
                os.close(pidfd)

    def _close_pipes(self) -> None:
        for pipe in (self.process.stdin, self.process.stdout):
            with contextlib.suppress(OSError):
                pipe.close()


def worker_directory() -> Path:
    """A new private directory for a root worker (``work/`` and ``sock/`` inside)."""
    directory = Path(tempfile.mkdtemp(prefix="agentrt-repl-"))
    (directory / "work").mkdir()
    (directory / "sock").mkdir(mode=0o700)
    return directory


def socket_path(directory: Path) -> str:
    """The path of the REPL's socket in worker directory ``directory``."""
    return str(directory / "sock" / SOCKET_NAME)


def start_worker(spec: WorkerSpec, directory: Path | None = None) -> StartedWorker:
    """Start a root worker in ``directory`` (default: a new one). Blocking (a fork and an exec).

    In the jail the worker dies with the *thread* that started it (bubblewrap's
    ``--die-with-parent``): call this from a thread that outlives the worker."""
    directory = directory or worker_directory()
    command = [sys.executable, "-m", WORKER_MODULE, socket_path(directory)]
    env = {"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8",
           "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONSAFEPATH": "1"}
    if spec.pythonpath:
        env["PYTHONPATH"] = spec.pythonpath
    if spec.namespaces:  # the worker gets an empty environment plus these
        del env["PATH"]
        command = jail.bwrap_command(str(directory / "sock"), env, spec.disk_mb) + command
        env = {}
    with open(directory / "worker.log", "ab") as log:
        process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
            cwd=directory / "work", env=env, start_new_session=True)
    return StartedWorker(spec, directory, process)


class PoolLease:
    """A reservation of warm workers in a pool (see :meth:`WorkerPool.reserve`); release it
    when they are no longer wanted (idempotent)."""

    def __init__(self, pool: WorkerPool, spec: WorkerSpec, count: int) -> None:
        self.pool, self.spec, self.count = pool, spec, count

    def release(self) -> None:
        """Stop asking for these workers (idle ones beyond other leases' wants are stopped)."""
        self.pool._release(self)


class WorkerPool:
    """Warm root workers kept ready per `WorkerSpec` (see the module docstring).

    For each spec the pool keeps as many idle workers as the largest live lease for it asks
    (:meth:`reserve`), at most ``max_workers`` in all; a background thread starts them one
    at a time. :meth:`take` hands one out (or None: the caller starts its own). Close the pool
    with :meth:`close`; the thread ends once every worker it started has exited.
    """

    def __init__(self, max_workers: int = MAX_WARM_WORKERS) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self.started = 0
        """Workers this pool has started."""
        self._cond = threading.Condition()
        self._leases: list[PoolLease] = []
        self._idle: dict[WorkerSpec, deque[StartedWorker]] = {}
        self._handed_out: list[StartedWorker] = []
        self._closed = False
        self._thread: threading.Thread | None = None

    def reserve(self, spec: WorkerSpec, count: int = 1) -> PoolLease:
        """Keep ``count`` workers of ``spec`` ready (bounded by ``max_workers``) until the
        returned lease is released."""
        if type(count) is not int or count < 1:
            raise ValueError(f"count must be an int >= 1, got {count!r}")
        lease = PoolLease(self, spec, count)
        with self._cond:
            if self._closed:
                raise RuntimeError("this worker pool is closed")
            self._leases.append(lease)
            if self._thread is None:
                self._thread = threading.Thread(target=self._keep, name="agentrt-warm-workers",
                                                daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return lease

    def take(self, spec: WorkerSpec) -> StartedWorker | None:
        """A warm worker of ``spec`` (a loaded one first), now the caller's; None if there is
        none. The pool starts another in its place."""
        dead: list[StartedWorker] = []
        chosen = None
        with self._cond:
            idle = self._idle.get(spec, deque())
            for worker in sorted(idle, key=lambda w: not w.loaded):
                if worker.alive():
                    chosen = worker
                    break
                dead.append(worker)
            for worker in [*dead, *([chosen] if chosen else [])]:
                idle.remove(worker)
            if chosen is not None:
                self._handed_out.append(chosen)
            self._cond.notify_all()
        for worker in dead:
            worker.discard()
        return chosen

    def idle(self, spec: WorkerSpec | None = None) -> list[StartedWorker]:
        """The idle workers (of ``spec``, or all)."""
        with self._cond:
            return [w for s, idle in self._idle.items() if spec in (None, s) for w in idle]

    def wait_loaded(self, spec: WorkerSpec, count: int = 1, timeout: float = 30.0) -> bool:
        """Wait until ``count`` idle workers of ``spec`` are loaded (for tests and benchmarks);
        whether they are."""
        deadline = time.monotonic() + timeout
        while sum(w.loaded and w.alive() for w in self.idle(spec)) < count:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self) -> None:
        """Stop the idle workers and the refilling (idempotent; blocking, about
        :data:`EXIT_GRACE_S` at most). Workers already handed out stay with their REPLs."""
        with self._cond:
            self._closed = True
            idle = [w for queue in self._idle.values() for w in queue]
            self._idle.clear()
            self._leases.clear()
            self._cond.notify_all()
        _discard_all(idle)

    def _release(self, lease: PoolLease) -> None:
        with self._cond:
            if lease in self._leases:
                self._leases.remove(lease)
            self._cond.notify_all()

    def _wanted(self, spec: WorkerSpec) -> int:
        return max((lease.count for lease in self._leases if lease.spec == spec), default=0)

    def _next_start(self) -> WorkerSpec | None:
        """The spec of the next worker to start, if any (under the lock)."""
        if sum(len(idle) for idle in self._idle.values()) >= self.max_workers:
            return None
        for spec in dict.fromkeys(lease.spec for lease in self._leases):
            if len(self._idle.get(spec, ())) < self._wanted(spec):
                return spec
        return None

    def _surplus(self) -> list[StartedWorker]:
        """Idle workers that died or that no lease wants any more, taken out (under the lock)."""
        out = []
        for spec, idle in self._idle.items():
            for worker in [w for w in idle if not w.alive()]:
                idle.remove(worker)
                out.append(worker)
            while len(idle) > self._wanted(spec):
                out.append(idle.pop())
        self._handed_out = [w for w in self._handed_out if w.alive()]
        return out

    def _keep(self) -> None:
        """The pool's thread: refill, discard what died or is not wanted; after close, stay
        until every worker handed out has exited (the jail's workers die with this thread)."""
        while True:
            with self._cond:
                if self._closed:
                    break
                surplus = self._surplus()
                spec = self._next_start()
                if spec is None and not surplus:
                    self._cond.wait(CHECK_INTERVAL_S)
                    continue
            _discard_all(surplus)
            if spec is not None:
                try:
                    worker = start_worker(spec)
                except OSError:
                    time.sleep(CHECK_INTERVAL_S)  # e.g. out of processes: try again later
                    continue
                with self._cond:
                    self.started += 1
                    if self._closed:
                        surplus = [worker]
                    else:
                        self._idle.setdefault(spec, deque()).append(worker)
                        surplus = []
                    self._cond.notify_all()
                _discard_all(surplus)
        while True:
            with self._cond:
                self._handed_out = [w for w in self._handed_out if w.alive()]
                if not self._handed_out:
                    return
                self._cond.wait(CHECK_INTERVAL_S)


def _discard_all(workers: list[StartedWorker]) -> None:
    """Discard ``workers``, letting them all go first so that they exit together."""
    for worker in workers:
        worker.let_go()
    for worker in workers:
        worker.discard()


@functools.cache
def shared_pool() -> WorkerPool:
    """The process-wide warm worker pool (closed at interpreter exit)."""
    pool = WorkerPool()
    atexit.register(pool.close)
    return pool
