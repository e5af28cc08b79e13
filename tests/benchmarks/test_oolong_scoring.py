"""OOLONG-synth scoring: hand-written cases for every answer type."""

import pytest

from benchmarks.oolong.scoring import candidate, score


@pytest.mark.parametrize("output, expected", [
    ("Label: human being", "human being"),
    ("**Label: [location]**", "location"),
    ("The answer is: 12", "12"),
    ("entity", "entity"),                       # no colon, short: whole
    ("I think the most common one is entity", "entity"),  # no colon, long: last word
    ("Answer: location is more common than entity", "more common"),
    ("Answer: a is less common than b at all", "less common"),
    ("Date: Jun 29, 2022", "Jun 29, 2022"),
])
def test_candidate(output, expected):
    assert candidate(output) == expected


@pytest.mark.parametrize("output, gold, kind, expected", [
    # LABEL: exact only
    ("Label: human being", "human being", "ANSWER_TYPE.LABEL", 1.0),
    ("Label: Human Being", "human being", "ANSWER_TYPE.LABEL", 0.0),
    ("Label: entity", "location", "ANSWER_TYPE.LABEL", 0.0),
    # COMPARISON: the phrase in a long answer, or the exact gold phrase
    ("Answer: entity is more common than location", "more common than",
     "ANSWER_TYPE.COMPARISON", 1.0),
    ("Answer: entity is less common than location", "more common than",
     "ANSWER_TYPE.COMPARISON", 0.0),
    ("Answer: same frequency as", "same frequency as", "ANSWER_TYPE.COMPARISON", 1.0),
    ("Answer: numeric value is same frequency as entity", "same frequency as",
     "ANSWER_TYPE.COMPARISON", 1.0),
    # NUMERIC: 0.75 ** |gold - pred|
    ("Answer: 12", "12", "ANSWER_TYPE.NUMERIC", 1.0),
    ("Answer: 10", "12", "ANSWER_TYPE.NUMERIC", 0.75 ** 2),
    ("Answer: 15", "12", "ANSWER_TYPE.NUMERIC", 0.75 ** 3),
    ("Answer: twelve", "12", "ANSWER_TYPE.NUMERIC", 0.0),
    # USER
    ("User: 44436", "44436", "ANSWER_TYPE.USER", 1.0),
    ("User: 44437", "44436", "ANSWER_TYPE.USER", 0.0),
    # DATE: parsed
    ("Date: Jun 29, 2022", "Jun 29, 2022", "ANSWER_TYPE.DATE", 1.0),
    ("Date: 2022-06-29", "Jun 29, 2022", "ANSWER_TYPE.DATE", 1.0),
    ("Date: June 29, 2022", "Jun 29, 2022", "ANSWER_TYPE.DATE", 1.0),
    ("Date: Jun 28, 2022", "Jun 29, 2022", "ANSWER_TYPE.DATE", 0.0),
    ("Date: soon", "Jun 29, 2022", "ANSWER_TYPE.DATE", 0.0),
    # MONTH_YEAR: parsed
    ("Month: Mar 2023", "Mar 2023", "ANSWER_TYPE.MONTH_YEAR", 1.0),
    ("Month: March 2023", "Mar 2023", "ANSWER_TYPE.MONTH_YEAR", 1.0),
    ("Month: 2023-03", "Mar 2023", "ANSWER_TYPE.MONTH_YEAR", 1.0),
    ("Month: Apr 2023", "Mar 2023", "ANSWER_TYPE.MONTH_YEAR", 0.0),
])
def test_score(output, gold, kind, expected):
    assert score(output, gold, kind) == pytest.approx(expected)
