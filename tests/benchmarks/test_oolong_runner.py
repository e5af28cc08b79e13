"""The OOLONG runner end to end (replay root, simulated sub-model), and the SDK path of the CLI."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.oolong import bench

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--engine", "replay", "--replay-plain-tps", "600", "--replay-spec-tps", "1200",
        "--sub-decode-tps", "3000", "--no-plot"]


def test_replay_run_writes_traces_summary_and_resumes(tmp_path, capsys):
    out = tmp_path / "res"
    args = ["--sizes", "1k", "--per-size", "2", "--seed", "2", "--out", str(out), *FAST]
    assert bench.main(args) == 0
    traces = sorted((out / "traces").glob("*.json"))
    assert len(traces) == 8
    summary = json.loads((out / "summary.json").read_text())
    assert summary["identical"] == summary["compared"] == 2
    assert set(summary["modes"]) == set(bench.MODES)
    assert all(row["score"] == 1.0 for row in summary["modes"].values())
    spec = summary["modes"]["speculative+plain"]
    assert spec["limit_s"] is not None and spec["efficiency"] > 0
    assert "| speculative+specdec |" in (out / "summary.md").read_text()
    record = json.loads(traces[0].read_text())
    assert record["status"] == "final" and record["trace"]["events"]
    # an interrupted run: one trace lost; --resume runs only that one
    kept = {p.name: p.stat().st_mtime_ns for p in traces}
    traces[3].unlink()
    assert bench.main([*args, "--resume"]) == 0
    again = {p.name: p.stat().st_mtime_ns for p in (out / "traces").glob("*.json")}
    assert set(again) == set(kept)
    changed = [name for name in again if again[name] != kept.get(name)]
    assert changed == [traces[3].name]


def test_malformed_task_file_and_unreachable_sub_model(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "context": "c", "question": "q", "answer": 1}\n')
    assert bench.main(["--tasks", str(bad), "--out", str(tmp_path / "o"), *FAST]) == 2
    assert "line 1: field 'answer_type' is missing" in capsys.readouterr().err
    url = "http://127.0.0.1:9/v1"
    assert bench.main(["--sizes", "1k", "--per-size", "1", "--sub-base-url", url,
                       "--out", str(tmp_path / "o"), *FAST]) == 2
    assert f"sub-model unreachable at {url}" in capsys.readouterr().err
    assert not list((tmp_path / "o" / "traces").glob("*.json"))


TOOLS_MODULE = '''
from agentrt import tool

@tool(speculate=True)
def shout(text: str) -> str:
    """Upper-case a text."""
    return text.upper()
'''


def _cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run([sys.executable, "-m", "agentrt.cli", *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_cli_registers_tools_from_a_module(tmp_path):
    (tmp_path / "mytools.py").write_text(TOOLS_MODULE)
    (tmp_path / "empty.py").write_text("X = 1\n")
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    reply = tmp_path / "reply.json"
    reply.write_text(json.dumps(['```repl\nFINAL(shout("hi"))\n```']))
    done = _cli("run", "say hi", "--engine", "replay", "--replay-file", str(reply),
                "--tokens-per-second", "500", "--tools", "mytools", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "answer: 'HI'" in done.stdout
    for module, message in (("empty", "defines no tools"), ("broken", "RuntimeError: boom"),
                            ("nowhere", "cannot import tools module 'nowhere'")):
        done = _cli("run", "x", "--engine", "replay", "--replay-file", str(reply),
                    "--tools", module, cwd=tmp_path)
        assert done.returncode == 2 and message in done.stderr


def test_tools_package_does_not_import_the_engine():
    code = ("import sys, agentrt.tools; "
            "print(any(m.startswith('agentrt.engine') for m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.stdout.strip() == "False", done.stderr


def test_openai_root_engine_through_the_same_runner(tmp_path):
    """``--engine openai`` against a server on loopback that streams the reference program."""
    from agentrt.engine.replay import split_tokens
    from benchmarks.oolong.generate import generate
    from benchmarks.oolong.programs import reference_response, shape_for
    from fake_openai_server import FakeOpenAIServer, Stream

    (task,) = generate([1024], 1, seed=9)
    program = split_tokens(reference_response(task, shape_for(0)))
    with FakeOpenAIServer() as root:
        # warm-up, the task's prompt prefilled once, then the four modes
        root.push(Stream(["Hi"]), Stream(["x"]), *[Stream(program) for _ in bench.MODES])
        code = bench.main(["--sizes", "1k", "--per-size", "1", "--seed", "9", "--engine", "openai",
                           "--base-url", f"{root.url}/v1", "--model", "served",
                           "--out", str(tmp_path), "--sub-decode-tps", "3000", "--no-plot"])
        bodies = [r.body for r in root.requests]
    assert code == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["identical"] == 1
    assert all(r["score"] == 1.0 for r in summary["modes"].values())
    assert all(b["model"] == "served" for b in bodies) and len(bodies) == 6
    assert bodies[1]["messages"] == bodies[2]["messages"]  # the prefill sent the run's prompt
    assert "Query: " + task.question in bodies[2]["messages"][-1]["content"]


def test_agentrt_bench_runs_the_runner_from_the_repository():
    done = subprocess.run([sys.executable, "-m", "agentrt.cli", "bench", "oolong", "--help"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--sub-base-url" in done.stdout


def test_interrupted_run_keeps_finished_traces_and_resumes(tmp_path):
    """Ctrl-C in the middle of a run: finished traces stay, the server stops, --resume finishes."""
    import signal
    import time

    out = tmp_path / "res"
    cmd = [sys.executable, "-m", "benchmarks.run", "oolong", "--sizes", "1k", "--per-size", "2",
           "--out", str(out), "--engine", "replay", "--replay-plain-tps", "200",
           "--modes", "sequential+plain,speculative+plain", "--sub-decode-tps", "3000",
           "--no-plot"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 90
    while not list((out / "traces").glob("*.json")) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    kept = sorted(p.name for p in (out / "traces").glob("*.json"))
    assert 1 <= len(kept) < 4 and "rerun with --resume" in err
    assert not list((out / "traces").glob("*.tmp"))
    done = subprocess.run([*cmd, "--resume"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(list((out / "traces").glob("*.json"))) == 4
    summary = json.loads((out / "summary.json").read_text())
    assert summary["identical"] == summary["compared"] == 2


@pytest.mark.slow
def test_native_sub_model_serves_llm_query(tmp_path):
    """``--sub native``: SmolLM2 through NativeEngine answers the calls (one at a time)."""
    out = tmp_path / "res"
    assert bench.main(["--sizes", "1k", "--per-size", "1", "--sub", "native", "--sub-max-tokens",
                       "16", "--modes", "sequential+plain,speculative+plain", "--out", str(out),
                       "--engine", "replay", "--replay-plain-tps", "300", "--no-plot"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["identical"] == summary["compared"] == 1
    record = json.loads(next((out / "traces").glob("*sequential+plain.json")).read_text())
    assert record["status"] in ("final", "max_turns") and sum(record["stats"]["tool_calls"].values())


def test_task_file_and_a_standalone_sub_model_server(tmp_path):
    """The generator's CLI writes a task file; the server runs alone; the runner uses both."""
    tasks = tmp_path / "tasks.jsonl"
    made = subprocess.run([sys.executable, "-m", "benchmarks.oolong.generate", "--sizes", "1k",
                           "--per-size", "1", "--seed", "4", "--out", str(tasks)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert made.returncode == 0 and "wrote 1 tasks" in made.stdout
    server = subprocess.Popen([sys.executable, "-m", "benchmarks.oolong.server", "--tasks",
                               str(tasks), "--port", "0", "--sub-decode-tps", "3000"],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().split()[-1]
        out = tmp_path / "res"
        assert bench.main(["--tasks", str(tasks), "--sub-base-url", f"{url}/v1", "--out",
                           str(out), "--engine", "replay", "--replay-plain-tps", "600",
                           "--replay-spec-tps", "1200", "--no-plot"]) == 0
    finally:
        server.terminate()
        server.wait(timeout=10)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["identical"] == 1
    assert all(r["score"] == 1.0 for r in summary["modes"].values())
    assert "sub-model url" in summary["setting"]
