"""The OS jail around the sandbox worker processes: the wall that holds when the Python-level
policy (sandbox.py) is bypassed. See docs/sandbox.md for the threat model.

Two halves:

* **Runtime side** (:func:`plan_jail`, :func:`bwrap_command`): the root worker is started
  under bubblewrap with new user, PID, network, IPC, UTS and cgroup namespaces, an empty
  environment, no capabilities, and a filesystem of its own: an empty root holding only
  read-only binds of what Python and agentrt need, the folder of the REPL's socket, a few device nodes
  and a size-limited tmpfs at ``/tmp`` (the only writable path). The syscall filter is
  compiled here once per runtime process with libseccomp (``pyseccomp``) into BPF bytes.
* **Worker side** (:func:`lock_down`): after the root worker has said hello, it sets its
  ``RLIMIT_*`` values, ``no_new_privs`` and loads the filter itself (stdlib only), before
  any model code exists in the process. Holders, cells and shadow forks are forks of it and
  inherit all of this.

The filter allows ``fork`` (the worker's own fork-per-cell design needs it: a fork is a
copy of the already-jailed worker) but refuses ``execve``/``execveat``, clone flags that
create namespaces, ``clone3`` (answered ENOSYS so libc falls back to ``clone``, whose flags
can be checked), sockets other than ``AF_UNIX``, ``ptrace`` and cross-process memory access,
mounts and namespace changes, kernel module / keyring / BPF / perf / io_uring interfaces, and
terminal input injection.

The filter also refuses ``memfd_create`` (memory held by a file descriptor escapes
``RLIMIT_AS``) and ``clone(CLONE_PARENT)`` (a child that would not descend from its creator, so
the runtime could not find it when it kills a cell with everything it started).

Fail closed: by default (``ReplLimits(jail=None)``, ``jail=True``) the REPL refuses to start when
the jail cannot be built, with an error that says why and what to do. ``jail=False`` or the
environment variable ``AGENTRT_JAIL=0`` opts out explicitly: unsafe for untrusted code (a warning
says so once).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import resource
import signal
import sys
from dataclasses import dataclass

from agentrt.errors import AgentrtError

# The worker imports this module for lock_down() only: the runtime-side functions import
# what else they need themselves, to keep the worker's start-up short.

JAIL_ENV = "AGENTRT_JAIL"
"""``0``/``off``/``false``/``no`` turns the jail off (unsafe); anything else keeps it required."""

MAX_OPEN_FILES = 256
MAX_PROCESSES = 64
"""RLIMIT_NPROC: a cap on the process count (threads included) of the whole jail."""
ROOT_PID_MAX = 301
"""The jail's ``pid_max`` when the runtime is root, which RLIMIT_NPROC exempts: about 300
processes (the smallest value the kernel accepts)."""
JAIL_TMP = "/tmp"
"""The jail's private writable directory (a tmpfs of ``ReplLimits.disk_mb``) and its cwd."""

_DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")
_WORKER_PACKAGES = ("agentrt", "agentrt.interpreter", "agentrt.tools", "RestrictedPython")
_NAMESPACE_FLAGS = ("--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
                    "--unshare-uts", "--unshare-cgroup-try")

# Syscalls refused with EPERM (names unknown on this architecture are skipped).
DENIED_SYSCALLS = (
    "execve", "execveat",                                           # start a program
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd",  # other processes
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "mount_setattr",
    "fsopen", "fsconfig", "fsmount", "fspick", "move_mount", "open_tree",
    "open_by_handle_at", "name_to_handle_at",                       # escape a mount ns
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "io_uring_setup", "io_uring_enter", "io_uring_register",        # bypasses this filter
    "reboot", "swapon", "swapoff", "syslog", "acct", "quotactl", "settimeofday",
    "clock_settime", "adjtimex", "clock_adjtime", "personality", "vhangup",
    "memfd_create", "memfd_secret",                                 # memory outside RLIMIT_AS
)
_CLONE_DENIED_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000,
                       0x20000000, 0x40000000, 0x00000080,  # NEWNS CGROUP UTS IPC USER PID NET TIME
                       0x00008000)                           # PARENT
_TIOCSTI = 0x5412


class JailUnavailable(AgentrtError, RuntimeError):
    """The OS jail cannot be built here and the user has not opted out of it."""


@dataclass(frozen=True)
class JailPlan:
    """How worker processes are confined: ``namespaces`` (bubblewrap) and ``seccomp`` (the
    compiled filter). Either the whole jail, or (opted out) :data:`OFF`."""

    namespaces: bool
    seccomp: bytes | None

    @property
    def active(self) -> bool:
        """Whether any OS-level confinement applies."""
        return self.namespaces or self.seccomp is not None


OFF = JailPlan(False, None)

