"""The root agent's prompt: an RLM-style system prompt and few-shot examples.

The system prompt is adapted from the default prompt of the public RLM implementation
(``context`` variable, ``llm_query`` / ``llm_query_batched``, chunk the context and combine the
sub-model's answers in code, ``FINAL``), shortened for a small model. It says nothing about
speculation: it asks for the programs any RLM agent would write.

Few-shot: two earlier exchanges on other, small contexts: questions of the same type with other
parameters, answered by reference programs (`programs.reference_code`) in two call shapes. With
one example SmolLM2-135M copied the chunking but not the aggregation; with two it writes both.
"""

from __future__ import annotations

import random

from agentrt.engine.base import Message

from .generate import QUESTION_TYPES, make_question, make_rows
from .programs import SHAPES, reference_code
from .tasks import Task

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


def example_task(task: Task, seed: int = 7) -> Task:
    """A question of ``task``'s type (question types the generator does not know: the most
    common label) about another, small context, for the few-shot turn."""
    kind = task.task if task.task in QUESTION_TYPES else "most_common_label"
    rng = random.Random(f"{seed}-{kind}-{task.id}")
    for _ in range(50):
        rows = make_rows(random.Random(rng.random()), 1024)
        made = make_question(random.Random(rng.random()), kind, rows)
        if made is not None:
            question, answer = made
            return Task(id="example", context="", question=question, answer=answer,
                        answer_type=QUESTION_TYPES[kind][1], task=kind, rows=rows)
    raise RuntimeError(f"could not make an example question of type {kind!r}")


def task_message(question: str) -> str:
    """The user message that carries the query."""
    return f"Write a ```repl code block that answers this query about `context`.\nQuery: {question}"


def few_shot(task: Task, shape: str) -> list[Message]:
    """Two worked exchanges of the same question type (other contexts, other parameters); the
    last one's program uses call shape ``shape``, the first one the next shape in turn."""
    other = SHAPES[(SHAPES.index(shape) + 1) % len(SHAPES)]
    messages: list[Message] = []
    for k, example_shape in enumerate((other, shape)):
        example = example_task(task, seed=7 + k)
        messages += [
            {"role": "user", "content": task_message(example.question)},
            {"role": "assistant",
             "content": f"```repl\n{reference_code(example, example_shape)}```\n"},
        ]
    return messages
