"""Assume breach: unrestricted Python inside a jailed worker still cannot reach the host.

Each test installs, through a real ``extend`` hook, a builtin that runs *unrestricted*
Python source in the worker process (as if the restricted-Python wall were already broken),
then tries one escape. Every check must hold because of the OS jail alone; with the jail
switched off these tests fail.
"""

from __future__ import annotations

import os
import socket
import threading

import anyio
import pytest

from agentrt.interpreter import Repl, ReplLimits

pytestmark = pytest.mark.anyio

LIMITS = ReplLimits(cpu_s=5, wall_s=30, memory_mb=512, disk_mb=16, jail=True)

BREACH_MODULE = '''
def install(sandbox, channel):
    def unrestricted(source):
        scope = {"__name__": "breach"}
        exec(source, scope)   # full builtins: open, __import__, os, ctypes...
        return scope.get("result")
    sandbox.install_builtin("unrestricted", unrestricted)
'''



async def echo_tool(name: str, args: tuple, kwargs: dict):
    return list(args)


@pytest.fixture
async def breached(tmp_path, monkeypatch):
    """A jailed REPL whose namespace has the ``unrestricted`` builtin."""
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "breach_hook.py").write_text(BREACH_MODULE)
    monkeypatch.setenv("PYTHONPATH", str(hooks))
    async with Repl(echo_tool, ["echo"], LIMITS) as repl:
        await repl.extend("breach_hook:install")
        assert (await repl.execute("sentinel = 42")).ok
        yield repl
        after = await repl.execute("print(sentinel + 1, echo('still here'))")
        assert after.ok, after.error
        assert after.stdout == "43 ['still here']\n"


async def breach(repl: Repl, source: str):
    """Run ``source`` unrestricted in the worker; return its ``result`` (or the error)."""
    await repl.set_variable("source", source)
    result = await repl.execute("outcome = unrestricted(source)")
    if not result.ok:
        return result.error
    return await repl.get_variable("outcome")


def attempt(body: str) -> str:
    """Source that runs ``body`` and sets ``result`` to 'ok: <value>' or '<Error>: ...'."""
    indented = "\n".join("    " + line for line in body.strip().splitlines())
    return (f"try:\n{indented}\n    result = 'ok: ' + repr(value)\n"
            "except BaseException as exc:\n    result = f'{type(exc).__name__}: {exc}'\n")


async def test_cannot_read_a_host_file(breached, tmp_path):
    secret = tmp_path / "host" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("the host secret")
    repo_file = os.path.abspath("pyproject.toml") if os.path.exists("pyproject.toml") else None
    for path in filter(None, [str(secret), repo_file, "/etc/hostname", "/proc/1/environ"]):
        outcome = await breach(breached, attempt(f"value = open({path!r}).read()"))
        assert not outcome.startswith("ok"), (path, outcome)
        assert "host secret" not in outcome
    listing = await breach(breached, attempt(
        "import os\nvalue = sorted(os.listdir('/')), sorted(os.listdir('/etc'))"))
    assert listing.startswith("ok"), listing
    assert "'home'" not in listing and "'passwd'" not in listing
    processes = await breach(breached, attempt("import os\nvalue = os.listdir('/proc')"))
    assert processes == "ok: []" or processes.startswith("FileNotFoundError"), processes


async def test_cannot_see_host_environment(breached, monkeypatch):
    monkeypatch.setenv("AGENTRT_TEST_SECRET", "env-secret-value")
    outcome = await breach(breached, attempt("import os\nvalue = dict(os.environ)"))
    assert outcome.startswith("ok"), outcome
    assert "env-secret-value" not in outcome and "AGENTRT_TEST_SECRET" not in outcome
    assert "'HOME'" not in outcome and "'PATH'" not in outcome


