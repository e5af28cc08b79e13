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

import datetime as dt
import json
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
    """The sub-model instruction, as the body of a Python string literal."""
    text = ("Label each line below with exactly one of these categories: " + ", ".join(labels)
            + ". Reply with one category per line, in the same order, and nothing else.\n\n")
    return json.dumps(text, ensure_ascii=False)[1:-1]


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
for chunk, reply in zip(chunks, answers):
    got = [a.strip() for a in reply.strip().split("\\n") if a.strip()]
    labels += got[:len(chunk)] + ["unknown"] * (len(chunk) - len(got))
counts = {{}}
for label in labels:
    counts[label] = counts.get(label, 0) + 1
print(len(labels), "labels; counts:", counts)
'''

_ROWS = '''\
import datetime
names = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"]
def day(text):
    month, d, year = text.replace(",", "").split()
    return datetime.date(int(year), names.index(month[:3]) + 1, int(d))
rows = []
for line, label in zip(records, labels):
    date, user, _ = line.split(" || ", 2)
    rows.append((day(date[len("Date: "):]), user[len("User: "):].strip(), label))
'''

_SMALL_HEAD = '''\
records = [l for l in context.split("\\n") if l.startswith("Date:")]
ask = "{ask}"
labels = []
for i in range(0, len(records), {chunk}):
    reply = llm_query(ask + "\\n".join(records[i:i + {chunk}]))
    labels += [a.strip() for a in reply.strip().split("\\n") if a.strip()]
