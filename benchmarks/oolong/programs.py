"""Reference programs: the code a competent RLM-style agent writes for each question type.

A program labels every context row with the sub-model (chunks of `CHUNK` rows), rebuilds
``(date, user, label)`` rows when the question needs dates or users, and aggregates in Python, ending with ``FINAL("<Form>: ...")``.
Three shapes of the sub-model calls: a ``for`` loop of ``llm_query``, one ``llm_query_batched``,
and a list comprehension of ``llm_query``. Replay mode streams these programs; the few-shot
examples of the live root agent are these programs written for another question of the same type.
"""

from __future__ import annotations

import re

from .tasks import Task

SHAPES = ("loop", "batched", "comprehension")
LABEL_ONLY = ("most_common_label", "least_common_label", "label_vs_label", "label_count")
"""Question types answered from the labels alone (no dates or users needed)."""
CHUNK = 100
ASK = ("Give the category of each question below, one per line, in order: abbreviation, entity, "
       "description and abstract concept, human being, location or numeric value.\\n")

_HEADS = {
    "loop": (
        'lines = [l for l in context.split("\\n") if l.startswith("Date:")]\n'
        'ask = "{ask}"\n'
        "labels = []\n"
        "for i in range(0, len(lines), {chunk}):\n"
        '    reply = llm_query(ask + "\\n".join(lines[i:i + {chunk}]))\n'
        '    labels += reply.strip().split("\\n")\n'
    ),
    "batched": (
        'lines = [l for l in context.split("\\n") if l.startswith("Date:")]\n'
        'ask = "{ask}"\n'
        'chunks = ["\\n".join(lines[i:i + {chunk}]) for i in range(0, len(lines), {chunk})]\n'
        "replies = llm_query_batched([ask + c for c in chunks])\n"
        'labels = [x for r in replies for x in r.strip().split("\\n")]\n'
    ),
    "comprehension": (
        'lines = [l for l in context.split("\\n") if l.startswith("Date:")]\n'
        'ask = "{ask}"\n'
        'replies = [llm_query(ask + "\\n".join(lines[i:i + {chunk}])) '
        "for i in range(0, len(lines), {chunk})]\n"
        'labels = [x for r in replies for x in r.strip().split("\\n")]\n'
    ),
}

_ROWS = (
    "rows = []\n"
    "for line, label in zip(lines, labels):\n"
    '    date, user, _ = line.split(" || ", 2)\n'
    "    rows.append((date[6:], user[6:], label))\n"
)

_MONTHS = ('months = ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", '
           '"Nov", "Dec"]\n')


def _per_month(a: str, b: str) -> str:
    return (
        "per_month = {}\n"
        "for date, user, label in rows:\n"
        "    month = date[:3] + date[-5:]\n"
        "    a, b = per_month.get(month, (0, 0))\n"
        f'    per_month[month] = (a + (label == "{a}"), b + (label == "{b}"))\n'
    )


def params(task: Task) -> dict:
    """The question's parameters (categories, users, month, date range), read from its text."""
    q = task.question
    out: dict = {"labels": re.findall(r"category '([^']+)'", q)}
    if m := re.search(r"users ([\d, ]+), how many", q):
        out["users"] = [u.strip() for u in m.group(1).split(",")]
    if m := re.search(r"written in (\w{3} \d{4})", q):
        out["month"] = m.group(1)
    if m := re.search(r"between (\w{3} \d{2}, \d{4}) and (\w{3} \d{2}, \d{4})", q):
        out["range"] = (m.group(1), m.group(2))
    return out


