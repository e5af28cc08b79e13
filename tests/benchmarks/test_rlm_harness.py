"""One OOLONG task under the stock RLM harness, agentrt underneath (benchmarks.oolong.rlm_harness)."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("rlm", reason="the RLM library is not installed (pip install 'agentrt[rlm]')")

from benchmarks.oolong.generate import generate  # noqa: E402
from benchmarks.oolong.rlm_harness import (  # noqa: E402
    ROOT_MODEL,
    rlm_protocol,
    run_rlm_task,
    scripted_root,
)
from benchmarks.oolong.scoring import score  # noqa: E402
from benchmarks.oolong.server import MODEL_NAME, LatencyModel, Oracle, SimulatedSubModel  # noqa: E402

FAST = LatencyModel(prefill_tokens_per_s=1e6, ttft_overhead_s=0.0, decode_tokens_per_s=4000)


def test_rlm_protocol_rewrites_final_lines_only():
    code = 'x = 1\nif x:\n    FINAL("A: " + str(x))\nprint("FINAL(x) stays")\n'
    assert rlm_protocol(code) == ('x = 1\nif x:\n    answer["content"] = "A: " + str(x)\n'
                                  '    answer["ready"] = True\nprint("FINAL(x) stays")\n')


def test_same_answer_under_local_and_agentrt():
    task = generate([1024], 1, seed=5)[0]
    runs = {}
    with SimulatedSubModel(Oracle.from_tasks([task]), FAST) as sub:
        for environment in ("local", "agentrt"):
            with scripted_root(task, "small", tokens_per_second=800) as root:
                runs[environment] = run_rlm_task(
                    task, root_url=root.url, root_model=ROOT_MODEL, sub_url=sub.url,
                    sub_model=MODEL_NAME, environment=environment)
    local, ours = runs["local"], runs["agentrt"]
    assert local.status == ours.status == "final", (local.error, ours.error)
    assert ours.answer == local.answer
    assert score(ours.answer, task.answer, task.answer_type) == 1.0
    assert ours.turns == local.turns == 1
    assert ours.tool_calls == local.tool_calls >= 1
    assert local.early_calls == 0 and len(local.trace) == 0
    record = ours.to_dict()
    kinds = {e["kind"] for e in record["trace"]["events"]}
    assert {"turn_started", "delta", "exec_started", "exec_finished", "tool_finished"} <= kinds
    assert record["stats"]["tool_calls"]["llm_query"] >= 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_root_is_an_error_status_not_an_answer():
    task = generate([1024], 1, seed=5)[0]
    url = f"http://127.0.0.1:{free_port()}"
    run = run_rlm_task(task, root_url=url, root_model=ROOT_MODEL, sub_url=url,
                       sub_model=MODEL_NAME, environment="agentrt")
    assert run.status == "error" and run.answer is None
    assert "Connection" in run.error or "connect" in run.error.lower()
