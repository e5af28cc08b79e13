"""Scoring a final answer as OOLONG scores it, and reading OOLONG's stored answers.

OOLONG-synth (answer types ``ANSWER_TYPE.*``): the candidate is the text after the last ``:``
of the output with ``*``, ``[`` and ``]`` removed (an output without ``:`` is used whole when
shorter than 20 characters, else its last word); a candidate of 20 characters or more that
contains ``more common`` / ``less common`` / ``same frequency`` is reduced to that phrase. Then:
exact match scores 1; a comparison phrase scores 1 when the gold answer contains it; a number
scores ``0.75 ** |gold - pred|``; a date scores 1 when it parses to the gold day; anything else
(month-years included) 0. OOLONG parses dates with ``dateutil``; here a fixed list of forms
(``Jun 29, 2022``, ``06/29/2022``, ``2022-06-29``, ...) is accepted.

OOLONG-real (`REAL_ANSWER_TYPE`): the candidate is the content of the first ``\\boxed{...}``
(the whole output when there is none); gold and candidate are read as an integer, a comma
separated list or a text: integers score ``0.75 ** |gold - pred|``, lists the share of gold
items found, texts 1 on a case-insensitive match.

Stored answers (`normalize_answer`): OOLONG keeps a gold answer as the string of a Python list,
``"['human being']"``, ``"[3]"``, ``"[44436]"``, ``"['June 2023']"`` or
``"[datetime.date(2023, 5, 1)]"``. Its scorer uses the list's first item; so does this one. A
date is normalised to ISO form (``"2023-05-01"``).
"""

from __future__ import annotations

import ast
import datetime as dt
import re
from typing import Any

ANSWER_TYPES = (
    "ANSWER_TYPE.LABEL",
    "ANSWER_TYPE.NUMERIC",
    "ANSWER_TYPE.COMPARISON",
    "ANSWER_TYPE.USER",
    "ANSWER_TYPE.DATE",
    "ANSWER_TYPE.MONTH_YEAR",
)
"""OOLONG-synth's answer types, in its spelling."""
REAL_ANSWER_TYPE = "OOLONG_REAL"
"""The answer type given to OOLONG-real tasks (scored by OOLONG-real's rules)."""

PHRASES = ("more common", "less common", "same frequency")
_DATE_FORMATS = ("%b %d, %Y", "%B %d, %Y", "%Y-%m-%d", "%m/%d/%Y", "%d %b %Y", "%d %B %Y",
                 "%b %d %Y", "%B %d %Y", "%m-%d-%Y", "%Y/%m/%d")
_STORED_DATE = re.compile(r"datetime\.date\(\s*(\d{4})\s*,\s*(\d{1,2})\s*,\s*(\d{1,2})\s*\)")
_BOXED_TEXT = re.compile(r"\\boxed\{\\text\{([^}]*)\}\}")
_BOXED = re.compile(r"\\boxed\{+([^}]*)\}+")


def normalize_answer(value: Any) -> str:
    """A stored gold answer as one string: the first item of OOLONG's list form, dates in ISO
    form. Raises ``ValueError`` for a value that is not a string, a number or a list of them."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError("is an empty list")
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, (str, int, float, dt.date)):
        raise ValueError("must be a string, a number or a list of them")
    if isinstance(value, dt.date):
        return value.isoformat()
    text = str(value).strip()
    m = _STORED_DATE.search(text)
    if m and (text.startswith("[") or text.startswith("datetime.date(")):
        y, mo, d = (int(x) for x in m.groups())
        return dt.date(y, mo, d).isoformat()
    if text.startswith("[") and text.endswith("]"):
        try:
            items = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text
        if isinstance(items, list) and items:
            return str(items[0]).strip()
    return text


def candidate(output: str) -> str:
    """The part of a model's final output that is compared with the gold answer (OOLONG-synth)."""
    output = str(output)
    if ":" not in output:
        return output if len(output) < 20 else (output.split() or [""])[-1]
    cand = output.split(":")[-1].strip().replace("*", "").replace("[", "").replace("]", "")
    if len(cand) >= 20:
        for phrase in PHRASES:
            if phrase in cand:
                return phrase
    return cand


def parse_any_date(text: str) -> dt.date | None:
    """A date in one of the accepted forms, else None."""
    text = re.sub(r"\s+", " ", str(text).strip().rstrip("."))
    for fmt in _DATE_FORMATS:
        try:
            return dt.datetime.strptime(text, fmt).date()
        except ValueError:
            continue
    return None


def _real_value(text: str) -> int | str | list[str]:
    text = text.strip()
    try:
        return int(text)
    except ValueError:
        pass
    if "," in text:
        return [x.strip() for x in text.split(",") if x.strip()]
    return text


def score_real(output: str, gold: str) -> float:
    """OOLONG-real's score of ``output`` for ``gold``."""
    m = _BOXED_TEXT.search(str(output)) or _BOXED.search(str(output))
    got = _real_value(m.group(1) if m else str(output))
    want = _real_value(str(gold))
    if isinstance(want, int) and isinstance(got, int):
        return 0.75 ** abs(want - got)
    if isinstance(want, str) and isinstance(got, str):
        return float(want.strip().lower() == got.strip().lower())
    if isinstance(want, list) and isinstance(got, list):
        return len(set(want) & set(got)) / len(want) if want else 0.0
    return 0.0


def score(output: str, gold: Any, answer_type: str) -> float:
    """The score in [0, 1] of ``output`` for the gold answer ``gold`` (stored forms accepted)."""
    gold = normalize_answer(gold)
    if answer_type == REAL_ANSWER_TYPE:
        return score_real(output, gold)
    cand = candidate(output)
    if cand == gold:
        return 1.0
    if cand in PHRASES:
        return 1.0 if cand in gold else 0.0
    if answer_type == "ANSWER_TYPE.NUMERIC":
        try:
            return 0.75 ** abs(int(gold) - int(cand))
        except ValueError:
            return 0.0
    if answer_type == "ANSWER_TYPE.DATE":
        got, want = parse_any_date(cand), parse_any_date(gold)
        return 1.0 if got is not None and got == want else 0.0
    return 0.0
