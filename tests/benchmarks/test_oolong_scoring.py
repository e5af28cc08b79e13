"""OOLONG scoring: hand-written cases for every answer type, and OOLONG's stored answer forms."""

import datetime as dt

import pytest

from benchmarks.oolong.scoring import REAL_ANSWER_TYPE, candidate, normalize_answer, score


@pytest.mark.parametrize("output, expected", [
    ("Label: human being", "human being"),
    ("**Label: [location]**", "location"),
    ("The answer is: 12", "12"),
    ("entity", "entity"),                       # no colon, short: whole
    ("I think the most common one is entity", "entity"),  # no colon, long: last word
    ("Answer: location is more common than entity", "more common"),
    ("Answer: a is less common than b at all", "less common"),
    ("Answer: more common", "more common"),     # short: kept whole
    ("Date: 06/29/2022", "06/29/2022"),
])
def test_candidate(output, expected):
    assert candidate(output) == expected


@pytest.mark.parametrize("stored, expected", [
    ("['human being']", "human being"),
    ("[3]", "3"),
    ("[44436]", "44436"),
    ("['June 2023']", "June 2023"),
    ("[datetime.date(2023, 5, 1)]", "2023-05-01"),
    ("[datetime.date(2022, 12, 31)]", "2022-12-31"),
    ("['more common than']", "more common than"),
    ("['location', 'entity']", "location"),     # a tie stored in full: OOLONG scores the first
    (["spam"], "spam"),
    (7, "7"),
    (dt.date(2023, 5, 1), "2023-05-01"),
    ("plain text", "plain text"),
    ("[not python", "[not python"),
])
def test_normalize_answer_reads_oolongs_stored_forms(stored, expected):
    assert normalize_answer(stored) == expected


@pytest.mark.parametrize("bad", [None, True, [], {"a": 1}])
def test_normalize_answer_rejects_other_values(bad):
    with pytest.raises(ValueError):
        normalize_answer(bad)


@pytest.mark.parametrize("output, gold, kind, expected", [
    # LABEL: exact only
    ("Label: human being", "human being", "ANSWER_TYPE.LABEL", 1.0),
    ("Label: human being", "['human being']", "ANSWER_TYPE.LABEL", 1.0),
    ("Label: Human Being", "human being", "ANSWER_TYPE.LABEL", 0.0),
    ("Label: entity", "location", "ANSWER_TYPE.LABEL", 0.0),
    ("Label: location", "['location', 'entity']", "ANSWER_TYPE.LABEL", 1.0),
    ("Label: entity", "['location', 'entity']", "ANSWER_TYPE.LABEL", 0.0),
    # COMPARISON: the phrase in a long answer, or the exact gold phrase
    ("Answer: entity is more common than location", "more common than",
     "ANSWER_TYPE.COMPARISON", 1.0),
    ("Answer: entity is less common than location", "['more common than']",
     "ANSWER_TYPE.COMPARISON", 0.0),
    ("Answer: same frequency as", "same frequency as", "ANSWER_TYPE.COMPARISON", 1.0),
    ("Answer: numeric value is same frequency as entity", "same frequency as",
     "ANSWER_TYPE.COMPARISON", 1.0),
    ("Answer: entity is the same frequency before 2023-02-02", "['the same frequency']",
     "ANSWER_TYPE.COMPARISON", 1.0),
    ("Answer: entity is less common before 2023-02-02", "['less common']",
     "ANSWER_TYPE.COMPARISON", 1.0),
    # NUMERIC: 0.75 ** |gold - pred|
    ("Answer: 12", "12", "ANSWER_TYPE.NUMERIC", 1.0),
    ("Answer: 12", "[12]", "ANSWER_TYPE.NUMERIC", 1.0),
    ("Answer: 10", "[12]", "ANSWER_TYPE.NUMERIC", 0.75 ** 2),
    ("Answer: 15", "12", "ANSWER_TYPE.NUMERIC", 0.75 ** 3),
    ("Answer: twelve", "12", "ANSWER_TYPE.NUMERIC", 0.0),
    # USER
    ("User: 44436", "[44436]", "ANSWER_TYPE.USER", 1.0),
    ("User: 44437", "44436", "ANSWER_TYPE.USER", 0.0),
    # DATE: parsed, against OOLONG's stored date
    ("Date: 05/01/2023", "[datetime.date(2023, 5, 1)]", "ANSWER_TYPE.DATE", 1.0),
    ("Date: May 01, 2023", "[datetime.date(2023, 5, 1)]", "ANSWER_TYPE.DATE", 1.0),
    ("Date: 2023-05-01", "2023-05-01", "ANSWER_TYPE.DATE", 1.0),
    ("Date: June 29, 2022", "Jun 29, 2022", "ANSWER_TYPE.DATE", 1.0),
    ("Date: 05/02/2023", "[datetime.date(2023, 5, 1)]", "ANSWER_TYPE.DATE", 0.0),
    ("Date: soon", "2023-05-01", "ANSWER_TYPE.DATE", 0.0),
    # MONTH_YEAR: exact, as OOLONG scores it
    ("Answer: June 2023", "['June 2023']", "ANSWER_TYPE.MONTH_YEAR", 1.0),
    ("Answer: **June 2023**", "June 2023", "ANSWER_TYPE.MONTH_YEAR", 1.0),
    ("Answer: Jun 2023", "['June 2023']", "ANSWER_TYPE.MONTH_YEAR", 0.0),
    ("Answer: July 2023", "June 2023", "ANSWER_TYPE.MONTH_YEAR", 0.0),
])
def test_score(output, gold, kind, expected):
    assert score(output, gold, kind) == pytest.approx(expected)


@pytest.mark.parametrize("output, gold, expected", [
    ("The total is \\boxed{12}.", "12", 1.0),
    ("\\boxed{10}", "12", 0.75 ** 2),
    ("12", "12", 1.0),                                   # no box: the whole output
    ("I count \\boxed{\\text{Fire Bolt}}", "fire bolt", 1.0),
    ("\\boxed{Fire Bolt}", "Shield", 0.0),
    ("\\boxed{Shield, Cure Wounds}", "Shield, Cure Wounds, Bless", 2 / 3),
    ("\\boxed{Shield}", "Shield, Cure Wounds", 0.0),      # a text against a list
])
def test_oolong_real_scoring(output, gold, expected):
    assert score(output, gold, REAL_ANSWER_TYPE) == pytest.approx(expected)
