"""OOLONG-synth's questions: their wording, what each one asks, and its answer from labelled rows.

OOLONG-synth (Bertsch et al. 2025) asks aggregate questions about a window of
``Date: ... || User: ... || Instance: ...`` lines, each line having a hidden label. Its question
generator words every question from a fixed set of templates; this module knows them all:

- `parse_question` turns a question in that wording into a `QuestionSpec` (what is asked, about
  which rows, with which labels, users, month, dates);
- `render_question` writes a spec back in the same wording (the generator asks with it);
- `solve` computes the answer from ``(date, user, ..., label)`` rows, ``None`` when the answer
  would be a tie;
- `format_answer` writes an answer in the form the question asks for (``Label: ...``).

Question kinds (`QUESTION_KINDS`) and the wording each matches (``...`` is the answer form):

==========================  ================================================================
kind                        wording (after the scope prefix, see below)
==========================  ================================================================
most_common_label           which of the labels is the most common? ...
least_common_label          which of the labels is the least common? ...
label_vs_label              is label 'A' more common, less common, or the same frequency as
                            label 'B'? ...
label_count                 how many data points should be classified as label 'A'? ...
most_common_user            which user is represented most often? ...
second_most_common_user     which user is represented the second most often? ...
user_most_label             which user has the most instances with the label A? ...
user_vs_user_label          which user has more instances with the label A: User U or User V?
most_common_date            which date is represented most often? ...
second_most_common_date     which date is represented the second most often? ...
dates_with_count            how many dates are represented exactly N times? ...
label_before_after          was label 'A' more common, less common, or the same frequency
                            before D, as compared to after D? ...
first_month_a_beats_b       In which month did the label 'A first occur more often than the
                            label 'B'? ...
months_a_beats_b            For how many months does the label 'A' occur more frequently than
                            the label 'B'? ...
months_label_most_common    For how many months is the label 'A' the single most frequently
                            occuring label? ...
==========================  ================================================================

Groups (`QuestionSpec.group`, as OOLONG-synth's ``task_group``): ``counting`` (the four
label kinds over all rows), ``user`` (the user kinds, and label kinds over a user subset),
``timeline`` (the date and month kinds, and label kinds over a month or a date range).

Scopes: a question starts with ``In the above data,`` (scope ``all``) or with a prefix that
restricts it to a subset of the rows: ``... instances that are associated with user IDs U, V.
Among instances associated with these users,`` or ``... subset of users with IDs U, V. Among
these users,`` (``users``), ``... instances that occur in June of any year. Among instances
occuring in June,`` (``month``: that month of every year), ``... instances that occur between
Feb 02, 2023 and Mar 05, 2023, inclusive. Among instances occuring in this date range,``
(``range``). The last three kinds have no prefix (scope ``all``).

Answers (`solve`, and the gold answers of generated tasks): a label, a count (``"12"``), a user
id, a date in ISO form (``"2023-05-01"``), a month and year as OOLONG writes it
(``"June 2023"``), or a comparison phrase: ``more common than`` / ``less common than`` /
``same frequency as`` for `label_vs_label`, ``more common`` / ``less common`` /
``the same frequency`` for `label_before_after`.
"""

from __future__ import annotations

import datetime as dt
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

QUESTION_KINDS = (
    "most_common_label",
    "least_common_label",
    "label_vs_label",
    "label_count",
    "most_common_user",
    "second_most_common_user",
    "user_most_label",
    "user_vs_user_label",
    "most_common_date",
    "second_most_common_date",
    "dates_with_count",
    "label_before_after",
    "first_month_a_beats_b",
    "months_a_beats_b",
    "months_label_most_common",
)

