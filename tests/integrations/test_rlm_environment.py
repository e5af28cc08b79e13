"""The RLM library (rlms) with environment="agentrt", against a scripted root on loopback."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("rlm", reason="the RLM library is not installed (pip install 'agentrt[rlm]')")

from rlm import RLM  # noqa: E402
from rlm.logger import RLMLogger  # noqa: E402

from agentrt import tool  # noqa: E402
from agentrt.integrations import rlm as agentrt_rlm  # noqa: E402
from agentrt.integrations.rlm import AgentrtREPL, EarlyCompletion  # noqa: E402
from agentrt.interpreter.repl import ReplLimits  # noqa: E402
from agentrt.trace import Trace  # noqa: E402
from benchmarks.scripted_server import SUB_MODEL, ScriptedServer, WaitForSubCalls  # noqa: E402

CONTEXT = "alpha beta gamma delta epsilon zeta eta theta"

LABEL = """I will ask the sub-model about each word.
```repl
words = context.split()
labels = []
for w in words[:4]:
    labels.append(llm_query("Label the word: " + w))
print(labels[0])
```
"""
FINISH = """```repl
summary = llm_query_batched(["Sum up: " + l for l in labels[:2]])
answer["content"] = " | ".join(labels) + " // " + summary[1]
answer["ready"] = True
```
"""


def sub_rule(prompt: str) -> str:
    return f"<{prompt.rsplit(' ', 1)[-1][:12]}>"


def make_rlm(server: ScriptedServer, environment: str, **extra) -> RLM:
    return RLM(
        backend="openai",
        backend_kwargs={"model_name": server.root_model, "base_url": server.base_url,
                        "api_key": "k"},
        other_backends=["openai"],
        other_backend_kwargs=[{"model_name": SUB_MODEL, "base_url": server.base_url,
                               "api_key": "k"}],
        environment=environment, max_iterations=4, logger=RLMLogger(), **extra)


def blocks(completion) -> list[dict]:
    """Every executed block's result, from the RLM's own log."""
    return [cb["result"] for it in completion.metadata["iterations"] for cb in it["code_blocks"]]


def outputs(completion) -> list[tuple[str, bool]]:
    return [(r["stdout"], bool(r["stderr"])) for r in blocks(completion)]


def test_registered_name_and_unregister():
    import rlm.environments as envs

    env = envs.get_environment("agentrt", {"context_payload": "x"})
    try:
        assert isinstance(env, AgentrtREPL)
    finally:
        env.cleanup()
    agentrt_rlm.unregister()
    try:
        with pytest.raises(ValueError, match="Unknown environment"):
            envs.get_environment("agentrt", {})
    finally:
        agentrt_rlm.register()


def test_same_answer_as_local_and_early_calls_while_the_root_streams():
    # The root's stream stops after the first block until 4 sub-model requests have arrived:
    # only calls started while the root is still streaming can arrive then.
    script = [[LABEL, WaitForSubCalls(4, timeout_s=20), "Let me look at the output.\n"], FINISH]
    with ScriptedServer(script, sub=sub_rule, tokens_per_second=400, sub_latency_s=0.05) as server:
        local = make_rlm(server, "local").completion(CONTEXT, root_prompt="Label the words.")
        trace = Trace()
        ours = make_rlm(server, "agentrt", environment_kwargs={"trace": trace}).completion(
            CONTEXT, root_prompt="Label the words.")
    assert local.response == "<alpha> | <beta> | <gamma> | <delta> // <<beta>>"
    assert ours.response == local.response
    assert outputs(ours) == outputs(local)
    assert [w.satisfied for w in server.waits] == [True]
    first_block = blocks(ours)[0]
    assert [c.get("agentrt", {}).get("early") for c in first_block["rlm_calls"]] == [True] * 4
    launches = trace.of("spec_launch")
    first_exec = trace.of("exec_started")[0].t
    assert len([e for e in launches if e.t < first_exec]) >= 4


def test_a_block_run_whole_without_the_hook_fans_its_calls_out():
    # probe(0) returns only once three probes have started: the other two must have been
    # started early, by the shadow, while the real run was still at probe(0).
    started: list[int] = []
    cond = threading.Condition()

    @tool(speculate=True)
    def probe(i: int) -> int:
        """Square, slowly."""
        with cond:
            started.append(i)
            cond.notify_all()
            if i == 0:
                cond.wait_for(lambda: len(started) >= 3, timeout=30)
        return i * i

    env = AgentrtREPL(context_payload=CONTEXT, custom_tools={"probe": probe})
    try:
        result = env.execute_code("xs = [probe(i) for i in range(3)]\nprint(xs)")
    finally:
        env.cleanup()
    assert result.stdout == "[0, 1, 4]\n"
    assert sorted(started) == [0, 1, 2]
    assert env.stats.hits >= 2


def test_custom_tools_and_speculation_off_match_local():
    calls: list[str] = []

    @tool(speculate=True)
    def lookup(word: str) -> int:
        """Length of a word."""
        return len(word)

    def record(note: str) -> str:
        calls.append(note)
        return f"noted {note}"

    code = """```repl
sizes = {w: lookup(w) for w in context.split()[:3]}
receipt = record(str(sorted(sizes.values())))
print(UNIT, receipt)
answer["content"] = str(sizes) + " " + UNIT
answer["ready"] = True
```
"""
    tools = {"lookup": lookup, "record": {"tool": record, "description": "Keep a note."},
             "UNIT": "chars"}
    answers = {}
    with ScriptedServer([code], sub=sub_rule, tokens_per_second=2000) as server:
        for env, kwargs in (("local", {}), ("agentrt", {}),
                            ("agentrt", {"environment_kwargs": {"speculation": False}})):
            out = make_rlm(server, env, custom_tools=tools, **kwargs).completion(CONTEXT)
            answers[(env, bool(kwargs))] = (out.response, tuple(outputs(out)))
    assert len(set(answers.values())) == 1, answers
    assert answers[("local", False)][0] == "{'alpha': 5, 'beta': 4, 'gamma': 5} chars"
    assert calls == ["[4, 5, 5]"] * 3  # the effectful tool ran once per run, never early


def test_failed_cell_keeps_no_assignment_and_rebinding_is_dropped_as_in_local():
    first = """```repl
kept = 1
```
```repl
lost = 2
llm_query = "shadowed"
context = "changed"
boom = 1 / 0
```
```repl
context = "rebound"
print(len(context), kept, "lost" in SHOW_VARS())
```
"""
    final = """```repl
try:
    lost
except NameError as e:
    print("NameError")
answer["content"] = llm_query("q")[:5] + " " + context[:5]
answer["ready"] = True
```
"""
    results = {}
    with ScriptedServer([first, final], sub=sub_rule, tokens_per_second=2000) as server:
        for env in ("local", "agentrt"):
            out = make_rlm(server, env).completion(CONTEXT)
            results[env] = (out.response, [s for s, _ in outputs(out)],
                            [e for _, e in outputs(out)])
    assert results["agentrt"] == results["local"]
    assert results["local"][0] == "<q> alpha"


def test_hostile_cells_stay_contained(tmp_path):
    marker = tmp_path / "marker.txt"
    marker.write_text("untouched")
    hostile = f"""```repl
try:
    open({str(marker)!r}, "w").write("owned")
except Exception:
    print("open was refused")
```
```repl
import os
os.system("echo owned > {marker}")
```
```repl
print(().__class__.__base__.__subclasses__())
```
```repl
while True:
    pass
```
"""
    final = """```repl
answer["content"] = "still here: " + context[:5]
answer["ready"] = True
```
"""
    with ScriptedServer([hostile, final], sub=sub_rule, tokens_per_second=4000) as server:
        out = make_rlm(server, "agentrt", environment_kwargs={
            "repl_limits": ReplLimits(cpu_s=1, wall_s=20)}).completion(CONTEXT)
    results = blocks(out)
    assert out.response == "still here: alpha"
    assert results[0]["stdout"] == "open was refused\n"
    assert "ImportError" in results[1]["stderr"]
    assert "__class__" in results[2]["stderr"] or "not accessible" in results[2]["stderr"]
    assert "TimeoutError" in results[3]["stderr"]
    assert marker.read_text() == "untouched"


def test_persistent_rlm_keeps_the_namespace_and_versions_contexts():
    turn1 = """```repl
seen = [context_0[:5]]
answer["content"] = str(seen)
answer["ready"] = True
```
"""
    turn2 = """```repl
seen.append(context_1[:5])
answer["content"] = str(seen) + " " + context[:5]
answer["ready"] = True
```
"""
    with ScriptedServer([turn1, turn2], tokens_per_second=4000) as server:
        def root(messages):
            return turn2 if "TASK-TWO" in str(messages) else turn1
        server.root = root
        answers = {}
        for env in ("local", "agentrt"):
            rlm = make_rlm(server, env, persistent=True)
            try:
                a = rlm.completion("first ctx", root_prompt="TASK-ONE").response
                b = rlm.completion("second ctx", root_prompt="TASK-TWO").response
            finally:
                rlm.close()
            answers[env] = (a, b)
    assert answers["agentrt"] == answers["local"] == (
        "['first']", "['first', 'secon'] first")


def test_early_completion_is_logged_with_its_timing():
    from rlm.core.types import RLMChatCompletion, UsageSummary

    plain = RLMChatCompletion("m", "p", "r", UsageSummary({}), 0.1)
    early = EarlyCompletion.of(plain, {"hidden_s": 0.25})
    assert early.response == "r" and early.metadata is None
    assert early.to_dict() == {**plain.to_dict(), "agentrt": {"early": True, "hidden_s": 0.25}}


def test_a_sandbox_that_cannot_start_is_a_clear_error():
    from agentrt.interpreter.repl import ReplError

    env = AgentrtREPL(context_payload=CONTEXT,
                      repl_limits=ReplLimits(start_timeout_s=0.001))
    try:
        with pytest.raises(ReplError, match="the agentrt sandbox did not start"):
            env.execute_code("print(1)")
    finally:
        env.cleanup()
    with pytest.raises(RuntimeError, match="cleaned up"):
        env.execute_code("print(1)")


def test_recursive_rlm_query_matches_local():
    parent = """```repl
r = rlm_query("double 21")
answer["content"] = "child said " + r
answer["ready"] = True
```
"""
    child = """```repl
answer["content"] = str(int(context.split()[-1]) * 2)
answer["ready"] = True
```
"""

    def root(messages):  # the child's context is the parent's rlm_query prompt (9 characters)
        return child if "str of 9 total characters" in str(messages[:2]) else parent

    answers = {}
    with ScriptedServer(root=root, tokens_per_second=4000) as server:
        for env in ("local", "agentrt"):
            rlm = RLM(backend="openai", backend_kwargs={
                "model_name": server.root_model, "base_url": server.base_url, "api_key": "k"},
                environment=env, max_depth=2, max_iterations=2)
            answers[env] = rlm.completion("the parent's context").response
    assert answers["agentrt"] == answers["local"] == "child said 42"


def test_compaction_history_as_in_local():
    from rlm.environments.local_repl import LocalREPL

    cells = ["print(len(history))", "history = 'mine'\nprint(history)", "print(history)",
             "print(history[0]['content'])"]
    outputs = {}
    for env in (LocalREPL(compaction=True), AgentrtREPL(compaction=True)):
        try:
            seen = [env.execute_code(cell).stdout for cell in cells[:3]]
            env.append_compaction_entry({"type": "summary", "content": "so far"})
            seen.append(env.execute_code(cells[3]).stdout)
        finally:
            env.cleanup()
        outputs[type(env).__name__] = seen
    assert outputs["AgentrtREPL"] == outputs["LocalREPL"] == ["0\n", "mine\n", "[]\n",
                                                              "so far\n"]


def test_custom_tools_keep_their_effect_scopes():
    from agentrt.integrations.rlm_tools import custom_tool
    from agentrt.tools.scopes import ALL_SCOPES

    def fn(x: int = 0) -> int:
        return x

    assert custom_tool("r", tool(fn, speculate=True, reads={"notes"})).reads == {"notes"}
    assert custom_tool("w", tool(fn, writes={"notes"})).writes == {"notes"}
    assert custom_tool("p", tool(fn, speculate=True, pure=True)).pure
    assert custom_tool("q", tool(fn, speculate=True)).reads == ALL_SCOPES
