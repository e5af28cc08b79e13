"""The default prompt's example exchange: when it is sent, what it teaches, and that the small
default model writes ```repl blocks with it on tasks unlike the example."""

from __future__ import annotations

import pytest

from agentrt import Agent, ReplayEngine, tool
from agentrt.prompts import default_examples, observation


def sent_messages(**agent_kw):
    seen = []

    def respond(messages):
        seen.append(messages)
        return "```repl\nFINAL(1)\n```"

    Agent(ReplayEngine(respond, tokens_per_second=1000), **agent_kw).run_sync("the task")
    return seen[0]


def test_default_prompt_comes_with_the_example_exchange():
    messages = sent_messages()
    assert messages[0]["role"] == "system" and messages[-1] == {"role": "user",
                                                                "content": "the task"}
    examples = messages[1:-1]
    assert examples == default_examples(None, ["llm_query", "llm_query_batched"])
    replies = [m["content"] for m in examples if m["role"] == "assistant"]
    assert all(r.startswith("```repl\n") and r.endswith("\n```") and "FINAL(" in r
               for r in replies)
    # the error comes back the way the runtime reports it
    errors = [m["content"] for m in examples if m["role"] == "user" and "Error" in m["content"]]
    assert errors and errors[0] == observation(
        [("", errors[0].split("\n", 1)[1])], 4000)
    assert any("llm_query(" in r for r in replies)


def test_no_default_examples_with_a_custom_prompt_explicit_examples_or_without_llm_query():
    assert len(sent_messages(system_prompt="Tools:\n{tool_lines}\n{context_desc}")) == 2
    assert len(sent_messages(examples=[])) == 2
    mine = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert sent_messages(examples=mine)[1:3] == mine
    plain = sent_messages(builtin_tools=False)[1:-1]
    assert plain and not any("llm_query" in m["content"] for m in plain)


@pytest.fixture(scope="module")
def engine():
    from agentrt.engine import NativeEngine

    engine = NativeEngine(seed=0, drafter=None)
    yield engine
    engine.close()


@tool(speculate=True)
def sentiment(text: str) -> str:
    """'positive' or 'negative'."""
    return "negative" if "broke" in text else "positive"


@pytest.mark.parametrize("task, context, tools", [
    ("Which number in context is the largest?", [4, 17, 9, 23, 5], []),
    ("What is the sentiment of each review in context? Use the sentiment tool.",
     ["Great phone.", "It broke in a day.", "Love it."], [sentiment]),
])
def test_default_model_writes_a_repl_block(engine, task, context, tools):
    """SmolLM2-135M answered these in prose without the example exchange ("No code was run")."""
    from agentrt.engine import SamplingParams

    agent = Agent(engine, tools=tools, max_turns=2, sampling=SamplingParams(max_tokens=120))
    result = agent.run_sync(task, context)
    assert "```repl" in result.turns[0].response, result.turns[0].response
    assert result.turns[0].blocks and result.status == "final", result.turns[0].response