ANSWER_TYPE_OF = {
    "most_common_label": "ANSWER_TYPE.LABEL",
    "least_common_label": "ANSWER_TYPE.LABEL",
    "label_vs_label": "ANSWER_TYPE.COMPARISON",
    "label_count": "ANSWER_TYPE.NUMERIC",
    "most_common_user": "ANSWER_TYPE.USER",
    "second_most_common_user": "ANSWER_TYPE.USER",
    "user_most_label": "ANSWER_TYPE.USER",
    "user_vs_user_label": "ANSWER_TYPE.USER",
    "most_common_date": "ANSWER_TYPE.DATE",
    "second_most_common_date": "ANSWER_TYPE.DATE",
    "dates_with_count": "ANSWER_TYPE.NUMERIC",
    "label_before_after": "ANSWER_TYPE.COMPARISON",
    "first_month_a_beats_b": "ANSWER_TYPE.MONTH_YEAR",
    "months_a_beats_b": "ANSWER_TYPE.NUMERIC",
    "months_label_most_common": "ANSWER_TYPE.NUMERIC",
}
"""The answer type (OOLONG's spelling) of each kind."""

SCOPES = ("all", "users", "month", "range")
_COUNTING_KINDS = ("most_common_label", "least_common_label", "label_vs_label", "label_count")
_USER_KINDS = ("most_common_user", "second_most_common_user", "user_most_label")
SCOPES_OF = {**{k: SCOPES for k in _COUNTING_KINDS}, **{k: ("all", "users") for k in _USER_KINDS}}
"""The scopes OOLONG-synth asks each kind in (kinds not listed: ``all`` only)."""

MONTH_NAMES = ("January", "February", "March", "April", "May", "June", "July", "August",
               "September", "October", "November", "December")
MONTH_ABBR = tuple(m[:3] for m in MONTH_NAMES)


class UnknownQuestionError(ValueError):
    """A question in none of OOLONG-synth's wordings; the message lists the known kinds."""


@dataclass(frozen=True)
class QuestionSpec:
    """What one question asks. Rows a question is about: those in its scope."""

    kind: str
    """One of `QUESTION_KINDS`."""
    answer_type: str
    """``ANSWER_TYPE.LABEL`` ... (`ANSWER_TYPE_OF` of the kind)."""
    scope: str = "all"
    """``all``, ``users`` (rows of `users`), ``month`` (rows in `month` of any year) or
    ``range`` (rows dated within `date_range`)."""
    labels: tuple[str, ...] = ()
    """The labels named, in order of mention: A (and B) of the kind's wording, or for
    most/least common the candidate labels the question lists."""
    users: tuple[str, ...] = ()
    """User ids named: the subset of scope ``users``, or the two users `user_vs_user_label`
    compares (its scope is ``all``)."""
    month: int | None = None
    """Scope ``month``: 1-12, that month of every year (OOLONG's month subsets)."""
    date_range: tuple[dt.date, dt.date] | None = None
    """Scope ``range``: the first and last day, both included."""
    date: dt.date | None = None
    """`label_before_after`: the day rows are split at (rows of that day are in neither part)."""
    count: int | None = None
    """`dates_with_count`: N."""

    @property
    def month_abbr(self) -> str | None:
        """Scope ``month`` as the context's dates write it (``"Jun"``)."""
        return MONTH_ABBR[self.month - 1] if self.month else None

    @property
    def group(self) -> str:
        """OOLONG-synth's task group: ``counting``, ``user`` or ``timeline``."""
        if self.kind in _USER_KINDS or self.kind == "user_vs_user_label" or self.scope == "users":
            return "user"
        if self.kind in _COUNTING_KINDS and self.scope == "all":
            return "counting"
        return "timeline"

    def in_scope(self, date: dt.date, user: str) -> bool:
        """Whether a row dated ``date`` by ``user`` belongs to the question's scope."""
        if self.scope == "users":
            return user in self.users
        if self.scope == "month":
            return date.month == self.month
        if self.scope == "range":
            lo, hi = self.date_range  # type: ignore[misc]
            return lo <= date <= hi
        return True


# ------------------------------------------------------------------------------ dates

_DATE_FORMATS = ("%b %d, %Y", "%B %d, %Y", "%Y-%m-%d", "%m/%d/%Y")


def parse_date(text: str) -> dt.date:
    """``"Jun 29, 2022"`` (the context's form), ``"2022-06-29"`` or ``"06/29/2022"``."""
    text = text.strip()
    for fmt in _DATE_FORMATS:
        try:
            return dt.datetime.strptime(text, fmt).date()
        except ValueError:
            continue
    raise ValueError(f"not a date: {text!r}")


