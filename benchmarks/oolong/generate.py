"""Seeded generator of tasks in OOLONG-synth's format and wording, on instances of our own.

A context window is laid out as OOLONG-synth's ``context_window_text``: a header saying what the
lines are and that questions about their aggregate label statistics follow, one line per
instance (``Date: Jun 29, 2022 || User: 44436 || Instance: What does IOC stand for ?``) in
shuffled order, and the header again as a closing recall. Users (5-digit ids) and labels are
drawn with skewed (power-law) frequencies; dates fall in 2022-2025, a few of them more often than
the rest. Each task asks one question in OOLONG-synth's wording (`benchmarks.oolong.questions`):
every kind OOLONG-synth asks, each in the scopes it asks it in (all rows, a user subset, a month
of any year, a date range). The gold answer is computed from the rows; a question whose answer
would be a tie is not asked.

    python -m benchmarks.oolong.generate --sizes 4096,16384 --per-size 3 --seed 0 --out tasks.jsonl
"""

from __future__ import annotations

import argparse
import datetime as dt
import random
import sys
from collections import Counter
from collections.abc import Sequence

from .questions import (ANSWER_TYPE_OF, QUESTION_KINDS, SCOPES_OF, QuestionSpec, context_date,
                        parse_date, parse_question, render_question, solve)
from .tasks import Row, Task, save_tasks
from .words import ABBR_LETTERS, DATASETS, LABELS, WORDS, Dataset

CHARS_PER_TOKEN = 4
ATTEMPTS = 12
"""Parameter draws tried per question kind before the kind is given up for a window."""

QUESTION_TYPES: dict[str, tuple[str, str]] = {
    kind: (QuestionSpec(kind, answer_type).group, answer_type)
    for kind, answer_type in ANSWER_TYPE_OF.items()}
"""Question kind -> (OOLONG-synth's task group when asked about all rows, answer type): the kinds
the generator asks (all of OOLONG-synth's)."""


def format_row(row: Row) -> str:
    date, user, instance, _ = row
    return f"Date: {date} || User: {user} || Instance: {instance}"


def describe(dataset: Dataset, n: int, intro: bool) -> str:
    """OOLONG-synth's header (``intro``) or closing recall for ``n`` lines."""
    start = "The following" if intro else "Recall: the preceding"
    labels = ", ".join(f"'{label}'" for label in dataset.labels)
    lines = dataset.lines.format(k=len(dataset.labels), labels=labels)
    return (f"{start} lines contain {n} {lines}\n\nYou will be asked to answer questions about the "
            f"aggregate label statistics across all {n} examples in this dataset. Do not try to "
            "guess, estimate, or approximate the result. Calculate the exact answer given these "
            "datapoints.\n\n")


def build_context(rows: Sequence[Row], dataset: Dataset) -> str:
    body = "".join(format_row(r) + "\n" for r in rows)
    return describe(dataset, len(rows), True) + body + describe(dataset, len(rows), False)


def _skewed(rng: random.Random, items: Sequence, exponent: float) -> list[float]:
    order = list(range(len(items)))
    rng.shuffle(order)
    return [1.0 / (order[i] + 1) ** exponent for i in range(len(items))]


def _instance(rng: random.Random, dataset: Dataset, label: str) -> str:
    template = rng.choice(dataset.templates[label])
    values = {k: rng.choice(v) for k, v in WORDS.items()}
    values["abbr"] = "".join(rng.choice(ABBR_LETTERS) for _ in range(rng.randint(2, 4)))
    values["year"] = str(rng.randint(1850, 2020))
    return template.format(**values)