async def test_cannot_write_outside_its_directory(breached, tmp_path):
    # tmp_path's parents exist in the jail only as directories on its private tmpfs (bound
    # hook directories live there), so a write may "succeed" there: what counts is the host.
    for target in (tmp_path / "written-by-sandbox", "/written-by-sandbox"):
        await breach(breached, attempt(
            f"with open({str(target)!r}, 'w') as f:\n    value = f.write('x')"))
    for target in ("/written-by-sandbox", "/usr/written-by-sandbox", "/dev/written"):
        outcome = await breach(breached, attempt(
            f"with open({target!r}, 'w') as f:\n    value = f.write('x')"))
        assert "Read-only file system" in outcome, (target, outcome)
    assert not (tmp_path / "written-by-sandbox").exists()
    assert not os.path.exists("/written-by-sandbox")
    own = await breach(breached, attempt(
        "with open('/tmp/scratch.txt', 'w') as f:\n    value = f.write('inside')"))
    assert own == "ok: 6", own  # its private tmpfs works and is not the host's /tmp
    assert not os.path.exists("/tmp/scratch.txt")


async def test_cannot_open_network_connections(breached):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted: list[object] = []
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        for body in (f"import socket\nvalue = socket.create_connection(('127.0.0.1', {port}), 2)",
                     "import socket\nvalue = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)",
                     "import socket\nvalue = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW)"):
            outcome = await breach(breached, attempt(body))
            assert not outcome.startswith("ok"), outcome
        await anyio.sleep(0.3)
        assert accepted == []
    finally:
        stop.set()
        thread.join()
        server.close()


async def test_cannot_start_a_process(breached, tmp_path):
    marker = tmp_path / "ran"
    for body in (f"import subprocess\nvalue = subprocess.run(['/bin/touch', {str(marker)!r}])",
                 f"import os\nvalue = os.system('touch {marker}')",
                 "import os\nvalue = os.execv('/bin/true', ['true'])"):
        outcome = await breach(breached, attempt(body))
        assert not outcome.startswith("ok: CompletedProcess(args=['/bin/touch'"), outcome
        # subprocess and execv: EPERM; os.system: the forked shell cannot exec (127 << 8)
        assert outcome.startswith(("PermissionError", f"ok: {127 << 8}")), outcome
    assert not marker.exists()


async def test_cannot_escape_through_kernel_interfaces(breached):
    """ptrace, new namespaces and mounts are refused by the syscall filter."""
    source = attempt("""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
value = [libc.ptrace(16, os.getppid(), 0, 0), ctypes.get_errno(),
         libc.unshare(0x10000000), ctypes.get_errno(),
         libc.mount(b"none", b"/tmp", b"tmpfs", 0, None), ctypes.get_errno()]
""")
    outcome = await breach(breached, source)
    assert outcome == "ok: [-1, 1, -1, 1, -1, 1]", outcome  # EPERM three times


async def test_process_count_is_bounded(breached):
    source = attempt("""
import os
read_end, write_end = os.pipe()
children = 0
try:
    for _ in range(1500):
        if os.fork() == 0:
            os.close(write_end)
            os.read(read_end, 1)   # wait for the parent to close its end, then go
            os._exit(0)
        children += 1
    stopped = None
except OSError as exc:
    stopped = exc.errno
os.close(write_end)
for _ in range(children):   # reap them, so the pid space is free again for the next cell
    os.wait()
value = [children, stopped]
""")
    outcome = await breach(breached, source)
    assert outcome.startswith("ok: ["), outcome
    children, stopped = (int(part) for part in outcome[5:-1].split(", "))
    assert stopped == 11 and children < 600, outcome  # EAGAIN well before 1500


async def test_no_capabilities_are_left(breached):
    outcome = await breach(breached, attempt("""
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
header = (ctypes.c_uint32 * 2)(0x20080522, 0)
data = (ctypes.c_uint32 * 6)()
value = [libc.capget(header, data), list(data)]
"""))
    assert outcome == "ok: [0, [0, 0, 0, 0, 0, 0]]", outcome