def context_date(d: dt.date) -> str:
    """The context's form of a date: ``"Jun 29, 2022"``."""
    return f"{MONTH_ABBR[d.month - 1]} {d.day:02d}, {d.year}"


def month_year(d: dt.date) -> str:
    """OOLONG's month-year answer: ``"June 2022"``."""
    return f"{MONTH_NAMES[d.month - 1]} {d.year}"


# ------------------------------------------------------------------------------ wording

_IN_DATA = "In the above data,"
_SCOPE_PREFIX = {
    "users": ("For the following question, only consider the subset of instances that are "
              "associated with user IDs {users}. Among instances associated with these users,"),
    "users_of_users": ("For the following question, only consider the subset of users with "
                       "IDs {users}. Among these users,"),
    "month": ("For the following question, only consider the subset of instances that occur "
              "in {month} of any year. Among instances occuring in {month},"),
    "range": ("For the following question, only consider the subset of instances that occur "
              "between {lo} and {hi}, inclusive. Among instances occuring in this date range,"),
}
_USER_FORM = "Give your final answer in the form 'User: [X]', where [X] is the user ID."
_DATE_FORM = ("Give your final answer in the form 'Date: [X]', where [X] is the date in the "
              "format MM/DD/YYYY.")
_LABEL_FORM = ("Give your final answer in the form 'Label: answer' where answer is one of the "
               "labels: {choices}.")
_BODY = {
    "most_common_label": "which of the labels is the most common? " + _LABEL_FORM,
    "least_common_label": "which of the labels is the least common? " + _LABEL_FORM,
    "label_vs_label": ("is label '{a}' more common, less common, or the same frequency as label "
                       "'{b}'? Give your final answer in the form 'Answer: {a} is [X] {b}', where "
                       "[X] is 'more common than', 'less common than', or 'same frequency as'."),
    "label_count": ("how many data points should be classified as label '{a}'? Give your final "
                    "answer in the form 'Answer: number'."),
    "most_common_user": "which user is represented most often? " + _USER_FORM,
    "second_most_common_user": "which user is represented the second most often? " + _USER_FORM,
    "user_most_label": "which user has the most instances with the label {a}? " + _USER_FORM,
    "user_vs_user_label": ("which user has more instances with the label {a}: User {u} or User "
                           "{v}? " + _USER_FORM),
    "most_common_date": "which date is represented most often? " + _DATE_FORM,
    "second_most_common_date": "which date is represented the second most often? " + _DATE_FORM,
    "dates_with_count": ("how many dates are represented exactly {n} times? Give your final "
                         "answer in the form 'Answer: [X]', where [X] is the number of dates "
                         "represented exactly {n} times."),
    "label_before_after": ("was label '{a}' more common, less common, or the same frequency "
                           "before {d}, as compared to after {d}? Give your final answer in the "
                           "form 'Answer: {a} is [X] before {d}', where [X] is 'more common', "
                           "'less common', or 'the same frequency'."),
    # OOLONG-synth's own text, including its unclosed quote after the first label
    "first_month_a_beats_b": ("In which month did the label '{a} first occur more often than the "
                              "label '{b}'? Give your final answer in the form 'Answer: [month] "
                              "[year]', where [month] is the name of the month and [year] is the "
                              "four-digit year where '{a}' first occured more often than '{b}.'"),
    "months_a_beats_b": ("For how many months does the label '{a}' occur more frequently than the "
                         "label '{b}'? Disregard months where there is a tie.  Give your final "
                         "answer in the form 'Answer: [X]', where [X] is the number of months "
                         "where '{a}' occurs more often than '{b}.'"),
    "months_label_most_common": ("For how many months is the label '{a}' the single most "
                                 "frequently occuring label? Disregard months where there is a "
                                 "tie for the most common label.  Give your final answer in the "
                                 "form 'Answer: [X]', where [X] is the number of months where "
                                 "'{a}' is the most common label."),
}
_NO_PREFIX = ("first_month_a_beats_b", "months_a_beats_b", "months_label_most_common")


