"""The OOLONG runner end to end (replay and served roots, simulated sub-model), its accounting
rules, and the SDK path of the CLI."""

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from benchmarks.oolong import bench
from benchmarks.oolong.generate import generate
from benchmarks.oolong.root_prompt import LeakError, check_no_leak, few_shot, task_message
from benchmarks.oolong.server import Oracle, SimulatedSubModel
from benchmarks.oolong.summary import bootstrap_ci, summarise
from benchmarks.oolong.tasks import save_tasks
from benchmarks.oolong.trajectories import trajectory
from child_signals import default_sigint

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--engine", "replay", "--root-tps", "2000", "--sub-decode-tps", "3000", "--no-plot"]


def _records(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in _record_paths(out)]


def _record_paths(out: Path) -> list[Path]:
    return sorted(p for p in (out / "traces").rglob("*.json") if ".perfetto" not in p.name)


def test_replay_run_repeats_rotates_modes_and_resumes(tmp_path):
    out = tmp_path / "res"
    args = ["--sizes", "1k", "--per-size", "2", "--seed", "2", "--repeats", "2",
            "--out", str(out), *FAST]
    assert bench.main(args) == 0
    records = _records(out)
    assert len(records) == 2 * 2 * 2  # tasks x modes x repeats
    summary = json.loads((out / "summary.json").read_text())
    (setting,) = summary["settings"]
    assert setting["identical"] == setting["compared"] == 2
    assert set(setting["modes"]) == {"sequential+replay", "speculative+replay"}
    spec = setting["modes"]["speculative+replay"]
    assert spec["failed"] == 0 and spec["runs"] == 4 and spec["tasks"] == 2
    assert spec["ci"] is not None and spec["ci"][0] <= spec["speedup"] <= spec["ci"][1]
    assert all(r["score"] == 1.0 and r["status"] == "final" for r in records)
    # the mode that runs first changes with the task and the repeat
    firsts = set()
    for task in {r["task"] for r in records}:
        for repeat in (0, 1):
            runs = [r for r in records if r["task"] == task and r["repeat"] == repeat]
            firsts.add(min(runs, key=lambda r: r["started"])["mode"])
    assert firsts == {"sequential+replay", "speculative+replay"}
    # every run also has a Chrome trace-event file
    chrome = json.loads(_record_paths(out)[0].with_suffix("").with_suffix(
        ".perfetto.json").read_text())
    assert chrome["traceEvents"] and all("ph" in e for e in chrome["traceEvents"])
    # an interrupted run: one record lost; --resume runs only that one
    paths = _record_paths(out)
    kept = {p: p.stat().st_mtime_ns for p in paths}
    paths[3].unlink()
    assert bench.main([*args, "--resume"]) == 0
    changed = [p for p in _record_paths(out) if p.stat().st_mtime_ns != kept[p]]
    assert changed == [paths[3]]