def _aggregate(kind: str, p: dict) -> str:
    labels = p["labels"]
    if kind in ("most_common_label", "least_common_label"):
        pick = "max" if kind == "most_common_label" else "min"
        return (
            'counts = {c: 0 for c in ["abbreviation", "entity", "description and abstract concept", '
            '"human being", "location", "numeric value"]}\n'
            "for label in labels:\n"
            "    if label in counts:\n"
            "        counts[label] = counts[label] + 1\n"
            f'FINAL("Label: " + {pick}(counts, key=counts.get))\n'
        )
    if kind == "label_vs_label":
        a, b = labels[:2]
        return (
            f'a = labels.count("{a}")\n'
            f'b = labels.count("{b}")\n'
            'relation = "more common than" if a > b else "less common than" if a < b '
            'else "same frequency as"\n'
            f'FINAL("Answer: {a} is " + relation + " {b}")\n'
        )
    if kind == "label_count":
        return (f'count = labels.count("{labels[0]}")\n'
                'FINAL("Answer: " + str(count))\n')
    if kind in ("most_active_user", "user_most_label"):
        cond = f'\n    if label == "{labels[0]}":' if kind == "user_most_label" else ""
        indent = "        " if cond else "    "
        return (
            "counts = {}\n"
            f"for date, user, label in rows:{cond}\n"
            f"{indent}counts[user] = counts.get(user, 0) + 1\n"
            'FINAL("User: " + max(counts, key=counts.get))\n'
        )
    if kind == "label_count_in_users":
        users = ", ".join(f'"{u}"' for u in p["users"])
        return (f"users = [{users}]\n"
                f'count = sum(1 for r in rows if r[2] == "{labels[0]}" and r[1] in users)\n'
                'FINAL("Answer: " + str(count))\n')
    if kind == "most_common_date":
        return (
            "counts = {}\n"
            "for date, user, label in rows:\n"
            "    counts[date] = counts.get(date, 0) + 1\n"
            'FINAL("Date: " + max(counts, key=counts.get))\n'
        )
    if kind == "label_count_in_month":
        return (f'count = sum(1 for r in rows if r[2] == "{labels[0]}" '
                f'and r[0][:3] + r[0][-5:] == "{p["month"]}")\n'
                'FINAL("Answer: " + str(count))\n')
    if kind == "label_count_in_range":
        lo, hi = p["range"]
        return (
            _MONTHS
            + "def day(d):\n"
            "    return (int(d[-4:]), months.index(d[:3]), int(d[4:6]))\n"
            f'count = sum(1 for r in rows if r[2] == "{labels[0]}" '
            f'and day("{lo}") <= day(r[0]) <= day("{hi}"))\n'
            'FINAL("Answer: " + str(count))\n'
        )
    if kind == "months_a_beats_b":
        return (_per_month(*labels[:2])
                + "count = sum(1 for a, b in per_month.values() if a > b)\n"
                'FINAL("Answer: " + str(count))\n')
    if kind == "first_month_a_beats_b":
        return (
            _MONTHS + _per_month(*labels[:2])
            + "wins = [m for m, (a, b) in per_month.items() if a > b]\n"
            "first = min(wins, key=lambda m: (int(m[-4:]), months.index(m[:3])))\n"
            'FINAL("Month: " + first)\n'
        )
    raise ValueError(f"no reference program for question type {kind!r}")


def reference_code(task: Task, shape: str) -> str:
    """The program (code only) for ``task``'s question type in call shape ``shape``."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    head = _HEADS[shape].format(ask=ASK, chunk=CHUNK)
    rows = "" if task.task in LABEL_ONLY else _ROWS
    return head + rows + _aggregate(task.task, params(task))


def reference_response(task: Task, shape: str) -> str:
    """A whole model response: one sentence of plan, then the program in a ```repl block."""
    return ("I will ask the sub-model for the category of every line, chunk by chunk, then "
            f"count in Python.\n```repl\n{reference_code(task, shape)}```\n")


def shape_for(index: int) -> str:
    """Shapes taken in turn over a run's tasks."""
    return SHAPES[index % len(SHAPES)]


def shape_of(code: str) -> str:
    """Which call shape a program uses (for reports on live runs)."""
    if "llm_query_batched" in code:
        return "batched"
    if re.search(r"\[[^\]\n]*llm_query\([^\n]*\bfor\b", code):
        return "comprehension"
    if re.search(r"^\s*for\b[^\n]*:\s*\n(?:\s+[^\n]*\n)*?\s+[^\n]*llm_query\(", code, re.M):
        return "loop"
    return "single" if "llm_query(" in code else "none"
