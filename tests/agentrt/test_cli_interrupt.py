"""Ctrl-C in `agentrt run`, in a real subprocess: one line on stderr (no traceback), exit status
130, and no sandbox process left behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from child_signals import default_sigint
from test_faults_sigint import _alive, _descendants, _lines, _next_line

ROOT = Path(__file__).resolve().parents[2]

TOOLS = '''
from agentrt import tool

@tool
def marker() -> int:
    print("MARK cell", flush=True)
    return 1
'''


def test_ctrl_c_in_agentrt_run_exits_130_without_a_traceback(tmp_path):
    (tmp_path / "cli_marker_tools.py").write_text(TOOLS)
    replay = tmp_path / "replay.json"
    replay.write_text(json.dumps(["```repl\nmarker()\nwhile True:\n    pass\n```"]))
    env = {**__import__("os").environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    child = subprocess.Popen(
        [sys.executable, "-m", "agentrt.cli", "run", "t", "--engine", "replay", "--replay-file",
         str(replay), "--tokens-per-second", "2000", "--tools", "cli_marker_tools"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=default_sigint)
    try:
        _next_line(_lines(child.stdout), "MARK", timeout=120)
        workers = _descendants(child.pid)
        child.send_signal(signal.SIGINT)
        rc = child.wait(timeout=60)
        stderr = child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
    assert rc == 130, stderr
    assert "agentrt: interrupted (Ctrl-C)" in stderr
    assert "Traceback" not in stderr, stderr
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in workers if _alive(p)]
