"""Ctrl-C during `Agent.run_sync`, in a real subprocess: SIGINT is sent once the child has printed
a marker from inside the part under test (an engine stream, a sync tool, an async tool, an async
tool that blocks the event loop, a sandbox cell). The child must raise `RunInterrupted` promptly
with the run so far, its sandbox processes must be gone, and it must exit."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from child_signals import default_sigint

ROOT = Path(__file__).resolve().parents[2]

CHILD = r'''
import asyncio, json, sys, time
from agentrt import Agent, ReplayEngine, RunInterrupted, tool

scenario = sys.argv[1]
seen = []

def mark(what):
    print("MARK", what, flush=True)

@tool
def sync_hang() -> int:
    mark("sync tool")
    time.sleep(600)

@tool
async def async_hang() -> int:
    mark("async tool")
    await asyncio.sleep(600)

@tool
async def loop_blocker() -> int:
    mark("async tool blocking the loop")
    time.sleep(600)

@tool
def marker() -> int:
    mark("cell")
    return 1

def on_event(event):
    seen.append(event.kind)
    if scenario == "stream" and event.kind == "delta" and seen.count("delta") == 3:
        mark("engine stream")

code = {"sync_tool": "sync_hang()", "async_tool": "async_hang()",
        "blocking_tool": "loop_blocker()", "cell": "marker()\nwhile True:\n    pass",
        "stream": "x = 1\n" * 2000}[scenario]
engine = ReplayEngine([f"```repl\n{code}\n```"],
                      tokens_per_second=20 if scenario == "stream" else 2000)
agent = Agent(engine, tools=[sync_hang, async_hang, loop_blocker, marker], speculation=False,
              on_event=on_event)
try:
    agent.run_sync("t")
    print("RESULT " + json.dumps({"swallowed": True}), flush=True)
except RunInterrupted as exc:
    result = exc.result
    print("RESULT " + json.dumps({
        "at": time.monotonic(), "status": result.status, "error": result.error,
        "kinds": [e.kind for e in result.trace.events], "listener_saw": seen[-2:],
        "turns": len(result.turns), "response": len(result.turns[0].response),
    }), flush=True)
    raise
'''


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _lines(stream) -> queue.Queue:
    lines: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _next_line(lines: queue.Queue, prefix: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        assert line is not None, f"the child ended before printing {prefix!r}"
        if line.startswith(prefix):
            return line


@pytest.mark.parametrize("scenario", ["stream", "sync_tool", "async_tool", "blocking_tool",
                                      "cell"])
def test_ctrl_c_interrupts_the_run_promptly_and_keeps_its_trace(tmp_path, scenario):
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    child = subprocess.Popen([sys.executable, str(script), scenario], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=default_sigint)
    try:
        lines = _lines(child.stdout)
        _next_line(lines, "MARK", timeout=120)
        workers = _descendants(child.pid)
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        report = json.loads(_next_line(lines, "RESULT ", timeout=20)[len("RESULT "):])
        code = child.wait(timeout=20)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert not report.get("swallowed"), "the run went on after Ctrl-C"
    latency = report["at"] - sent
    print(f"{scenario}: RunInterrupted {latency:.2f} s after SIGINT")
    assert latency < 5.0  # meant to be well under 1 s; generous for a loaded machine
    assert code != 0
    assert report["status"] == "interrupted" and "KeyboardInterrupt" in report["error"]
    assert report["kinds"][0] == "run_started" and report["kinds"][-2:] == ["run_error",
                                                                             "run_finished"]
    assert report["listener_saw"] == ["run_error", "run_finished"]
    assert report["turns"] == 1 and report["response"] > 0
    if scenario != "stream":
        assert "exec_started" in report["kinds"]
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if _alive(pid)], "sandbox processes outlived the run"


ABANDONS = r'''
import time
from agentrt import Agent, ReplayEngine, tool

@tool(timeout=0.3)
def hangs() -> int:
    time.sleep(600)

code = "try:\n    hangs()\nexcept TimeoutError as e:\n    print(e)\nFINAL(1)"
engine = ReplayEngine([f"```repl\n{code}\n```"], tokens_per_second=2000)
result = Agent(engine, tools=[hangs], speculation=False).run_sync("t")
print("DONE", result.status, result.turns[0].output.strip(), flush=True)
'''


def test_an_abandoned_sync_tool_thread_does_not_hold_up_exit(tmp_path):
    """The timed-out call's thread sleeps on; the process exits as soon as the script ends."""
    script = tmp_path / "abandons.py"
    script.write_text(ABANDONS)
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "DONE final hangs() timed out after 0.3 s" in done.stdout