async def test_fork_still_works_but_the_child_is_jailed(breached):
    source = attempt("""
import os
read_end, write_end = os.pipe()
pid = os.fork()
if pid == 0:
    try:
        os.execv('/bin/true', ['true'])
    except OSError as exc:
        os.write(write_end, str(exc.errno).encode())
    os._exit(0)
os.close(write_end)
os.waitpid(pid, 0)
value = os.read(read_end, 10).decode()
""")
    assert await breach(breached, source) == "ok: '1'"


async def test_disk_is_bounded(breached):
    outcome = await breach(breached, attempt("""
with open('/tmp/fill', 'wb') as f:
    for _ in range(64):
        f.write(b'x' * 1024 * 1024)
value = 'wrote 64 MB'
"""))
    assert outcome.startswith("OSError"), outcome
    assert "File too large" in outcome or "No space left" in outcome
    cleanup = await breach(breached, attempt("import os\nos.remove('/tmp/fill')\nvalue = 1"))
    assert cleanup == "ok: 1"


async def test_stderr_flood_is_capped(breached):
    outcome = await breach(breached, attempt("""
import sys
for _ in range(200):
    sys.stderr.write('y' * 100_000)
value = 'flooded'
"""))
    assert outcome == "ok: 'flooded'"
    log = os.path.join(str(breached._tmpdir), "worker.log")
    assert os.path.getsize(log) < 2 * LIMITS.max_output_chars + 10_000


async def test_memory_is_bounded(breached):
    outcome = await breach(breached, attempt("value = len(bytearray(2 * 1024 ** 3))"))
    assert outcome.startswith("MemoryError"), outcome


async def test_killing_itself_is_a_clear_error_and_the_repl_goes_on(breached):
    result = await breached.execute("unrestricted('import os, signal\\n"
                                    "os.kill(os.getpid(), signal.SIGKILL)')")
    assert result.killed and "SIGKILL" in result.error
    assert "variables it assigned were discarded" in result.error


async def test_opt_out_by_environment_variable(tmp_path, monkeypatch):
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "breach_hook.py").write_text(BREACH_MODULE)
    monkeypatch.setenv("PYTHONPATH", str(hooks))
    monkeypatch.setenv("AGENTRT_JAIL", "0")
    async with Repl(echo_tool, ["echo"], ReplLimits(cpu_s=5, wall_s=30)) as repl:
        await repl.extend("breach_hook:install")
        outcome = await breach(repl, attempt("import os\nvalue = 'PATH' in os.environ"))
    assert outcome == "ok: True"  # the unjailed worker's environment has PATH


FAKE_BWRAP = """#!/bin/sh
echo "bwrap: No permissions to create a new namespace, likely because the kernel does not allow non-privileged user namespaces." >&2
exit 1
"""


@pytest.mark.parametrize("machine", ["no-bwrap", "no-namespaces"])
@pytest.mark.parametrize("jail_setting", [None, True])
async def test_without_a_jail_the_repl_refuses_to_start(tmp_path, monkeypatch, machine,
                                                        jail_setting):
    """Fail closed: no jail, no sandbox, unless the user opts out explicitly."""
    from agentrt.interpreter import ReplError, jail

    if machine == "no-namespaces":  # bwrap is there but cannot create namespaces
        fake = tmp_path / "bwrap"
        fake.write_text(FAKE_BWRAP)
        fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("AGENTRT_JAIL", raising=False)
    jail._best_plan.cache_clear()
    try:
        repl = Repl(echo_tool, ["echo"], ReplLimits(cpu_s=5, wall_s=30, jail=jail_setting))
        with pytest.raises(ReplError) as refused:
            await repl.start()
    finally:
        jail._best_plan.cache_clear()
    message = str(refused.value)
    cause = ("bubblewrap (bwrap) is not installed" if machine == "no-bwrap"
             else "bwrap cannot create namespaces here")
    assert cause in message, message
    for remedy in ("apt-get install bubblewrap", "unprivileged user namespaces",
                   "ReplLimits(jail=False)", "AGENTRT_JAIL=0", "UNSAFE for untrusted code"):
        assert remedy in message, (remedy, message)


