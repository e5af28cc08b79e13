"""Seeded generator of OOLONG-synth-style tasks.

A context window is a header, one row per instance
(``Date: Jun 29, 2022 || User: 44436 || Instance: What does IOC stand for ?``) and a closing
recall of the instructions. Users (5-digit ids) and labels are drawn with skewed (power-law)
frequencies; dates fall in 2022-2025, a few of them more often than the rest. Each task asks one
aggregate question over the window, in OOLONG's three groups (counting, user, timeline) with its
answer forms. Questions whose answer would be a tie are not asked.

    python -m benchmarks.oolong.generate --sizes 4096,16384 --per-size 3 --seed 0 --out tasks.jsonl
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import sys
from collections import Counter
from collections.abc import Callable, Sequence

from .tasks import Row, Task, save_tasks
from .words import ABBR_LETTERS, LABELS, TEMPLATES, WORDS

CHARS_PER_TOKEN = 4
MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")

HEADER = (
    "The following lines contain {n} general-knowledge questions, one per line. Each line gives "
    "a date, a user ID and a question. Each question has an answer that can be described as one "
    "of 6 categories: {labels}. The lines do not show the categories: work out the category of "
    "each question from what it asks. Calculate the exact answer given these datapoints.\n\n"
)
RECALL = (
    "\n\nRecall: the lines above hold {n} questions, each with a date, a user ID and a question "
    "whose answer falls in one of the 6 categories ({labels}). Answer the question below about "
    "these datapoints."
)

# task name -> (group, answer type)
QUESTION_TYPES: dict[str, tuple[str, str]] = {
    "most_common_label": ("counting", "ANSWER_TYPE.LABEL"),
    "least_common_label": ("counting", "ANSWER_TYPE.LABEL"),
    "label_vs_label": ("counting", "ANSWER_TYPE.COMPARISON"),
    "label_count": ("counting", "ANSWER_TYPE.NUMERIC"),
    "most_active_user": ("user", "ANSWER_TYPE.USER"),
    "user_most_label": ("user", "ANSWER_TYPE.USER"),
    "label_count_in_users": ("user", "ANSWER_TYPE.NUMERIC"),
    "most_common_date": ("timeline", "ANSWER_TYPE.DATE"),
    "label_count_in_month": ("timeline", "ANSWER_TYPE.NUMERIC"),
    "label_count_in_range": ("timeline", "ANSWER_TYPE.NUMERIC"),
    "months_a_beats_b": ("timeline", "ANSWER_TYPE.NUMERIC"),
    "first_month_a_beats_b": ("timeline", "ANSWER_TYPE.MONTH_YEAR"),
}


def format_date(d: dt.date) -> str:
    return f"{MONTHS[d.month - 1]} {d.day:02d}, {d.year}"


def parse_date(text: str) -> dt.date:
    return dt.datetime.strptime(text.strip(), "%b %d, %Y").date()


def month_of(date_text: str) -> str:
    """``"Jun 29, 2022"`` -> ``"Jun 2022"``."""
    d = parse_date(date_text)
    return f"{MONTHS[d.month - 1]} {d.year}"


def format_row(row: Row) -> str:
    date, user, instance, _ = row
    return f"Date: {date} || User: {user} || Instance: {instance}"


def label_list() -> str:
    return ", ".join(f"'{label}'" for label in LABELS)


def build_context(rows: Sequence[Row]) -> str:
    body = "\n".join(format_row(r) for r in rows)
    labels = label_list()
    return HEADER.format(n=len(rows), labels=labels) + body + RECALL.format(n=len(rows), labels=labels)


def _skewed(rng: random.Random, items: Sequence, exponent: float) -> list[float]:
    order = list(range(len(items)))
    rng.shuffle(order)
    return [1.0 / (order[i] + 1) ** exponent for i in range(len(items))]


def _instance(rng: random.Random, label: str) -> str:
    template = rng.choice(TEMPLATES[label])
    values = {k: rng.choice(v) for k, v in WORDS.items()}
    values["abbr"] = "".join(rng.choice(ABBR_LETTERS) for _ in range(rng.randint(2, 4)))
    values["year"] = str(rng.randint(1850, 2020))
    return template.format(**values)


def make_rows(rng: random.Random, target_tokens: int) -> list[Row]:
    """Rows whose context is about ``target_tokens`` tokens (4 characters a token)."""
    target_chars = target_tokens * CHARS_PER_TOKEN - len(HEADER) - len(RECALL) - 200
    approx_rows = max(8, target_chars // 85)
    users = rng.sample(range(10000, 100000), max(6, approx_rows // 12))
    user_w = _skewed(rng, users, 1.1)
    label_w = _skewed(rng, LABELS, rng.uniform(0.6, 1.4))
    start = dt.date(2022, 1, 1) + dt.timedelta(days=rng.randint(0, 3 * 365))
    span = min(rng.randint(180, 720), (dt.date(2025, 12, 31) - start).days)
    dates = sorted({start + dt.timedelta(days=rng.randint(0, span))
                    for _ in range(max(4, approx_rows // 3))})
    date_w = _skewed(rng, dates, 0.5)
    rows: list[Row] = []
    used = 0
    while used < target_chars:
        label = rng.choices(LABELS, label_w)[0]
        row = (format_date(rng.choices(dates, date_w)[0]), str(rng.choices(users, user_w)[0]),
               _instance(rng, label), label)
        rows.append(row)
        used += len(format_row(row)) + 1
    rows.sort(key=lambda r: parse_date(r[0]))
    return rows


# ------------------------------------------------------------------------------ questions

FORM = {
    "ANSWER_TYPE.LABEL": "Give your final answer in the form 'Label: answer', where answer is one "
                         "of the 6 categories.",
    "ANSWER_TYPE.NUMERIC": "Give your final answer in the form 'Answer: number'.",
    "ANSWER_TYPE.USER": "Give your final answer in the form 'User: id'.",
    "ANSWER_TYPE.DATE": "Give your final answer in the form 'Date: Mon DD, YYYY'.",
    "ANSWER_TYPE.MONTH_YEAR": "Give your final answer in the form 'Month: Mon YYYY'.",
}

Question = tuple[str, str] | None
"""(question text without the answer form, gold answer), or None when the answer is a tie."""


def _unique_max(counts: Counter, least: bool = False) -> str | None:
    if not counts:
        return None
    ranked = sorted(counts.items(), key=lambda kv: kv[1], reverse=not least)
    if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
        return None
    return ranked[0][0]


def _two_labels(rng: random.Random, counts: Counter) -> tuple[str, str]:
    present = [lab for lab in LABELS if counts[lab] > 0] or list(LABELS)
    a = rng.choice(present)
    b = rng.choice([lab for lab in LABELS if lab != a])
    return a, b


def _months(rows: Sequence[Row]) -> list[str]:
    seen: list[str] = []
    for r in rows:
        m = month_of(r[0])
        if m not in seen:
            seen.append(m)
    return seen


def q_most_common_label(rng, rows) -> Question:
    best = _unique_max(Counter(r[3] for r in rows))
    return None if best is None else ("Which of the categories is the most common?", best)


def q_least_common_label(rng, rows) -> Question:
    counts = Counter({lab: 0 for lab in LABELS})
    counts.update(r[3] for r in rows)
    best = _unique_max(counts, least=True)
    return None if best is None else ("Which of the categories is the least common?", best)


def q_label_vs_label(rng, rows) -> Question:
    counts = Counter(r[3] for r in rows)
    a, b = _two_labels(rng, counts)
    if counts[a] > counts[b]:
        rel = "more common than"
    elif counts[a] < counts[b]:
        rel = "less common than"
    else:
        rel = "same frequency as"
    text = (f"Is the category '{a}' more common than, less common than, or the same frequency as "
            f"the category '{b}'? Give your final answer in the form "
            f"'Answer: {a} is [X] {b}', where X is 'more common than', 'less common than' or "
            "'same frequency as'.")
    return text, rel


def q_label_count(rng, rows) -> Question:
    label = rng.choice(LABELS)
    n = sum(r[3] == label for r in rows)
    return f"How many of the questions have an answer in the category '{label}'?", str(n)


def q_most_active_user(rng, rows) -> Question:
    best = _unique_max(Counter(r[1] for r in rows))
    return None if best is None else ("Which user ID has written the most questions?", best)


def q_user_most_label(rng, rows) -> Question:
    label = rng.choice(LABELS)
    best = _unique_max(Counter(r[1] for r in rows if r[3] == label))
    if best is None:
        return None
    return f"Which user ID has written the most questions in the category '{label}'?", best


def q_label_count_in_users(rng, rows) -> Question:
    label = rng.choice(LABELS)
    users = sorted({r[1] for r in rows})
    subset = sorted(rng.sample(users, min(len(users), rng.randint(2, 4))))
    n = sum(r[3] == label and r[1] in subset for r in rows)
    listed = ", ".join(subset)
    return (f"Among the questions written by the users {listed}, how many have an answer in "
            f"the category '{label}'?", str(n))


def q_most_common_date(rng, rows) -> Question:
    best = _unique_max(Counter(r[0] for r in rows))
    return None if best is None else ("On which date were the most questions written?", best)


def q_label_count_in_month(rng, rows) -> Question:
    label = rng.choice(LABELS)
    month = rng.choice(_months(rows))
    n = sum(r[3] == label and month_of(r[0]) == month for r in rows)
    return (f"How many questions written in {month} have an answer in the category "
            f"'{label}'?", str(n))


def q_label_count_in_range(rng, rows) -> Question:
    label = rng.choice(LABELS)
    dates = sorted({parse_date(r[0]) for r in rows})
    i, j = sorted(rng.sample(range(len(dates)), 2)) if len(dates) > 1 else (0, 0)
    lo, hi = dates[i], dates[j]
    n = sum(r[3] == label and lo <= parse_date(r[0]) <= hi for r in rows)
    return (f"How many questions written between {format_date(lo)} and {format_date(hi)} "
            f"(inclusive) have an answer in the category '{label}'?", str(n))


def _month_counts(rows: Sequence[Row], a: str, b: str) -> list[tuple[str, int, int]]:
    out = []
    for m in _months(rows):
        in_m = [r[3] for r in rows if month_of(r[0]) == m]
        out.append((m, in_m.count(a), in_m.count(b)))
    return out


def q_months_a_beats_b(rng, rows) -> Question:
    a, b = _two_labels(rng, Counter(r[3] for r in rows))
    n = sum(ca > cb for _, ca, cb in _month_counts(rows, a, b))
    return (f"In how many months are questions in the category '{a}' more common than questions "
            f"in the category '{b}'?", str(n))


def q_first_month_a_beats_b(rng, rows) -> Question:
    a, b = _two_labels(rng, Counter(r[3] for r in rows))
    for m, ca, cb in _month_counts(rows, a, b):
        if ca > cb:
            return (f"What is the first month in which questions in the category '{a}' are more "
                    f"common than questions in the category '{b}'?", m)
    return None


MAKERS: dict[str, Callable[[random.Random, Sequence[Row]], Question]] = {
    name: globals()[f"q_{name}"] for name in QUESTION_TYPES
}


def make_question(rng: random.Random, kind: str, rows: Sequence[Row]) -> tuple[str, str] | None:
    """(full question text, gold answer) for question type ``kind``; None for a tie."""
    made = MAKERS[kind](rng, rows)
    if made is None:
        return None
    text, gold = made
    answer_type = QUESTION_TYPES[kind][1]
    if answer_type != "ANSWER_TYPE.COMPARISON":
        text = f"{text} {FORM[answer_type]}"
    return text, gold


def generate(sizes: Sequence[int], per_size: int, seed: int,
             kinds: Sequence[str] | None = None) -> list[Task]:
    """``per_size`` tasks at each context size (tokens); question types taken in turn."""
    kinds = list(kinds or QUESTION_TYPES)
    for k in kinds:
        if k not in QUESTION_TYPES:
            raise ValueError(f"unknown question type {k!r}; known: {', '.join(QUESTION_TYPES)}")
    rng = random.Random(seed)
    tasks: list[Task] = []
    turn = 0
    for size in sizes:
        if size < 512:
            raise ValueError(f"context size {size} is below the 512-token minimum")
        for i in range(per_size):
            rows = make_rows(random.Random(rng.random()), size)
            context = build_context(rows)
            for attempt in range(len(kinds)):
                kind = kinds[(turn + attempt) % len(kinds)]
                made = make_question(random.Random(rng.random()), kind, rows)
                if made is not None:
                    break
            else:
                raise RuntimeError("every question type was a tie on this window")
            turn += 1
            question, gold = made
            tasks.append(Task(
                id=f"s{seed}-{size // 1024}k-{i}-{kind}", context=context, question=question,
                answer=gold, answer_type=QUESTION_TYPES[kind][1], task=kind,
                context_tokens=len(context) // CHARS_PER_TOKEN, rows=list(rows),
            ))
    return tasks


def parse_sizes(text: str) -> list[int]:
    """``"1k,4K,16384"`` -> ``[1024, 4096, 16384]``."""
    sizes = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        try:
            sizes.append(int(part[:-1]) * 1024 if part.endswith("k") else int(part))
        except ValueError:
            raise ValueError(f"bad size {part!r}: use tokens, e.g. 4096 or 4k") from None
    if not sizes:
        raise ValueError("no sizes given")
    return sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.oolong.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="4k,16k", help="context sizes in tokens, e.g. 1k,4k,64k")
    p.add_argument("--per-size", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--types", help="comma-separated question types (default: all, in turn)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        kinds = args.types.split(",") if args.types else None
        tasks = generate(parse_sizes(args.sizes), args.per_size, args.seed, kinds)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    save_tasks(tasks, args.out)
    print(f"wrote {len(tasks)} tasks to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