REMEDIES = (
    "Model-written code is untrusted, so agentrt does not run it without the jail. To fix it: "
    "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install "
    "bubblewrap); if bwrap is installed but cannot create namespaces, allow unprivileged user "
    "namespaces (sysctl kernel.unprivileged_userns_clone=1; on Ubuntu 24.04 and later also "
    "kernel.apparmor_restrict_unprivileged_userns=0; in a container, allow it to create user "
    "namespaces); or opt out explicitly with ReplLimits(jail=False) or AGENTRT_JAIL=0, which "
    "is UNSAFE for untrusted code: only the Python-level policy then stands between model code "
    "and this machine.")


def jail_wanted(requested: bool | None) -> bool:
    """``requested`` (from ReplLimits); when it is None, False only if ``AGENTRT_JAIL`` says
    ``0``/``off``/``false``/``no``."""
    if requested is not None:
        return requested
    return os.environ.get(JAIL_ENV, "").strip().lower() not in ("0", "off", "false", "no")


@functools.cache
def _warn_jail_off() -> None:
    import logging

    logging.getLogger(__name__).warning(
        "agentrt: the sandbox's OS jail is off (ReplLimits(jail=False) or %s=0): "
        "unsafe for untrusted code", JAIL_ENV)


def plan_jail(requested: bool | None) -> JailPlan:
    """The jail to build (may probe bubblewrap once; blocking, ~10 ms). Raises
    `JailUnavailable`, naming the cause and the remedies, when it cannot be built."""
    if not jail_wanted(requested):
        _warn_jail_off()
        return OFF
    plan, problem = _best_plan()
    if problem is not None:
        raise JailUnavailable(f"the sandbox cannot start: its OS jail cannot be built here "
                              f"({problem}). {REMEDIES}")
    return plan


@functools.cache
def _best_plan() -> tuple[JailPlan, str | None]:
    problems = []
    try:
        program = seccomp_program()
    except Exception as exc:  # missing binding or library, unsupported architecture
        program = None
        problems.append(f"no seccomp filter ({type(exc).__name__}: {exc})")
    reason = _bwrap_problem()
    if reason is not None:
        problems.append(reason)
    return JailPlan(reason is None, program), "; ".join(problems) or None


def _bwrap_problem() -> str | None:
    """Why bubblewrap cannot jail a process here, or None when it can."""
    import shutil
    import subprocess

    if not sys.platform.startswith("linux"):
        return "not Linux"
    binary = shutil.which("bwrap")
    if binary is None:
        return "bubblewrap (bwrap) is not installed"
    probe = [binary, *_NAMESPACE_FLAGS, "--cap-drop", "ALL"]
    if caps_pid_space():
        probe += ["--cap-add", "CAP_SYS_ADMIN", "--proc", "/proc"]
    probe += [*_system_binds(), "--", "true"]
    try:
        done = subprocess.run(probe, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, timeout=10, env={})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap failed to run: {exc}"
    if done.returncode != 0:
        detail = done.stderr.decode(errors="replace").strip().splitlines()
        return "bwrap cannot create namespaces here" + (f": {detail[-1]}" if detail else "")
    return None


def _system_binds() -> list[str]:
    args: list[str] = []
    for path in _SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def _python_paths(pythonpath: str) -> list[str]:
    """Directories the worker needs to import Python, agentrt and its dependencies (and the
    entries of its ``PYTHONPATH``, ``pythonpath``)."""
    import importlib.util
    import sysconfig

    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable))}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        paths.add(sysconfig.get_paths()[key])
    for name in _WORKER_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None:
            paths.update(spec.submodule_search_locations or [])
            if spec.origin:
                paths.add(os.path.dirname(spec.origin))
    for entry in pythonpath.split(os.pathsep):
        if entry:
            paths.add(os.path.abspath(entry))
    existing = sorted(os.path.realpath(p) for p in paths if os.path.isdir(p))
    existing += sorted(p for p in paths if os.path.isdir(p) and os.path.realpath(p) != p)
    kept: list[str] = []
    for path in existing:  # drop paths already inside a kept one (same spelling)
        if not any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            kept.append(path)
    return kept


def caps_pid_space() -> bool:
    """Whether the root worker bounds its PID namespace itself (see :func:`lock_down`): only
    when the runtime is root, whose processes ``RLIMIT_NPROC`` does not bound."""
    return os.geteuid() == 0