def render_question(spec: QuestionSpec) -> str:
    """The question in OOLONG-synth's wording (`parse_question` reads it back)."""
    if spec.kind not in QUESTION_KINDS:
        raise ValueError(f"unknown question kind {spec.kind!r}; known: {', '.join(QUESTION_KINDS)}")
    a, b = (list(spec.labels) + ["", ""])[:2]
    u, v = (list(spec.users) + ["", ""])[:2]
    body = _BODY[spec.kind].format(
        a=a, b=b, u=u, v=v, n=spec.count, d=spec.date.isoformat() if spec.date else "",
        choices=", ".join(spec.labels))
    if spec.kind in _NO_PREFIX:
        return body
    if spec.scope == "all":
        prefix = _IN_DATA
    else:
        key = "users_of_users" if spec.scope == "users" and spec.kind in _USER_KINDS else spec.scope
        lo, hi = spec.date_range or (None, None)
        prefix = _SCOPE_PREFIX[key].format(
            users=", ".join(spec.users), month=MONTH_NAMES[(spec.month or 1) - 1],
            lo=context_date(lo) if lo else "", hi=context_date(hi) if hi else "")
    return f"{prefix} {body}"


# ------------------------------------------------------------------------------ parsing

_IDS = r"(?P<users>\d+(?:\s*,\s*\d+)*)"
_MONTH = "(?P<month>" + "|".join(MONTH_NAMES) + ")"
_PREFIXES = (
    ("users", re.compile(r"For the following question, only consider the subset of instances "
                         rf"that are associated with user IDs {_IDS}\. Among instances associated "
                         r"with these users,\s*", re.I)),
    ("users", re.compile(rf"For the following question, only consider the subset of users with "
                         rf"IDs {_IDS}\. Among these users,\s*", re.I)),
    ("month", re.compile(r"For the following question, only consider the subset of instances "
                         rf"that occur in {_MONTH} of any year\. Among instances occur+ing in "
                         r"(?P=month),\s*", re.I)),
    ("range", re.compile(r"For the following question, only consider the subset of instances "
                         r"that occur between (?P<lo>.+?) and (?P<hi>.+?), inclusive\. Among "
                         r"instances occur+ing in this date range,\s*", re.I)),
    ("all", re.compile(r"In the above data,\s*", re.I)),
)
_LABEL = r"'(?P<a>[^']+)'"
_PATTERNS = {
    "most_common_label": r"which of the labels is the most common\?",
    "least_common_label": r"which of the labels is the least common\?",
    "label_vs_label": rf"is label {_LABEL} more common, less common, or the same frequency as "
                      r"label '(?P<b>[^']+)'\?",
    "label_count": rf"how many data points should be classified as label {_LABEL}\?",
    "most_common_user": r"which user is represented most often\?",
    "second_most_common_user": r"which user is represented the second most often\?",
    "user_most_label": r"which user has the most instances with the label (?P<a>.+?)\?",
    "user_vs_user_label": r"which user has more instances with the label (?P<a>.+?): User "
                          r"(?P<u>\d+) or User (?P<v>\d+)\?",
    "most_common_date": r"which date is represented most often\?",
    "second_most_common_date": r"which date is represented the second most often\?",
    "dates_with_count": r"how many dates are represented exactly (?P<n>\d+) times?\?",
    "label_before_after": rf"was label {_LABEL} more common, less common, or the same frequency "
                          r"before (?P<d>.+?), as compared to after (?P=d)\?",
    "first_month_a_beats_b": r"In which month did the label '(?P<a>.+?)'? first occur more often "
                             r"than the label '(?P<b>[^']+)'\?",
    "months_a_beats_b": rf"For how many months does the label {_LABEL} occur more frequently than "
                        r"the label '(?P<b>[^']+)'\?",
    "months_label_most_common": rf"For how many months is the label {_LABEL} the single most "
                                r"frequently occur+ing label\?",
}
_COMPILED = {k: re.compile(p, re.I) for k, p in _PATTERNS.items()}
_FORM = re.compile(r"\s*Give your final answer\b", re.I)
_CHOICES = re.compile(r"one of the labels:\s*(?P<choices>[^.]+)", re.I)


def _unknown(question: str, why: str = "") -> UnknownQuestionError:
    start = " ".join(question.split())
    start = start if len(start) <= 90 else start[:90] + "..."
    return UnknownQuestionError(
        f"question not in OOLONG-synth's wording{why}: {start!r}; known kinds: "
        f"{', '.join(QUESTION_KINDS)}")


