"""The root agent's prompt: an RLM-style system prompt and few-shot examples.

The system prompt is adapted from the default prompt of the public RLM implementation
(``context`` variable, ``llm_query`` / ``llm_query_batched``, chunk the context and combine the
sub-model's answers in code, ``FINAL``), shortened for a small model. It says nothing about
speculation: it asks for the programs any RLM agent would write.

Few-shot (``--few-shot K``, for live roots): K earlier exchanges about other, small contexts,
each a question of *another type* than the task's, answered by a one-turn reference program in
the *other call shape*; `check_no_leak` refuses any example that shows a task's question or one
of its reference programs. Zero-shot (the RLM-style prompt alone) is the default for served
roots.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from agentrt.engine.base import Message

from .generate import make_question, make_rows
from .questions import ANSWER_TYPE_OF, QUESTION_KINDS
from .tasks import Task
from .trajectories import SHAPE, STYLES, trajectory

SYSTEM_PROMPT = """\
You answer a query about a large context. The context is not in this conversation: it is loaded \
in a Python REPL, and you write code that reads it and asks a sub-model about parts of it. You \
are called again with your code's output until you give a final answer.

The REPL gives you:
1. `context`: the data for the query ({context_desc}). Read it with code; never guess.
2. `llm_query(prompt)`: asks the sub-model one question and returns its reply (a str). The \
sub-model can read a few thousand lines in one prompt.
3. `llm_query_batched(prompts)`: asks several independent questions together and returns the \
replies in order; quicker than one llm_query after another.
4. `print(...)`: shows you values (long output is cut), so let the sub-model read big texts.
Tools:
{tool_lines}

For a large context: split it into chunks, ask the sub-model a precise question about each chunk, \
keep the replies in variables and combine them with Python.

Write code in ```repl blocks. When you know the answer, call FINAL(answer) in your code, in the \
answer form the query asks for.
"""


def example_tasks(task: Task, count: int, seed: int = 7) -> list[Task]:
    """``count`` questions of *other* types than ``task``'s, each about another small generated
    context (never the task's own question type, so an example never holds its program)."""
    others = [k for k in QUESTION_KINDS if k != task.task]
    rng = random.Random(f"{seed}-{task.task}")
    rng.shuffle(others)
    examples: list[Task] = []
    for kind in others:
        if len(examples) == count:
            break
        for attempt in range(50):
            r = random.Random(f"{seed}-{kind}-{attempt}")
            rows = make_rows(r, 1024)
            made = make_question(r, kind, rows, task.labels)
            if made is not None:
                examples.append(Task(id=f"example-{kind}", context="", question=made[0],
                                     answer=made[1], answer_type=ANSWER_TYPE_OF[kind],
                                     task=kind, rows=rows, labels=list(task.labels)))
                break
    return examples


def task_message(question: str) -> str:
    """The user message that carries the query."""
    return f"Write a ```repl code block that answers this query about `context`.\nQuery: {question}"


def example_style(style: str) -> str:
    """The one-turn style of the few-shot programs: the other call shape than ``style``'s."""
    return "small-batched" if SHAPE[style] == "loop" else "small"


def few_shot(task: Task, style: str, count: int) -> list[Message]:
    """``count`` worked exchanges: other question types than the task's, answered by one-turn
    reference programs in the other call shape than ``style``'s."""
    messages: list[Message] = []
    for example in example_tasks(task, count):
        (reply,) = trajectory(example, example_style(style))
        messages += [{"role": "user", "content": task_message(example.question)},
                     {"role": "assistant", "content": reply}]
    return messages


class LeakError(ValueError):
    """A few-shot example would show the model a task's question or its answer program."""


def check_no_leak(tasks: Sequence[Task], examples: dict[str, list[Message]]) -> None:
    """Refuse a task's few-shot turns when one asks the task's own question or shows one of its
    reference programs (any style); the message names the task and the example."""
    for t in tasks:
        programs = {_code(turn): style for style in STYLES for turn in trajectory(t, style)}
        for m in examples.get(t.id, []):
            if m["role"] == "user" and m["content"] == task_message(t.question):
                raise LeakError(f"a few-shot example of task {t.id} asks its own question: "
                                f"{t.question[:120]!r}")
            if m["role"] == "assistant" and _code(m["content"]) in programs:
                raise LeakError(f"a few-shot example of task {t.id} holds its reference program "
                                f"({programs[_code(m['content'])]} style): "
                                f"{m['content'][:120]!r}")


def _code(reply: str) -> str:
    """The code of a reply's ```repl blocks (prose ignored), whitespace-normalised."""
    blocks = re.findall(r"```repl\n(.*?)```", reply, re.S)
    return "\n".join(line.rstrip() for b in blocks for line in b.strip().splitlines())
