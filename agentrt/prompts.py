"""Prompt text for the RLM-style loop: the system prompt, its example exchange, observations."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

SYSTEM_PROMPT = """\
You answer the user's task by writing Python code that runs in a persistent REPL.

How the REPL works:
- Write code in fenced blocks that start with ```repl and end with ```. Each block runs when you
  finish writing it; variables persist between blocks and turns.
- A variable `context` holds the data for the task ({context_desc}). Look at it with code
  instead of guessing; print only what you need (long output is cut).
- `print(...)` output comes back to you as the next message.
- Imports are limited to pure standard-library modules (re, json, math, collections, itertools, ...).
- Tools you can call like ordinary Python functions:
{tool_lines}
- When you know the answer, call FINAL(answer) in a code block, or FINAL_VAR("name") to return
  the value of a variable. You may also write FINAL(answer) as plain text after your last block.
"""


def default_examples(system_prompt: str | None,
                     tool_names: Collection[str]) -> list[dict[str, str]]:
    """The example exchange that comes with the default system prompt (none with a custom one).

    It teaches the REPL format, not any task: a ```repl block that ends with FINAL, an error
    that comes back as the next message and a corrected block, and (when ``llm_query`` is
    registered) a tool called like a function on each item of ``context``. Small models such
    as the embedded default answer in prose without it.
    """
    if system_prompt is not None:
        return []
    failed = "TypeError: unsupported operand type(s) for +: 'int' and 'str'"
    examples = [
        {"role": "user", "content": "What is the mean of the scores in context?"},
        {"role": "assistant", "content": _repl("result = sum(context) / len(context)\n"
                                               "FINAL(result)")},
        {"role": "user", "content": observation([("", failed)], len(failed))},
        {"role": "assistant", "content": _repl("scores = [float(score) for score in context]\n"
                                               "result = sum(scores) / len(scores)\n"
                                               "FINAL(result)")},
    ]
    if "llm_query" in tool_names:
        examples += [
            {"role": "user", "content": "Classify each message in context as positive or "
                                        "negative. Use the llm_query tool."},
            {"role": "assistant", "content": _repl(
                'result = [llm_query("Positive or negative? " + message) for message in context]\n'
                "FINAL(result)")},
        ]
    return examples


def _repl(code: str) -> str:
    return f"```repl\n{code}\n```"


def describe_context(context: Any) -> str:
    """A one-line description of the ``context`` variable for the prompt."""
    if context is None:
        return "None: this task has no context"
    if isinstance(context, str):
        return f"a str of {len(context):,} characters"
    if isinstance(context, (list, tuple)):
        return f"a {type(context).__name__} of {len(context):,} items"
    if isinstance(context, dict):
        keys = ", ".join(repr(k) for k in list(context)[:8])
        more = ", ..." if len(context) > 8 else ""
        return f"a dict with {len(context):,} keys ({keys}{more})"
    return f"a {type(context).__name__}"


def system_prompt(tool_lines: str, context: Any, template: str | None = None) -> str:
    """Fill the system prompt template with the tools' signatures and the context description."""
    lines = "\n".join(f"    {line}" for line in tool_lines.splitlines()) or "    (none)"
    return (template or SYSTEM_PROMPT).format(
        tool_lines=lines, context_desc=describe_context(context)
    )


def observation(blocks: list[tuple[str, str | None]], max_chars: int) -> str:
    """The message that reports what a response's code blocks printed and raised."""
    if not blocks:
        return (
            "No code was run: write code in a ```repl block, or give the answer with FINAL(answer)."
        )
    parts = []
    for i, (stdout, error) in enumerate(blocks, 1):
        body = stdout
        if error:
            body = f"{body}{'' if not body or body.endswith(chr(10)) else chr(10)}{error}"
        parts.append(f"Output of block {i}:\n{truncate(body or '(no output)', max_chars)}")
    return "\n\n".join(parts)


def truncate(text: str, max_chars: int) -> str:
    """Cut ``text`` to ``max_chars``, keeping head and tail, with a note of what was dropped."""
    if len(text) <= max_chars:
        return text
    head = max_chars * 2 // 3
    tail = max_chars - head
    dropped = len(text) - head - tail
    return f"{text[:head]}\n[... {dropped:,} characters truncated ...]\n{text[-tail:]}"