def _known_label(text: str, labels: Sequence[str]) -> str:
    """``text`` itself, or the known label it starts with (unquoted labels end at '?' or ':')."""
    text = text.strip()
    if not labels or text in labels:
        return text
    for label in sorted(labels, key=len, reverse=True):
        if text.startswith(label):
            return label
    return text


def _choices(form: str, labels: Sequence[str]) -> tuple[str, ...]:
    m = _CHOICES.search(form)
    if not m:
        return ()
    listed = m.group("choices")
    parts = [p.strip() for p in listed.split(",") if p.strip()]
    if not labels or all(p in labels for p in parts):
        return tuple(parts)
    # a label holding ", ": take the known labels in the order they appear
    found = sorted((listed.find(lab), lab) for lab in labels if lab in listed)
    return tuple(lab for _, lab in found)


def parse_question(question: str, labels: Sequence[str] = ()) -> QuestionSpec:
    """Read a question in OOLONG-synth's wording.

    ``labels`` is the task's label set: it resolves unquoted labels (``with the label human
    being?``) and every label the question names must be in it (when it is given).
    Raises `UnknownQuestionError` for any other wording, `ValueError` for a named label outside
    ``labels`` or a bad date.
    """
    text = " ".join(str(question).split())
    cut = _FORM.search(text)
    core, form = (text[:cut.start()], text[cut.start():]) if cut else (text, "")
    scope, params, rest = "all", {}, core
    for name, prefix in _PREFIXES:
        m = prefix.match(core)
        if m:
            scope, params, rest = name, m.groupdict(), core[m.end():]
            break
    for kind, pattern in _COMPILED.items():
        m = pattern.match(rest)
        if m:
            break
    else:
        raise _unknown(question)
    if kind in _NO_PREFIX and rest is not core:
        raise _unknown(question, f" ({kind} questions have no prefix)")
    got = m.groupdict()
    named = [got[k] for k in ("a", "b") if got.get(k)]
    spec_labels = tuple(_known_label(x, labels) for x in named)
    if kind in ("most_common_label", "least_common_label"):
        spec_labels = _choices(form, labels)
    if labels:
        for label in spec_labels:
            if label not in labels:
                raise ValueError(f"the question names label {label!r}, not in the task's label "
                                 f"set ({', '.join(labels)})")
    users: tuple[str, ...] = ()
    if params.get("users"):
        users = tuple(u.strip() for u in params["users"].split(","))
    if got.get("u"):
        users = (got["u"], got["v"])
    if scope not in SCOPES_OF.get(kind, ("all",)):
        raise _unknown(question, f" (OOLONG-synth asks no {kind} question in scope {scope!r})")
    return QuestionSpec(
        kind=kind, answer_type=ANSWER_TYPE_OF[kind], scope=scope, labels=spec_labels,
        users=users,
        month=MONTH_NAMES.index(params["month"].capitalize()) + 1 if params.get("month") else None,
        date_range=(parse_date(params["lo"]), parse_date(params["hi"])) if scope == "range" else None,
        date=parse_date(got["d"]) if got.get("d") else None,
        count=int(got["n"]) if got.get("n") else None,
    )


# ------------------------------------------------------------------------------ answers

_Record = tuple[dt.date, str, str]


def _records(rows: Iterable[Sequence]) -> list[_Record]:
    return [(parse_date(str(r[0])), str(r[1]), str(r[-1])) for r in rows]


def _ranked(counts: Counter, rank: int, least: bool = False) -> object | None:
    """The key at ``rank`` (1 = most) when its count differs from its neighbours', else None."""
    ordered = sorted(counts.values(), reverse=not least)
    if len(ordered) < rank:
        return None
    value = ordered[rank - 1]
    if (rank > 1 and ordered[rank - 2] == value) or (len(ordered) > rank and ordered[rank] == value):
        return None
    return next(k for k, c in counts.items() if c == value)


def _months(records: Sequence[_Record]) -> dict[tuple[int, int], Counter]:
    out: dict[tuple[int, int], Counter] = {}
    for date, _, label in records:
        out.setdefault((date.year, date.month), Counter())[label] += 1
    return dict(sorted(out.items()))