def bwrap_command(socket_dir: str, environment: dict[str, str], disk_mb: int) -> list[str]:
    """The bubblewrap argv prefix that starts the root worker in its jail (``socket_dir``: the
    REPL's own folder holding its socket, which may be created after the worker starts)."""
    import shutil

    args = [shutil.which("bwrap") or "bwrap", *_NAMESPACE_FLAGS, "--die-with-parent",
            "--new-session", "--as-pid-1", "--cap-drop", "ALL"]
    if caps_pid_space():  # kept just long enough to set pid_max; lock_down drops it
        args += ["--cap-add", "CAP_SYS_ADMIN", "--proc", "/proc"]
    else:  # (with it, bwrap nests a user namespace that could not unmount /proc; the
        args += ["--disable-userns"]  # filter refuses new user namespaces anyway)
    args += ["--clearenv"]
    for key, value in environment.items():
        args += ["--setenv", key, value]
    args += _system_binds()
    # The private tmpfs first: binds below may lie under /tmp (the socket usually does).
    args += ["--size", str(max(disk_mb, 1) * 1024 * 1024), "--perms", "0700",
             "--tmpfs", JAIL_TMP]
    for path in _SYSTEM_FILES:
        args += ["--ro-bind-try", path, path]
    for path in _python_paths(environment.get("PYTHONPATH", "")):
        args += ["--ro-bind", path, path]
    args += ["--dir", "/dev"]
    for device in _DEVICES:
        args += ["--dev-bind-try", device, device]
    args += ["--ro-bind", socket_dir, socket_dir]
    args += ["--remount-ro", "/", "--chdir", JAIL_TMP, "--"]
    return args


def seccomp_program() -> bytes:
    """The worker's syscall filter as raw BPF (compiled with libseccomp via pyseccomp)."""
    import socket
    import tempfile

    import pyseccomp as sc

    denied = sc.ERRNO(errno.EPERM)
    program = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED_SYSCALLS:
        try:
            program.add_rule(denied, name)
        except (ValueError, OSError, RuntimeError):
            continue  # not a syscall on this architecture
    program.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for flag in _CLONE_DENIED_FLAGS:
        program.add_rule(denied, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    program.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), "socket",
                     sc.Arg(0, sc.NE, socket.AF_UNIX))
    program.add_rule(denied, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, _TIOCSTI))
    with tempfile.TemporaryFile() as out:
        program.export_bpf(out)
        out.seek(0)
        return out.read()


# --------------------------------------------------------------------------- worker side

_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_PR_CAPBSET_DROP = 24
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_SECCOMP_MODE_FILTER = 2
_MNT_DETACH = 2
_CAPABILITY_VERSION_3 = 0x20080522
_PID_MAX = "/proc/sys/kernel/pid_max"


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def _bound_pid_space(libc: ctypes.CDLL) -> str | None:
    """As pid 1 of the jail with CAP_SYS_ADMIN there: cap the namespace's ``pid_max``, hide
    ``/proc`` again and drop every capability for good. Returns why pid_max could not be
    set (older kernels do not namespace it), or None."""
    problem = None
    try:
        with open(_PID_MAX, "w") as pid_max:
            pid_max.write(str(ROOT_PID_MAX))
    except OSError as exc:
        problem = f"pid_max not set ({exc})"
    if libc.umount2(b"/proc", _MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), "cannot hide /proc in the jail")
    for capability in range(64):
        libc.prctl(_PR_CAPBSET_DROP, ctypes.c_ulong(capability), ctypes.c_ulong(0),
                   ctypes.c_ulong(0), ctypes.c_ulong(0))
    libc.prctl(_PR_CAP_AMBIENT, ctypes.c_ulong(_PR_CAP_AMBIENT_CLEAR_ALL), ctypes.c_ulong(0),
               ctypes.c_ulong(0), ctypes.c_ulong(0))
    header, data = _CapHeader(_CAPABILITY_VERSION_3, 0), (_CapData * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed: cannot drop capabilities")
    if libc.capget(ctypes.byref(header), data) != 0 or any(
            part.effective or part.permitted for part in data):
        raise OSError("capabilities are still held after dropping them")
    return problem


def lock_down(seccomp: bytes | None, disk_mb: int, bound_pids: bool = False) -> None:
    """In the root worker: bound the PID namespace (``bound_pids``), set the jail's RLIMITs,
    ``no_new_privs`` and the syscall filter.

    Hard limits are lowered too, so nothing in the process can raise them again.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if bound_pids:
        problem = _bound_pid_space(libc)
        if problem is not None:
            print(f"agentrt jail: {problem}", file=sys.stderr)
    size = max(disk_mb, 1) * 1024 * 1024
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails with EFBIG
    for limit, value in ((resource.RLIMIT_FSIZE, size), (resource.RLIMIT_NOFILE, MAX_OPEN_FILES),
                         (resource.RLIMIT_NPROC, MAX_PROCESSES), (resource.RLIMIT_CORE, 0)):
        _, hard = resource.getrlimit(limit)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(limit, (value, value))
    if seccomp is None:
        return
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), ctypes.c_ulong(0),
                  ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if len(seccomp) % 8 or not seccomp:
        raise ValueError("malformed seccomp program")
    buffer = ctypes.create_string_buffer(seccomp, len(seccomp))
    fprog = _SockFprog(len(seccomp) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    if libc.prctl(_PR_SET_SECCOMP, ctypes.c_ulong(_SECCOMP_MODE_FILTER),
                  ctypes.byref(fprog), ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")