async def test_opting_out_explicitly_runs_without_the_jail(tmp_path, monkeypatch, caplog):
    from agentrt.interpreter import jail

    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap to be found
    jail._warn_jail_off.cache_clear()
    jail._best_plan.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            # jail off: this test runs unconfined on purpose (the opt-out is what it checks)
            async with Repl(echo_tool, ["echo"], ReplLimits(cpu_s=5, wall_s=30,
                                                            jail=False)) as repl:
                assert (await repl.execute("print(1 + 1)")).stdout == "2\n"
    finally:
        jail._best_plan.cache_clear()
    assert any("unsafe for untrusted code" in r.getMessage() for r in caplog.records)


async def test_runtime_finds_jailed_processes_by_their_own_pids():
    """Workers know themselves by PID-namespace numbers; the runtime signals host pids."""
    from agentrt.interpreter.repl.process_tree import host_pid

    async with Repl(echo_tool, ["echo"], LIMITS) as repl:
        fork = await repl.fork()
        wire_pid = fork._proc.wire_pid
        assert wire_pid != fork.pid and wire_pid < 600  # small numbers inside the jail
        assert host_pid(wire_pid, repl.root_pid) == fork.pid
        assert host_pid(1, repl.root_pid) == repl.root_pid
        await fork.kill()
        assert not fork.alive
        assert (await repl.execute("print('main goes on')")).stdout == "main goes on\n"


async def test_memory_held_by_a_file_descriptor_is_refused(breached):
    """memfd memory is outside RLIMIT_AS (it held 360 MB under a 256 MB limit)."""
    outcome = await breach(breached, attempt("import os\nvalue = os.memfd_create('held')"))
    assert outcome.startswith("PermissionError"), outcome


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="raw clone syscall number for x86_64")
async def test_a_child_cannot_be_made_someone_elses(breached):
    """clone(CLONE_PARENT) would make a process the runtime cannot trace back to its cell."""
    outcome = await breach(breached, attempt("""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
pid = libc.syscall(56, 0x00008000 | 17, 0, 0, 0, 0)   # clone(CLONE_PARENT | SIGCHLD)
if pid == 0:
    os._exit(0)
value = [pid, ctypes.get_errno()]
"""))
    assert outcome == "ok: [-1, 1]", outcome  # EPERM


async def test_the_jail_has_one_memory_bound_where_the_machine_allows_it(tmp_path, monkeypatch):
    """With a cgroup, four forks cannot each fill their own RLIMIT_AS (they held 3.7 GB
    under memory_mb=1024); without one (a note in the log says so), per-process limits stay."""
    from agentrt.interpreter import cgroup

    parent, problem = cgroup.find_parent()
    if parent is None:
        pytest.skip(f"no cgroup v2 with memory and pids here: {problem}")
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "breach_hook.py").write_text(BREACH_MODULE)
    monkeypatch.setenv("PYTHONPATH", str(hooks))
    limits = ReplLimits(cpu_s=20, wall_s=60, memory_mb=256, disk_mb=16)  # memory.max 528 MB
    async with Repl(echo_tool, ["echo"], limits) as repl:
        await repl.extend("breach_hook:install")
        forks = [await repl.fork() for _ in range(4)]
        fill = "x = bytearray(200 * 2**20)\nx[::4096] = b'x' * len(x[::4096])\nresult = x"
        held = [await fork.execute(f"kept = unrestricted({fill!r})") for fork in forks]
        assert not all(result.ok for result in held)  # 800 MB did not fit
        assert (await repl.execute("print(1)")).stdout == "1\n"