def _compare(a: Fraction | int, b: Fraction | int, phrases: tuple[str, str, str]) -> str:
    return phrases[0] if a > b else phrases[1] if a < b else phrases[2]


def solve(spec: QuestionSpec, rows: Iterable[Sequence]) -> str | None:
    """The answer to ``spec`` over ``rows`` (``(date, user, ..., label)``, date as the context
    writes it), in the forms the module docstring lists; ``None`` when it would be a tie."""
    records = [r for r in _records(rows) if spec.in_scope(r[0], r[1])]
    labels = [r[2] for r in records]
    kind = spec.kind
    if kind in ("most_common_label", "least_common_label"):
        choices = spec.labels or tuple(dict.fromkeys(labels))
        counts = Counter({c: 0 for c in choices})
        counts.update(x for x in labels if x in counts)
        return _ranked(counts, 1, least=kind == "least_common_label")  # type: ignore[return-value]
    if kind == "label_vs_label":
        a, b = spec.labels
        return _compare(labels.count(a), labels.count(b),
                        ("more common than", "less common than", "same frequency as"))
    if kind == "label_count":
        return str(labels.count(spec.labels[0]))
    if kind in ("most_common_user", "second_most_common_user", "user_most_label"):
        users = Counter(u for _, u, x in records
                        if kind != "user_most_label" or x == spec.labels[0])
        return _ranked(users, 2 if kind.startswith("second") else 1)  # type: ignore[return-value]
    if kind == "user_vs_user_label":
        u, v = spec.users
        cu = sum(1 for _, user, x in records if user == u and x == spec.labels[0])
        cv = sum(1 for _, user, x in records if user == v and x == spec.labels[0])
        return None if cu == cv else (u if cu > cv else v)
    if kind in ("most_common_date", "second_most_common_date"):
        best = _ranked(Counter(d for d, _, _ in records), 2 if kind.startswith("second") else 1)
        return best.isoformat() if best else None  # type: ignore[attr-defined]
    if kind == "dates_with_count":
        return str(sum(1 for c in Counter(d for d, _, _ in records).values() if c == spec.count))
    if kind == "label_before_after":
        before = [x for d, _, x in records if d < spec.date]  # type: ignore[operator]
        after = [x for d, _, x in records if d > spec.date]  # type: ignore[operator]
        if not before or not after:
            return None
        a = spec.labels[0]
        return _compare(Fraction(before.count(a), len(before)), Fraction(after.count(a), len(after)),
                        ("more common", "less common", "the same frequency"))
    months = _months(records)
    if kind == "first_month_a_beats_b":
        a, b = spec.labels
        for (year, month), counts in months.items():
            if counts[a] > counts[b]:
                return f"{MONTH_NAMES[month - 1]} {year}"
        return None
    if kind == "months_a_beats_b":
        a, b = spec.labels
        return str(sum(1 for counts in months.values() if counts[a] > counts[b]))
    if kind == "months_label_most_common":
        a = spec.labels[0]
        return str(sum(1 for counts in months.values()
                       if all(counts[a] > c for lab, c in counts.items() if lab != a)))
    raise ValueError(f"unknown question kind {kind!r}; known: {', '.join(QUESTION_KINDS)}")


def format_answer(spec: QuestionSpec, answer: str) -> str:
    """``answer`` (as `solve` writes it) in the form the question asks for, e.g.
    ``Label: entity``, ``Date: 06/29/2022``, ``Answer: entity is more common than location``."""
    t = spec.answer_type
    if t == "ANSWER_TYPE.LABEL":
        return f"Label: {answer}"
    if t == "ANSWER_TYPE.USER":
        return f"User: {answer}"
    if t == "ANSWER_TYPE.DATE":
        return "Date: " + parse_date(answer).strftime("%m/%d/%Y")
    if spec.kind == "label_vs_label":
        return f"Answer: {spec.labels[0]} is {answer} {spec.labels[1]}"
    if spec.kind == "label_before_after":
        return f"Answer: {spec.labels[0]} is {answer} before {spec.date.isoformat()}"  # type: ignore[union-attr]
    return f"Answer: {answer}"
