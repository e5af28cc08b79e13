"""What the runtime sees of its worker processes, without asking them: pidfds, the jail's
processes and their tree, and killing a process with everything it started.

Workers report pids, exits and children, but a breached worker may lie; the runtime takes
liveness only from the kernel. Each connected worker is held by a *pidfd* (from the socket's
``SO_PEERPIDFD``, else ``pidfd_open`` on its ``SO_PEERCRED`` pid), which signals race-free and
turns readable when the process exits. The jail's processes are found in ``/proc``: those in the
root worker's PID namespace (with the jail), or in its session (without).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import socket
import struct
import time
from collections import defaultdict

_SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5+
_FREEZE_ROUNDS = 20


async def exited(pidfd: int) -> None:
    """Wait (on the running asyncio loop, without blocking it) until ``pidfd``'s process has
    exited, i.e. the pidfd turned readable. One waiter per descriptor: a second registration of
    the same descriptor would replace the first."""
    loop = asyncio.get_running_loop()
    gone = loop.create_future()
    loop.add_reader(pidfd, lambda: gone.done() or gone.set_result(None))
    try:
        await gone
    finally:
        loop.remove_reader(pidfd)


def peer_credentials(sock: socket.socket) -> tuple[int | None, int | None]:
    """(pid, pidfd) of the process at the other end of a Unix socket, as this process sees it;
    either may be None where the kernel cannot tell."""
    pid = pidfd = None
    with contextlib.suppress(OSError, AttributeError):
        pid, _, _ = struct.unpack("3i", sock.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        pid = pid if pid > 0 else None
    with contextlib.suppress(OSError):
        pidfd = sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD)
    if pidfd is None and pid is not None:
        pidfd = open_pidfd(pid)
    return pid, pidfd


def open_pidfd(pid: int) -> int | None:
    """A pidfd for ``pid``, or None if there is no such process (or no pidfd support)."""
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def signal_pidfd(pidfd: int, number: int) -> None:
    """Send a signal through a pidfd (a process already gone is not an error)."""
    with contextlib.suppress(ProcessLookupError, OSError):
        signal.pidfd_send_signal(pidfd, number)


def _namespace(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def _stat(pid: int | str) -> tuple[str, int, int] | None:
    """(state, parent pid, session) of a process, from /proc (host numbering)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as file:
            fields = file.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0].decode(), int(fields[1]), int(fields[3])


def _member(pid: int, root_pid: int, namespace: str | None) -> int | None:
    """The parent pid of ``pid`` if it is a live (not zombie) process of the jail whose root
    worker is ``root_pid``: in PID namespace ``namespace``, or (None) in its session."""
    if namespace is not None and _namespace(pid) != namespace:
        return None
    stat = _stat(pid)
    if stat is None or stat[0] == "Z" or (namespace is None and stat[2] != root_pid):
        return None
    return stat[1]


def jail_members(root_pid: int, *, namespaced: bool) -> dict[int, int]:
    """``{pid: parent pid}`` of the live processes of the jail whose root worker has host pid
    ``root_pid``: its PID namespace, or (without a jail) its session."""
    namespace = _namespace(root_pid) if namespaced else None
    if namespaced and namespace is None:
        return {}
    members: dict[int, int] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            parent = _member(int(entry.name), root_pid, namespace)
            if parent is not None:
                members[int(entry.name)] = parent
    return members


def in_jail(pid: int, root_pid: int, *, namespaced: bool) -> bool:
    """Whether ``pid`` is a live process of the jail whose root worker is ``root_pid``."""
    namespace = _namespace(root_pid) if namespaced else None
    if namespaced and namespace is None:
        return False
    return _member(pid, root_pid, namespace) is not None


def host_pid(ns_pid: int, root_pid: int) -> int | None:
    """The host pid of process ``ns_pid`` of the PID namespace whose init has host pid
    ``root_pid`` (None if it is not running)."""
    namespace = _namespace(root_pid)
    if namespace is None:
        return None
    if ns_pid == 1:
        return root_pid
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or _namespace(int(entry.name)) != namespace:
            continue
        try:
            with open(f"/proc/{entry.name}/status") as status:
                for line in status:
                    if line.startswith("NSpid:"):
                        if int(line.split()[-1]) == ns_pid:
                            return int(entry.name)
                        break
        except (OSError, ValueError):
            continue
    return None


def kill_tree(targets: set[int], root_pid: int, *, namespaced: bool,
              keep: set[int]) -> dict[int, int]:
    """SIGKILL ``targets``, everything they started, and the jail's strays: processes the root
    worker adopted (their parent died) that are not in ``keep`` (the workers the runtime
    knows). First every one of them is stopped, round after round until no new one appears, so
    none can fork or escape while the tree is read. Returns ``{pid: pidfd}`` of the processes
    killed (close the pidfds, e.g. with :func:`wait_gone`)."""
    namespace = _namespace(root_pid) if namespaced else None
    held: dict[int, int] = {}
    for _ in range(_FREEZE_ROUNDS):
        members = jail_members(root_pid, namespaced=namespaced)
        children: dict[int, list[int]] = defaultdict(list)
        for pid, parent in members.items():
            children[parent].append(pid)
        wanted = {pid for pid in targets if pid in members}
        wanted |= {pid for pid, parent in members.items()
                   if parent == root_pid and pid not in keep and pid != root_pid}
        stack = list(wanted)
        while stack:
            for child in children[stack.pop()]:
                if child not in wanted and child != root_pid:
                    wanted.add(child)
                    stack.append(child)
        new = [pid for pid in wanted if pid not in held]
        if not new:
            break
        for pid in new:
            pidfd = open_pidfd(pid)
            if pidfd is None:
                continue
            if _member(pid, root_pid, namespace) is None:
                os.close(pidfd)  # gone, or the pid now names another process
                continue
            held[pid] = pidfd
            signal_pidfd(pidfd, signal.SIGSTOP)
    for pidfd in held.values():
        signal_pidfd(pidfd, signal.SIGKILL)
    return held


def wait_gone(held: dict[int, int], timeout: float) -> list[int]:
    """Wait until every process in ``{pid: pidfd}`` has exited (blocking); close the pidfds.
    Returns the pids still running at the timeout."""
    deadline = time.monotonic() + timeout
    left = dict(held)
    try:
        while left:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            readable, _, _ = select.select(list(left.values()), [], [], min(remaining, 0.05))
            for pid, pidfd in list(left.items()):
                if pidfd in readable:
                    del left[pid]
    finally:
        for pidfd in held.values():
            with contextlib.suppress(OSError):
                os.close(pidfd)
    return sorted(left)