def test_settings_for_concurrency_levels_and_root_speeds(tmp_path):
    out = tmp_path / "res"
    assert bench.main(["--sizes", "1k", "--per-size", "2", "--repeats", "1",
                       "--concurrent-tasks", "1,2", "--out", str(out), *FAST[:2],
                       "--root-tps", "1000,3000", "--sub-decode-tps", "3000"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert [(s["concurrency"], s["root_tps"]) for s in summary["settings"]] == [
        (1, 1000.0), (1, 3000.0), (2, 1000.0), (2, 3000.0)]
    assert all(s["identical"] == 2 for s in summary["settings"])
    assert "By setting" in (out / "summary.md").read_text()
    assert (out / "root_speed.png").stat().st_size > 0
    assert (out / "timeline.png").stat().st_size > 0


def test_failed_runs_never_make_a_speedup_or_an_identity(tmp_path, capsys):
    """A root that never reaches FINAL: every run fails, the runner says so and exits 1."""
    from benchmarks.openai_stub import Stream, StubServer

    prose = Stream(["I think ", "the answer ", "is entity."])
    with StubServer() as root:
        root.push(*[prose] * 40)
        code = bench.main(["--sizes", "1k", "--per-size", "1", "--engine", "openai",
                           "--base-url", f"{root.url}/v1", "--repeats", "2", "--max-turns", "2",
                           "--out", str(tmp_path), "--sub-decode-tps", "3000", "--no-plot"])
    assert code == 1
    text = capsys.readouterr()
    assert "No run succeeded" in text.out and "no speedup could be measured" in text.err
    (setting,) = json.loads((tmp_path / "summary.json").read_text())["settings"]
    assert setting["identical"] == 0 and setting["compared"] == 0
    assert all(row["speedup"] is None and row["failed"] == row["runs"] == 2
               for row in setting["modes"].values())
    assert "no FINAL within the turn limit" in next(iter(setting["failures"]))


def _record(task, mode, repeat, wall, status="final", answer="A", calls=(("q", "a", "r", None),)):
    return {"task": task, "mode": mode, "repeat": repeat, "wall_s": wall, "status": status,
            "error": "boom" if status == "error" else None, "answer": answer, "score": 1.0,
            "context_tokens": 4096, "shape": "batched", "turns_n": 4, "tau": None,
            "tok_s": None, "stats": {}, "calls": None if calls is None else list(calls),
            "trace": {"events": []}}


def test_accounting_excludes_failed_runs_and_compares_tool_calls():
    modes = ["sequential+plain", "speculative+plain"]
    recs = [
        # t1: both modes fine, identical
        _record("t1", modes[0], 0, 10.0), _record("t1", modes[1], 0, 5.0),
        # t2: speculative failed once: that run is left out; the task is not identical
        _record("t2", modes[0], 0, 8.0), _record("t2", modes[1], 0, 2.0),
        _record("t2", modes[1], 1, 1.0, status="error", answer=None),
        # t3: base mode failed: no speedup for t3 at all
        _record("t3", modes[0], 0, 9.0, status="max_turns", answer=None),
        _record("t3", modes[1], 0, 1.0),
        # t4: same answer, different tool-call results: not identical
        _record("t4", modes[0], 0, 6.0),
        _record("t4", modes[1], 0, 3.0, calls=(("q", "a", "x", None),)),
        # t5: a system that records no tool calls (the peer) is compared by answer only
        _record("t5", modes[0], 0, 4.0), _record("t5", modes[1], 0, 2.0, calls=None),
    ]
    s = summarise(recs, modes, modes[0])
    row = s["modes"][modes[1]]
    assert row["failed"] == 1 and row["runs"] == 6
    assert row["tasks"] == 4  # t1 2x, t2 4x (the failed 1.0 s run is not in it), t4 2x, t5 2x
    assert row["speedup"] == 2.0
    assert s["modes"][modes[0]]["failed"] == 1
    assert s["identical"] == 2 and s["compared"] == 3
    assert [d["task"] for d in s["differing"]] == ["t4"]
    assert "tool calls differ from call 0" in s["differing"][0]["why"]
    assert {d["task"] for d in s["incomplete"]} == {"t2", "t3"}
    assert sum(s["failures"].values()) == 2


def test_bootstrap_interval_contains_the_median_and_narrows_with_agreement():
    agree = [([10.0, 10.2], [5.0, 5.1])] * 6
    spread = [([10.0], [w]) for w in (2.0, 4.0, 5.0, 8.0, 10.0, 20.0)]
    lo, hi = bootstrap_ci(agree)
    assert lo <= 2.0 <= hi and hi - lo < 0.1
    lo2, hi2 = bootstrap_ci(spread)
    assert hi2 - lo2 > 1.0 and lo2 < 2.0 < hi2
    assert bootstrap_ci([]) is None


def test_few_shot_examples_are_other_question_types_and_leaks_are_refused():
    tasks = generate([1024], 4, seed=5)
    for t in tasks:
        shots = few_shot(t, "batched", 2)
        asked = [m["content"] for m in shots if m["role"] == "user"]
        assert len(asked) == 2 and task_message(t.question) not in asked
        assert all("llm_query_batched" not in m["content"] for m in shots
                   if m["role"] == "assistant")  # the other call shape than 'batched'
    check_no_leak(tasks, {t.id: few_shot(t, "loop", 2) for t in tasks})
    leaked = [{"role": "user", "content": task_message(tasks[1].question)}]
    check_no_leak(tasks, {tasks[0].id: leaked})  # another task's question: no leak for tasks[0]
    with pytest.raises(LeakError, match=f"example of task {tasks[1].id} asks its own question"):
        check_no_leak(tasks, {tasks[1].id: leaked})
    program = [{"role": "assistant", "content": trajectory(tasks[2], "small")[0]}]
    with pytest.raises(LeakError, match=f"task {tasks[2].id} holds its reference program"):
        check_no_leak(tasks, {tasks[2].id: program})


def test_served_root_through_the_same_runner(tmp_path):
    """``--engine openai`` against a server on loopback that streams the reference program."""
    from agentrt.engine.replay import split_tokens
    from benchmarks.openai_stub import Stream, StubServer

    (task,) = generate([1024], 1, seed=9)
    (program,) = trajectory(task, "small")
    with StubServer() as root:
        # warm-up, then per mode: the shared prompt prefilled, then the run
        root.push(Stream(["Hi"]), *[s for _ in range(4) for s in (
            Stream(["x"]), Stream(split_tokens(program)))])
        code = bench.main(["--sizes", "1k", "--per-size", "1", "--seed", "9", "--engine",
                           "openai", "--base-url", f"{root.url}/v1", "--model", "served",
                           "--styles", "small", "--repeats", "1", "--out", str(tmp_path),
                           "--sub-decode-tps", "3000", "--no-plot"])
        bodies = [r.body for r in root.requests]
    assert code == 0
    (setting,) = json.loads((tmp_path / "summary.json").read_text())["settings"]
    assert setting["identical"] == 1
    assert all(r["score"] == 1.0 for r in setting["modes"].values())
    assert all(b["model"] == "served" for b in bodies) and len(bodies) == 9
    assert len(bodies[1]["messages"]) == 1  # zero-shot: the system prompt alone is prefilled
    assert "Query: " + task.question in bodies[2]["messages"][-1]["content"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["few_shot"] == 0 and "cannot reset" in summary["isolation"]


def test_rlm_harness_and_the_peer_through_the_runner(tmp_path):
    """``--harness rlm``: the stock RLM library drives the root, its own REPL (``local``, the
    base) beside agentrt's; ``--peer``: spec-ptc on the same trajectories, pace and sub-model."""
    pytest.importorskip("rlm", reason="the RLM library is not installed (pip install 'agentrt[rlm]')")
    out = tmp_path / "rlm"
    assert bench.main(["--sizes", "1k", "--per-size", "2", "--repeats", "1", "--harness", "rlm",
                       "--styles", "batched,small", "--out", str(out), *FAST]) == 0
    (setting,) = json.loads((out / "summary.json").read_text())["settings"]
    assert list(setting["modes"]) == ["local+replay", "sequential+replay", "speculative+replay"]
    assert all(row["failed"] == 0 for row in setting["modes"].values())
    assert setting["identical"] == setting["compared"] == 2
    records = _records(out)
    assert all(r["calls"] for r in records)  # every environment's sub-calls, from RLM's own log
    from benchmarks.peer import PeerUnavailable, peer_python

    try:
        peer_python()
    except PeerUnavailable as exc:
        pytest.skip(str(exc))
    out = tmp_path / "peer"
    assert bench.main(["--sizes", "1k", "--per-size", "1", "--repeats", "1", "--peer",
                       "--styles", "batched", "--out", str(out), *FAST]) == 0
    (setting,) = json.loads((out / "summary.json").read_text())["settings"]
    assert setting["modes"]["spec-ptc+replay"]["failed"] == 0
    assert setting["identical"] == setting["compared"] == 1


def test_harness_and_peer_need_an_http_or_replayed_root(tmp_path, capsys):
    assert bench.main(["--harness", "rlm", "--engine", "forced", "--out", str(tmp_path)]) == 2
    assert "--harness rlm needs an HTTP root" in capsys.readouterr().err
    assert bench.main(["--peer", "--engine", "forced", "--out", str(tmp_path)]) == 2
    assert "use --engine replay" in capsys.readouterr().err


def test_malformed_task_file_and_unreachable_sub_model(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "context": "c", "question": "q", "answer": 1}\n')
    assert bench.main(["--tasks", str(bad), "--out", str(tmp_path / "o"), *FAST]) == 2
    assert "line 1: field 'answer_type' is missing" in capsys.readouterr().err
    url = "http://127.0.0.1:9/v1"
    assert bench.main(["--sizes", "1k", "--per-size", "1", "--sub-base-url", url,
                       "--out", str(tmp_path / "o"), *FAST]) == 2
    assert f"sub-model unreachable at {url}" in capsys.readouterr().err
    assert not list((tmp_path / "o").rglob("*__r0.json"))


class GatedSubModel(SimulatedSubModel):
    """The simulated sub-model, whose requests wait while the gate is closed."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.open = threading.Event()
        self.open.set()
        self.waiting = threading.Event()

    def serve(self, prompt, max_tokens, emit):
        if not self.open.is_set():
            self.waiting.set()
            self.open.wait()
        return super().serve(prompt, max_tokens, emit)


def test_interrupted_run_keeps_finished_records_and_resumes(tmp_path):
    """Ctrl-C while a run waits on the sub-model: finished records stay, --resume finishes.

    The sub-model's gate closes once the first record is written, so the signal always lands
    while the runner waits (no race with the clock)."""
    tasks = generate([1024], 2, seed=3)
    tasks_file = save_tasks(tasks, tmp_path / "tasks.jsonl")
    out = tmp_path / "res"
    with GatedSubModel(Oracle.from_tasks(tasks)) as sub:
        cmd = [sys.executable, "-m", "benchmarks.run", "oolong", "--tasks", str(tasks_file),
               "--sub-base-url", f"{sub.url}/v1", "--out", str(out), "--repeats", "1",
               "--styles", "small", *FAST]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                preexec_fn=default_sigint)
        try:
            while not _record_paths(out):
                assert proc.poll() is None, proc.communicate()
                threading.Event().wait(0.05)
            sub.open.clear()
            assert sub.waiting.wait(timeout=120)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=60)
        finally:
            sub.open.set()
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 130, err
        kept = _record_paths(out)
        assert 1 <= len(kept) < 4 and "rerun with --resume" in err
        assert not list((out / "traces").rglob("*.tmp"))
        done = subprocess.run([*cmd, "--resume"], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)
    assert done.returncode == 0, done.stderr
    assert len(_record_paths(out)) == 4
    (setting,) = json.loads((out / "summary.json").read_text())["settings"]
    assert setting["identical"] == setting["compared"] == 2


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


def test_agentrt_bench_runs_the_runner_from_the_repository():
    done = subprocess.run([sys.executable, "-m", "agentrt.cli", "bench", "oolong", "--help"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--sub-base-url" in done.stdout


@pytest.mark.slow
def test_native_sub_model_serves_llm_query(tmp_path):
    """``--sub native``: SmolLM2 through NativeEngine answers the calls."""
    out = tmp_path / "res"
    assert bench.main(["--sizes", "1k", "--per-size", "1", "--sub", "native", "--sub-max-tokens",
                       "16", "--repeats", "1", "--out", str(out), "--styles", "small",
                       *FAST]) in (0, 1)
    records = _records(out)
    assert records and all(sum(r["stats"]["tool_calls"].values()) for r in records)


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
                           str(out), "--repeats", "1", *FAST]) == 0
    finally:
        server.terminate()
        server.wait(timeout=10)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"][0]["identical"] == 1
    assert "sub-model url" in summary["setting"]
