"""Reference trajectories: the turns a competent RLM-style root writes for an OOLONG task.

Three styles, each a list of assistant turns (prose + one ```repl block) that the replay and
forced-text roots stream in order:

- ``batched`` (RLM style, 4 turns): probe ``context`` (type, length, a few lines); label every
  line with fat prompts through ``llm_query_batched`` (chunks sized as the RLM prompt advises,
  scaled to the context, at most 20 prompts per batch); aggregate in Python and print the
  candidate; ``FINAL``.
- ``loop`` (RLM style, 4 turns): the same turns, with one ``llm_query`` per chunk in a ``for``
  loop instead of the batch.
- ``small`` (1 turn): what small models write: a loop of ``llm_query`` over 100-line chunks, the
  aggregation and ``FINAL`` in one block; ``small-batched``: the same with one
  ``llm_query_batched`` over those chunks.

Every parameter (categories, users, month, date range) comes from the question text
(`questions.parse_question`), so trajectories work on generated, converted and external task
files alike; an unknown question raises `UnknownQuestionError` naming the known kinds.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from .questions import QuestionSpec, parse_question
from .tasks import Task

STYLES = ("batched", "loop", "small", "small-batched")
SHAPE = {"batched": "batched", "loop": "loop", "small": "loop", "small-batched": "batched"}
"""The call shape of each style (how the sub-model calls are written)."""
TURNS = {"batched": 4, "loop": 4, "small": 1, "small-batched": 1}
SMALL_CHUNK = 100
"""Lines per ``llm_query`` in the ``small`` style."""
BATCH_WIDTH = 20
"""Prompts per ``llm_query_batched`` call (the RLM prompt's advice)."""


def _ask(labels: Sequence[str]) -> str:
    return ("Label each line below with exactly one of these categories: "
            + ", ".join(labels)
            + ". Reply with one category per line, in the same order, and nothing else.\\n\\n")


# ------------------------------------------------------------------------------ turns

_PROBE = '''\
Let me look at the context before planning.
```repl
print(len(context), "characters")
lines = context.split("\\n")
print(len(lines), "lines")
for line in lines[:5]:
    print(line[:200])
print("...")
for line in lines[-3:]:
    print(line[:200])
```
'''

_CHUNKS = '''\
records = [l for l in lines if l.startswith("Date:")]
chunk_chars = min(100000, max(8000, len(context) // 20))
chunks, current, size = [], [], 0
for line in records:
    if current and size + len(line) > chunk_chars:
        chunks.append(current)
        current, size = [], 0
    current.append(line)
    size += len(line) + 1
if current:
    chunks.append(current)
ask = "{ask}"
prompts = [ask + "\\n".join(chunk) for chunk in chunks]
print(len(records), "records in", len(prompts), "prompts")
'''

_BATCHED_CALLS = '''\
answers = []
for i in range(0, len(prompts), {width}):
    answers += llm_query_batched(prompts[i:i + {width}])
'''

_LOOP_CALLS = '''\
answers = []
for prompt in prompts:
    answers.append(llm_query(prompt))
'''

_COLLECT = '''\
labels = []
for chunk, answer in zip(chunks, answers):
    got = [a.strip().lower() for a in answer.strip().split("\\n") if a.strip()]
    labels += got[:len(chunk)] + ["unknown"] * (len(chunk) - len(got))
counts = {{}}
for label in labels:
    counts[label] = counts.get(label, 0) + 1
print(len(labels), "labels; counts:", counts)
'''

_ROWS = '''\
rows = []
for line, label in zip(records, labels):
    date, user, _ = line.split(" || ", 2)
    rows.append((date[len("Date: "):].strip(), user[len("User: "):].strip(), label))
'''

_SMALL_HEAD = '''\
records = [l for l in context.split("\\n") if l.startswith("Date:")]
ask = "{ask}"
labels = []
for i in range(0, len(records), {chunk}):
    reply = llm_query(ask + "\\n".join(records[i:i + {chunk}]))
    labels += [a.strip().lower() for a in reply.strip().split("\\n") if a.strip()]
'''

_SMALL_BATCHED_HEAD = '''\
records = [l for l in context.split("\\n") if l.startswith("Date:")]
ask = "{ask}"
prompts = [ask + "\\n".join(records[i:i + {chunk}]) for i in range(0, len(records), {chunk})]
replies = llm_query_batched(prompts)
labels = [a.strip().lower() for r in replies for a in r.strip().split("\\n") if a.strip()]
'''

_DAY = '''\
import datetime
names = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
def day(text):
    month, d, year = text.replace(",", "").split()
    return datetime.date(int(year), names.index(month[:3]) + 1, int(d))
'''


def _month_counts(a: str, b: str) -> str:
    return _DAY + (
        "per_month = {}\n"
        "for date, user, label in rows:\n"
        "    d = day(date)\n"
        "    key = (d.year, d.month)\n"
        "    x, y = per_month.get(key, (0, 0))\n"
        f'    per_month[key] = (x + (label == "{a}"), y + (label == "{b}"))\n'
    )


def aggregate(spec: QuestionSpec) -> str:
    """Python that computes ``answer`` (the final answer string, in the question's form) from
    ``labels`` and ``rows`` (``(date, user, label)`` per line)."""
    k, labels = spec.kind, list(spec.labels)
    if k in ("most_common_label", "least_common_label"):
        pick = "max" if k == "most_common_label" else "min"
        return ("counts = {c: 0 for c in %r}\n" % (list(spec.label_set),)
                + "for label in labels:\n"
                "    if label in counts:\n"
                "        counts[label] = counts[label] + 1\n"
                f'answer = "Label: " + {pick}(counts, key=counts.get)\n')
    if k == "label_vs_label":
        a, b = labels[:2]
        return (f'a = labels.count("{a}")\n'
                f'b = labels.count("{b}")\n'
                'relation = "more common than" if a > b else "less common than" if a < b '
                'else "same frequency as"\n'
                f'answer = "Answer: {a} is " + relation + " {b}"\n')
    if k == "label_count":
        return f'answer = "Answer: " + str(labels.count("{labels[0]}"))\n'
    if k in ("most_active_user", "user_most_label"):
        count = "    counts[user] = counts.get(user, 0) + 1\n"
        if k == "user_most_label":
            count = f'    if label == "{labels[0]}":\n    ' + count
        return ("counts = {}\n"
                "for date, user, label in rows:\n" + count
                + 'answer = "User: " + max(counts, key=counts.get)\n')
    if k == "label_count_in_users":
        users = ", ".join(f'"{u}"' for u in spec.users)
        return (f"users = [{users}]\n"
                f'count = sum(1 for d, u, l in rows if l == "{labels[0]}" and u in users)\n'
                'answer = "Answer: " + str(count)\n')
    if k == "most_common_date":
        return ("counts = {}\n"
                "for date, user, label in rows:\n"
                "    counts[date] = counts.get(date, 0) + 1\n"
                'answer = "Date: " + max(counts, key=counts.get)\n')
    if k == "label_count_in_month":
        year, month = spec.month
        return (_DAY + f'count = sum(1 for d, u, l in rows if l == "{labels[0]}" '
                f"and (day(d).year, day(d).month) == ({year}, {month}))\n"
                'answer = "Answer: " + str(count)\n')
    if k == "label_count_in_range":
        lo, hi = spec.date_range
        return (_DAY + f'lo, hi = day("{lo}"), day("{hi}")\n'
                f'count = sum(1 for d, u, l in rows if l == "{labels[0]}" '
                "and lo <= day(d) <= hi)\n"
                'answer = "Answer: " + str(count)\n')
    if k == "months_a_beats_b":
        return (_month_counts(*labels[:2])
                + "count = sum(1 for x, y in per_month.values() if x > y)\n"
                'answer = "Answer: " + str(count)\n')
    if k == "first_month_a_beats_b":
        return (_month_counts(*labels[:2])
                + "year, month = min(k for k, (x, y) in per_month.items() if x > y)\n"
                'answer = "Month: " + names[month - 1] + " " + str(year)\n')
    raise AssertionError(f"no aggregation for {k!r}")  # parse_question knows no other kinds


def _needs_rows(spec: QuestionSpec) -> bool:
    return spec.kind not in ("most_common_label", "least_common_label", "label_vs_label",
                             "label_count")


def _fence(prose: str, code: str) -> str:
    return f"{prose}\n```repl\n{code}```\n"


def trajectory(task: Task, style: str) -> list[str]:
    """The assistant turns of ``style`` for ``task``'s question."""
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; choose from {', '.join(STYLES)}")
    spec = parse_question(task.question, getattr(task, 'labels', None), kind=task.task)  # SHIM
    ask = _ask(spec.label_set)
    rows = _ROWS if _needs_rows(spec) else ""
    if style in ("small", "small-batched"):
        head = _SMALL_HEAD if style == "small" else _SMALL_BATCHED_HEAD
        code = head.format(ask=ask, chunk=SMALL_CHUNK) + rows + aggregate(spec) + "FINAL(answer)\n"
        return [_fence("I will ask the sub-model for the category of every line, "
                       f"{SMALL_CHUNK} lines at a time, then count in Python.", code)]
    calls = (_BATCHED_CALLS.format(width=BATCH_WIDTH) if style == "batched" else _LOOP_CALLS)
    how = ("in batches of fat prompts with llm_query_batched" if style == "batched"
           else "one llm_query per chunk")
    return [
        _PROBE,
        _fence("Each record has a date, a user and a question whose category is not given, so "
               "the sub-model has to label them. Plan: (1) split the records into chunks of "
               f"about 100K characters at most and label every line, {how}; (2) compute the "
               "answer from the labels in Python and print it; (3) submit it.",
               _CHUNKS.format(ask=ask) + calls + _COLLECT.format()),
        _fence("Every record has a label. Now the answer to the query.",
               rows + aggregate(spec) + "print(answer)\n"),
        _fence("The answer above is in the requested form; submitting it.", "FINAL(answer)\n"),
    ]


def shape_of(code: str) -> str:
    """Which call shape a program uses (for reports on live runs)."""
    if "llm_query_batched" in code:
        return "batched"
    if re.search(r"\[[^\]\n]*llm_query\([^\n]*\bfor\b", code):
        return "comprehension"
    if re.search(r"^\s*for\b[^\n]*:\s*\n(?:\s+[^\n]*\n)*?\s+[^\n]*llm_query\(", code, re.M):
        return "loop"
    return "single" if "llm_query(" in code else "none"