'''

_SMALL_BATCHED_HEAD = '''\
records = [l for l in context.split("\\n") if l.startswith("Date:")]
ask = "{ask}"
prompts = [ask + "\\n".join(records[i:i + {chunk}]) for i in range(0, len(records), {chunk})]
replies = llm_query_batched(prompts)
labels = [a.strip() for r in replies for a in r.strip().split("\\n") if a.strip()]
'''

_MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August",
           "September", "October", "November", "December")


def _s(value: str) -> str:
    """A Python string literal."""
    return json.dumps(value, ensure_ascii=False)


def _date(d: dt.date) -> str:
    return f"datetime.date({d.year}, {d.month}, {d.day})"


def _scope(spec: QuestionSpec) -> str:
    """Code that keeps the rows in the question's scope as ``scoped`` (and their labels as
    ``scoped_labels``)."""
    if spec.scope == "all":
        cond = ""
    elif spec.scope == "users":
        cond = f" if u in {list(spec.users)!r}"
    elif spec.scope == "month":
        cond = f" if d.month == {spec.month}"
    else:
        lo, hi = spec.date_range
        cond = f" if {_date(lo)} <= d <= {_date(hi)}"
    if not _needs_rows(spec):
        return "scoped_labels = labels\n"
    return (f"scoped = [(d, u, l) for d, u, l in rows{cond}]\n"
            "scoped_labels = [l for d, u, l in scoped]\n")


def _ranked(key: str, where: str = "") -> str:
    return ("counts = {}\n"
            f"for d, u, l in scoped:\n"
            + (f"    if {where}:\n    " if where else "")
            + f"    counts[{key}] = counts.get({key}, 0) + 1\n"
            f"ranked = sorted(counts, key=counts.get, reverse=True)\n")


def _per_month() -> str:
    return ("per_month = {}\n"
            "for d, u, l in scoped:\n"
            "    month = per_month.get((d.year, d.month)) or {}\n"
            "    month[l] = month.get(l, 0) + 1\n"
            "    per_month[(d.year, d.month)] = month\n")


def aggregate(spec: QuestionSpec, label_set: Sequence[str]) -> str:
    """Python that computes ``final_answer`` (the final answer, in the form the question asks for)
    from ``labels`` (one per record) and ``rows`` (``(date, user, label)``)."""
    k = spec.kind
    a = _s(spec.labels[0]) if spec.labels else None
    b = _s(spec.labels[1]) if len(spec.labels) > 1 else None
    code = _scope(spec)
    if k in ("most_common_label", "least_common_label"):
        pick = "max" if k == "most_common_label" else "min"
        choices = list(spec.labels or label_set)
        return code + (f"counts = {{c: 0 for c in {choices!r}}}\n"
                       "for label in scoped_labels:\n"
                       "    if label in counts:\n"
                       "        counts[label] = counts[label] + 1\n"
                       f'final_answer = "Label: " + {pick}(counts, key=counts.get)\n')
    if k == "label_vs_label":
        return code + (f"x, y = scoped_labels.count({a}), scoped_labels.count({b})\n"
                       'relation = "more common than" if x > y else "less common than" if x < y '
                       'else "same frequency as"\n'
                       f'final_answer = "Answer: " + {a} + " is " + relation + " " + {b}\n')
    if k == "label_count":
        return code + f'final_answer = "Answer: " + str(scoped_labels.count({a}))\n'
    if k in ("most_common_user", "second_most_common_user", "user_most_label"):
        where = f"l == {a}" if k == "user_most_label" else ""
        rank = 1 if k.startswith("second") else 0
        return code + _ranked("u", where) + f'final_answer = "User: " + ranked[{rank}]\n'
    if k == "user_vs_user_label":
        u, v = spec.users
        return code + (f"x = sum(1 for d, u, l in scoped if u == {_s(u)} and l == {a})\n"
                       f"y = sum(1 for d, u, l in scoped if u == {_s(v)} and l == {a})\n"
                       f'final_answer = "User: " + ({_s(u)} if x > y else {_s(v)})\n')
    if k in ("most_common_date", "second_most_common_date"):
        rank = 1 if k.startswith("second") else 0
        return code + _ranked("d") + (
            f"best = ranked[{rank}]\n"
            'final_answer = f"Date: {best.month:02d}/{best.day:02d}/{best.year}"\n')
    if k == "dates_with_count":
        return code + _ranked("d") + (
            f'final_answer = "Answer: " + str(sum(1 for n in counts.values() if n == {spec.count}))\n')
    if k == "label_before_after":
        return code + (f"cut = {_date(spec.date)}\n"
                       "before = [l for d, u, l in scoped if d < cut]\n"
                       "after = [l for d, u, l in scoped if d > cut]\n"
                       f"x = before.count({a}) * len(after)\n"
                       f"y = after.count({a}) * len(before)\n"
                       'relation = "more common" if x > y else "less common" if x < y '
                       'else "the same frequency"\n'
                       f'final_answer = "Answer: " + {a} + " is " + relation + " before '
                       f'{spec.date.isoformat()}"\n')
    code += _per_month()
    if k == "first_month_a_beats_b":
        return code + (f"year, month = min(m for m, c in per_month.items() "
                       f"if c.get({a}, 0) > c.get({b}, 0))\n"
                       f"month_names = {list(_MONTHS)!r}\n"
                       'final_answer = "Answer: " + month_names[month - 1] + " " + str(year)\n')
    if k == "months_a_beats_b":
        return code + (f"count = sum(1 for c in per_month.values() if c.get({a}, 0) > c.get({b}, 0))\n"
                       'final_answer = "Answer: " + str(count)\n')
    if k == "months_label_most_common":
        return code + (f"count = sum(1 for c in per_month.values() if all(c.get({a}, 0) > n "
                       f"for l, n in c.items() if l != {a}))\n"
                       'final_answer = "Answer: " + str(count)\n')
    raise AssertionError(f"no aggregation for {k!r}")  # parse_question knows no other kinds


def _needs_rows(spec: QuestionSpec) -> bool:
    return spec.scope != "all" or spec.kind not in (
        "most_common_label", "least_common_label", "label_vs_label", "label_count")


def _fence(prose: str, code: str) -> str:
    return f"{prose}\n```repl\n{code}```\n"


def trajectory(task: Task, style: str) -> list[str]:
    """The assistant turns of ``style`` for ``task``'s question."""
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; choose from {', '.join(STYLES)}")
    spec = parse_question(task.question, task.labels)
    ask = _ask(task.labels)
    rows = _ROWS if _needs_rows(spec) else ""
    if style in ("small", "small-batched"):
        head = _SMALL_HEAD if style == "small" else _SMALL_BATCHED_HEAD
        code = head.format(ask=ask, chunk=SMALL_CHUNK) + rows + aggregate(spec, task.labels) + "FINAL(final_answer)\n"
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
               rows + aggregate(spec, task.labels) + "print(final_answer)\n"),
        _fence("The answer above is in the requested form; submitting it.", "FINAL(final_answer)\n"),
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
