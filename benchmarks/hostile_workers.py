"""What hostile sandbox workers cost the runtime (the host process): memory, descriptors, CPU.

Each attack runs in a fresh Python process that starts a jailed REPL, gives its worker
unrestricted Python (a real ``extend`` hook, as if the first wall had fallen) and then attacks
the runtime over the worker's own connection. Measured in that process: peak RSS growth
(``ru_maxrss``), the most open descriptors seen while the attack runs, and the runtime's CPU
time (its own, not the workers'). Prints one line per attack and the limits they should stay
under (+50 MB RSS, +64 descriptors, 1 s CPU per REPL).

    python -m benchmarks.hostile_workers [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

HOOK = '''
"""A breach (also used by tests/interpreter/test_untrusted_worker.py): an extend hook that
gives cells unrestricted Python and the worker's raw connection to the runtime."""

import pickle, struct

def install(sandbox, channel):
    def send_raw(message=None, raw=None):
        if raw is None:
            raw = pickle.dumps(message, 5)
            raw = struct.pack(">I", len(raw)) + raw
        channel._process._link._sock.sendall(raw)

    def unrestricted(source):
        scope = {"send_raw": send_raw, "channel": channel,
                 "socket_path": channel._process._config.socket_path}
        exec(source, scope)
        return scope.get("result")

    sandbox.install_builtin("unrestricted", unrestricted)
'''

def _flood(message: dict, count: int = 100_000) -> str:
    """Source that sends ``message`` ``count`` times on the worker's own connection."""
    return f"""
import pickle, struct
frame = pickle.dumps({message!r}, 5)
frame = struct.pack(">I", len(frame)) + frame
try:
    for _ in range({count}):
        send_raw(raw=frame)
except OSError:
    pass
"""


ATTACKS = {
    "connection flood (200 never say hello)": """
import socket
held = []
for _ in range(200):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(socket_path)
    held.append(s)
channel.call("ready", (), {})
""",
    "60 MiB hellos, 16 streams": """
import socket, struct
held = []
for _ in range(16):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(socket_path)
    held.append(s)
    try:
        s.sendall(struct.pack(">I", 60 * 2**20) + b"x" * 4 * 2**20)
    except OSError:
        pass
channel.call("ready", (), {})
""",
    "memo-index bomb (9-byte frame)": """
import struct
frame = b"\\x80\\x05Nr" + struct.pack("<I", 1 << 25) + b"."
send_raw(raw=struct.pack(">I", len(frame)) + frame)
""",
    "empty-set bomb (1 MB frame)": """
import struct
frame = b"\\x80\\x05](" + b"\\x8f" * 1_000_000 + b"e."
send_raw(raw=struct.pack(">I", len(frame)) + frame)
""",
    "shared references 2**21 ways (tool call)": """
x = ["a" * 64]
for _ in range(21):
    x = [x, x]
send_raw({"op": "call", "call": 1, "name": "echo", "args": (x,), "kwargs": {}})
""",
    "stale replies, 100k": _flood({"op": "reply", "id": 1, "ok": True, "value": None}),
    "exit reports for unknown pids, 100k": _flood(
        {"op": "child_exit", "pid": 99999, "code": 0, "signal": None}),
    "orphans reaped by the root, 3000": """
import os
for _ in range(3000):
    if os.fork() == 0:
        if os.fork() == 0:
            os._exit(0)
        os._exit(0)
    os.wait()
""",
    "connect and hang up, 3000": """
import socket
for _ in range(3000):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(socket_path)
    except OSError:
        pass
    s.close()
""",
}

RUNNER = '''
import anyio, json, os, resource, sys

from agentrt.interpreter import Repl, ReplLimits

ATTACK = sys.argv[1]


def fds():
    return len(os.listdir("/proc/self/fd"))


def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def main():
    most = [0]
    ready, release = anyio.Event(), anyio.Event()

    async def tools(name, args, kwargs):
        if name == "ready":
            most[0] = max(most[0], fds())
            ready.set()
            await release.wait()
        return None

    async with Repl(tools, {"ready": "ready()", "echo": "echo(x)"},
                    ReplLimits(cpu_s=60, wall_s=120)) as repl:
        await repl.extend("breach_hook:install")
        fork = await repl.fork()
        await repl.execute("x = 1")
        base_fds, base_rss, base_cpu = fds(), resource.getrusage(
            resource.RUSAGE_SELF).ru_maxrss, cpu()
        most[0] = base_fds

        async def watch():
            while True:
                most[0] = max(most[0], fds())
                await anyio.sleep(0.05)

        async with anyio.create_task_group() as group:
            group.start_soon(watch)
            async def attack():
                await fork.execute("unrestricted(%r)" % ATTACK)
                ready.set()
            group.start_soon(attack)
            with anyio.move_on_after(60):
                await ready.wait()
            release.set()
            await anyio.sleep(0.2)
            group.cancel_scope.cancel()
        after = await repl.execute("print(x + 1)")
        print(json.dumps({
            "rss_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) / 1024,
            "fds": most[0] - base_fds, "cpu_s": cpu() - base_cpu,
            "protocol_errors": getattr(repl, "protocol_errors", -1), "repl_ok": after.stdout == "2\\n",
            "after": after.error}))

anyio.run(main)
'''


def run(name: str, attack: str, hooks: str) -> dict:
    env = {**os.environ, "PYTHONPATH": hooks}
    done = subprocess.run([sys.executable, "-c", RUNNER, textwrap.dedent(attack)],
                          capture_output=True, text=True, timeout=600, env=env)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr else "failed"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the attacks whose name contains this")
    only = parser.parse_args().only
    with tempfile.TemporaryDirectory() as hooks:
        with open(os.path.join(hooks, "breach_hook.py"), "w") as file:
            file.write(HOOK)
        print(f"{'attack':<44} {'+RSS MB':>8} {'+fds':>5} {'CPU s':>6} {'errors':>6}  REPL ok")
        for name, attack in ATTACKS.items():
            if only and only not in name:
                continue
            result = run(name, attack, hooks)
            if "error" in result:
                print(f"{name:<44} failed: {result['error']}")
                continue
            if not result["repl_ok"]:
                print("   after:", result["after"])
            print(f"{name:<44} {result['rss_mb']:>8.1f} {result['fds']:>5} "
                  f"{result['cpu_s']:>6.2f} {result['protocol_errors']:>6}  {result['repl_ok']}")
        print("limits: +50 MB RSS, +64 descriptors, 1 s CPU per REPL")


if __name__ == "__main__":
    main()
