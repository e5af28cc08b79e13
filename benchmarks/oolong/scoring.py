"""OOLONG-synth scoring of a final answer against the gold answer.

The candidate is the text after the last ``:`` of the output with ``*``, ``[`` and ``]`` removed
(an output without ``:`` is used whole when short, else its last word); a long candidate that
contains a comparison phrase (``more common`` / ``less common`` / ``same frequency``) is reduced to
that phrase. Then: exact match scores 1; a comparison phrase scores 1 when the gold answer contains
it; a number scores ``0.75 ** |gold - pred|``; dates and month-years score 1 when they name the
same day (month); anything else 0.
"""

from __future__ import annotations

import datetime as dt
import re

PHRASES = ("more common", "less common", "same frequency")
_DATE_FORMATS = ("%b %d, %Y", "%B %d, %Y", "%Y-%m-%d", "%d %b %Y", "%d %B %Y", "%b %d %Y",
                 "%m/%d/%Y")
_MONTH_FORMATS = ("%b %Y", "%B %Y", "%Y-%m", "%m/%Y", "%b, %Y", "%B, %Y")


def candidate(output: str) -> str:
    """The part of a model's final output that is compared with the gold answer."""
    output = str(output)
    if ":" not in output:
        return output if len(output) < 20 else (output.split() or [""])[-1]
    cand = output.split(":")[-1].strip().replace("*", "").replace("[", "").replace("]", "")
    if len(cand) >= 20:
        for phrase in PHRASES:
            if phrase in cand:
                return phrase
    return cand


def _date(text: str, formats: tuple[str, ...]) -> dt.date | None:
    text = re.sub(r"\s+", " ", text.strip().rstrip("."))
    for fmt in formats:
        try:
            return dt.datetime.strptime(text, fmt).date()
        except ValueError:
            continue
    return None


def score(output: str, gold: str, answer_type: str) -> float:
    """OOLONG-synth score in [0, 1] of ``output`` for the gold answer ``gold``."""
    cand = candidate(output)
    gold = str(gold).strip()
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
        got, want = _date(cand, _DATE_FORMATS), _date(gold, _DATE_FORMATS)
        return 1.0 if got is not None and got == want else 0.0
    if answer_type == "ANSWER_TYPE.MONTH_YEAR":
        got, want = _date(cand, _MONTH_FORMATS), _date(gold, _MONTH_FORMATS)
        return 1.0 if got is not None and got == want else 0.0
    return 0.0