def make_rows(rng: random.Random, target_tokens: int,
              dataset: Dataset = DATASETS["trec_coarse"]) -> list[Row]:
    """Rows, in context order, whose context is about ``target_tokens`` tokens (4 characters
    a token)."""
    overhead = len(build_context([], dataset)) + 200
    target_chars = target_tokens * CHARS_PER_TOKEN - overhead
    approx_rows = max(8, target_chars // 85)
    users = rng.sample(range(10000, 100000), max(6, approx_rows // 12))
    user_w = _skewed(rng, users, 1.1)
    label_w = _skewed(rng, dataset.labels, rng.uniform(0.6, 1.4))
    start = dt.date(2022, 1, 1) + dt.timedelta(days=rng.randint(0, 3 * 365))
    span = min(rng.randint(180, 720), (dt.date(2025, 12, 31) - start).days)
    dates = sorted({start + dt.timedelta(days=rng.randint(0, span))
                    for _ in range(max(4, approx_rows // 3))})
    date_w = _skewed(rng, dates, 0.5)
    rows: list[Row] = []
    used = 0
    while used < target_chars:
        label = rng.choices(dataset.labels, label_w)[0]
        row = (context_date(rng.choices(dates, date_w)[0]), str(rng.choices(users, user_w)[0]),
               _instance(rng, dataset, label), label)
        rows.append(row)
        used += len(format_row(row)) + 1
    rng.shuffle(rows)
    return rows


# ------------------------------------------------------------------------------ questions

def _draw(rng: random.Random, kind: str, scope: str, rows: Sequence[Row],
          labels: Sequence[str]) -> QuestionSpec:
    """Random parameters for one question of ``kind`` in ``scope`` over ``rows``."""
    dates = sorted({parse_date(r[0]) for r in rows})
    users = sorted({r[1] for r in rows})
    extra: dict = {}
    if scope == "users":
        extra["users"] = tuple(rng.sample(users, min(len(users), rng.randint(1, 3))))
    elif scope == "month":
        extra["month"] = rng.choice(sorted({d.month for d in dates}))
    elif scope == "range":
        i, j = sorted(rng.sample(range(len(dates)), 2)) if len(dates) > 1 else (0, 0)
        extra["date_range"] = (dates[i], dates[j])
    probe = QuestionSpec(kind, ANSWER_TYPE_OF[kind], scope, **extra)
    in_scope = [r for r in rows if probe.in_scope(parse_date(r[0]), r[1])]
    present = [lab for lab in labels if any(r[3] == lab for r in in_scope)] or list(labels)
    a = rng.choice(present)
    b = rng.choice([lab for lab in labels if lab != a] or [a])
    if kind in ("most_common_label", "least_common_label"):
        extra["labels"] = tuple(present)
    elif kind in ("label_vs_label", "first_month_a_beats_b", "months_a_beats_b"):
        extra["labels"] = (a, b)
    elif kind in ("label_count", "user_most_label", "label_before_after",
                  "months_label_most_common"):
        extra["labels"] = (a,)
    elif kind == "user_vs_user_label":
        by_user = Counter(r[1] for r in rows if r[3] == a).most_common()
        if len(by_user) < 2:
            by_user += [(u, 0) for u in users if u not in dict(by_user)][:2]
        top = rng.randrange(min(3, len(by_user) - 1))
        low = rng.randrange(top + 1, len(by_user))
        extra["labels"], extra["users"] = (a,), (by_user[top][0], by_user[low][0])
    if kind == "dates_with_count":
        counts = sorted(Counter(r[0] for r in rows).values(), reverse=True)
        extra["count"] = counts[min(3, len(counts) - 1)]
    if kind == "label_before_after":
        ordered = sorted(dates)
        extra["date"] = ordered[rng.randint(len(ordered) * 15 // 100, len(ordered) * 75 // 100)]
    return QuestionSpec(kind, ANSWER_TYPE_OF[kind], scope, **extra)


def make_question(rng: random.Random, kind: str, rows: Sequence[Row],
                  labels: Sequence[str] = LABELS, scope: str = "all") -> tuple[str, str] | None:
    """(question text in OOLONG-synth's wording, gold answer), or None when every draw of
    parameters gave a tie."""
    for _ in range(ATTEMPTS):
        spec = _draw(rng, kind, scope, rows, labels)
        gold = solve(spec, rows)
        if gold is not None:
            text = render_question(spec)
            if parse_question(text, labels) != spec:
                raise RuntimeError(f"the wording of {kind} does not read back: {text!r}")
            return text, gold
    return None


def _kind_and_scope(name: str) -> tuple[str, str | None]:
    kind, _, scope = name.partition("@")
    if kind not in QUESTION_KINDS:
        raise ValueError(f"unknown question type {kind!r}; known: {', '.join(QUESTION_KINDS)}")
    if scope and scope not in SCOPES_OF.get(kind, ("all",)):
        raise ValueError(f"question type {kind!r} is asked in scopes "
                         f"{', '.join(SCOPES_OF.get(kind, ('all',)))}, not {scope!r}")
    return kind, scope or None


def generate(sizes: Sequence[int], per_size: int, seed: int, kinds: Sequence[str] | None = None,
             dataset: str = "trec_coarse") -> list[Task]:
    """``per_size`` tasks at each context size (tokens). Question kinds are taken in turn, each
    kind's scopes in turn; a kind may be pinned to a scope as ``"label_count@month"``."""
    wanted = [_kind_and_scope(k) for k in (kinds or QUESTION_KINDS)]
    if dataset not in DATASETS:
        raise ValueError(f"unknown dataset {dataset!r}; known: {', '.join(DATASETS)}")
    data = DATASETS[dataset]
    rng = random.Random(seed)
    tasks: list[Task] = []
    turn = 0
    asked: Counter = Counter()
    for size in sizes:
        if size < 512:
            raise ValueError(f"context size {size} is below the 512-token minimum")
        for i in range(per_size):
            rows = make_rows(random.Random(rng.random()), size, data)
            context = build_context(rows, data)
            for attempt in range(len(wanted)):
                kind, scope = wanted[(turn + attempt) % len(wanted)]
                scopes = SCOPES_OF.get(kind, ("all",))
                scope = scope or scopes[asked[kind] % len(scopes)]
                made = make_question(random.Random(rng.random()), kind, rows, data.labels, scope)
                if made is not None:
                    break
            else:
                raise RuntimeError("every question type was a tie on this window")
            turn += 1
            asked[kind] += 1
            question, gold = made
            tasks.append(Task(
                id=f"s{seed}-{size // 1024}k-{i}-{kind}", context=context, question=question,
                answer=gold, answer_type=ANSWER_TYPE_OF[kind], task=kind,
                context_tokens=len(context) // CHARS_PER_TOKEN, rows=list(rows),
                labels=list(data.labels),
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
    p.add_argument("--types", help="comma-separated question kinds, each optionally pinned to a "
                                   "scope (label_count@month); default: all, in turn")
    p.add_argument("--dataset", default="trec_coarse", choices=sorted(DATASETS))
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    try:
        kinds = args.types.split(",") if args.types else None
        tasks = generate(parse_sizes(args.sizes), args.per_size, args.seed, kinds, args.dataset)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    save_tasks(tasks, args.out)
    print(f"wrote {len(tasks)} tasks to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
