"""OOLONG-synth's question wording: parsing, rendering and answering from rows."""

import datetime as dt
import json
import re
from pathlib import Path

import pytest

from benchmarks.oolong.generate import generate
from benchmarks.oolong.questions import (ANSWER_TYPE_OF, QUESTION_KINDS, SCOPES_OF,
                                         QuestionSpec, UnknownQuestionError, format_answer,
                                         parse_question, render_question, solve)
from benchmarks.oolong.scoring import normalize_answer, score
from benchmarks.oolong.words import LABELS

FIXTURES = Path(__file__).parent / "fixtures"

# Questions as published OOLONG-synth rows word them (quoted in public evaluation traces).
PUBLISHED = [
    ("In the above data, which of the labels is the most common? Give your final answer in the "
     "form 'Label: answer' where answer is one of the labels: ham, spam.",
     ("ham", "spam"), dict(kind="most_common_label", labels=("ham", "spam"))),
    ("In the above data, which of the labels is the least common? Give your final answer in the "
     "form 'Label: answer' where answer is one of the labels: entity, human being, description "
     "and abstract concept, location, numeric value, abbreviation.", LABELS,
     dict(kind="least_common_label", labels=("entity", "human being",
                                             "description and abstract concept", "location",
                                             "numeric value", "abbreviation"))),
    ("For the following question, only consider the subset of instances that are associated "
     "with user IDs 62297. Among instances associated with these users, is label 'numeric value' "
     "more common, less common, or the same frequency as label 'abbreviation'? Give your final "
     "answer in the form 'Answer: numeric value is [X] abbreviation', where [X] is 'more common "
     "than', 'less common than', or 'same frequency as'.", LABELS,
     dict(kind="label_vs_label", scope="users", users=("62297",),
          labels=("numeric value", "abbreviation"), answer_type="ANSWER_TYPE.COMPARISON")),
    ("In the above data, is label 'negative' more common, less common, or the same frequency as "
     "label 'positive'? Give your final answer in the form 'Answer: negative is [X] positive', "
     "where [X] is 'more common than', 'less common than', or 'same frequency as'.",
     ("negative", "positive"), dict(kind="label_vs_label", labels=("negative", "positive"))),
    ("In the above data, which of the labels is the least common? Give your final answer in the "
     "form 'Label: answer' where answer is one of the labels: True, False.", ("True", "False"),
     dict(kind="least_common_label", labels=("True", "False"))),
    ("In the above data, which user is represented most often? Give your final answer in the "
     "form 'User: [X]', where [X] is the user ID.", LABELS,
     dict(kind="most_common_user", scope="all", users=(), answer_type="ANSWER_TYPE.USER")),
]


@pytest.mark.parametrize("question, labels, expected", PUBLISHED)
def test_published_questions_parse(question, labels, expected):
    spec = parse_question(question, labels)
    for name, value in expected.items():
        assert getattr(spec, name) == value, name
    assert render_question(spec) == question      # our wording is theirs, byte for byte


def _fixture_rows():
    return [json.loads(line) for line in (FIXTURES / "oolong_synth_rows.jsonl").open()]


def test_fixture_rows_in_the_published_format_parse_and_solve_to_their_stored_answers():
    """Every kind in every scope of the fixture window: the question parses, and the answer
    computed from the rows of `context_window_text_with_labels` is the stored one."""
    from benchmarks.oolong.convert import recover_rows

    seen = set()
    for row in _fixture_rows():
        if row["task"] == "TASK_TYPE.COUNT_ABOVE":
            with pytest.raises(UnknownQuestionError):
                parse_question(row["question"], LABELS)
            continue
        labels = ("ham", "spam") if row["dataset"] == "spam" else LABELS
        spec = parse_question(row["question"], labels)
        assert spec.answer_type == row["answer_type"] and spec.group == row["task_group"]
        rows = recover_rows(row["context_window_text_with_labels"], row["context_window_text"], "x")
        got = solve(spec, rows)
        if "', '" in row["answer"]:        # a tie stored in full: no single answer
            assert got is None
        else:
            assert got == normalize_answer(row["answer"]), row["question"]
        seen.add((spec.kind, spec.scope))
    # the fixture window's second most common date is a tie, so that kind is not asked there
    assert {k for k, _ in seen} == set(QUESTION_KINDS) - {"second_most_common_date"}
    assert {"users", "month", "range"} <= {s for _, s in seen}


COMBOS = [(k, s) for k in QUESTION_KINDS for s in SCOPES_OF.get(k, ("all",))]


@pytest.fixture(scope="module")
def generated():
    names = [f"{k}@{s}" for k, s in COMBOS]
    return generate([4096], len(names), seed=21, kinds=names)


def test_generator_asks_every_kind_in_every_scope_in_the_published_wording(generated):
    asked = {(t.task, parse_question(t.question, t.labels).scope) for t in generated}
    assert len(asked) >= len(COMBOS) - 2     # a window may tie on a combination
    for t in generated:
        spec = parse_question(t.question, t.labels)
        assert spec.kind == t.task and t.answer_type == ANSWER_TYPE_OF[t.task]
        assert render_question(spec) == t.question
        assert solve(spec, t.rows) == t.answer
        assert score(format_answer(spec, t.answer), t.answer, t.answer_type) == 1.0


def test_spec_fields_carry_what_a_program_needs():
    spec = parse_question(
        "For the following question, only consider the subset of instances that occur in June "
        "of any year. Among instances occuring in June, how many data points should be "
        "classified as label 'entity'? Give your final answer in the form 'Answer: number'.",
        LABELS)
    assert (spec.kind, spec.scope, spec.month, spec.month_abbr, spec.labels) == (
        "label_count", "month", 6, "Jun", ("entity",))
    assert spec.in_scope(dt.date(2021, 6, 3), "1") and not spec.in_scope(dt.date(2021, 7, 3), "1")
    spec = parse_question(
        "For the following question, only consider the subset of instances that occur between "
        "Feb 02, 2023 and Mar 05, 2023, inclusive. Among instances occuring in this date range, "
        "which of the labels is the most common? Give your final answer in the form 'Label: "
        "answer' where answer is one of the labels: entity, location.", LABELS)
    assert spec.date_range == (dt.date(2023, 2, 2), dt.date(2023, 3, 5))
    assert spec.in_scope(dt.date(2023, 3, 5), "1") and not spec.in_scope(dt.date(2023, 3, 6), "1")
    spec = parse_question(
        "In the above data, which user has more instances with the label human being: User 12 "
        "or User 345? Give your final answer in the form 'User: [X]', where [X] is the user ID.",
        LABELS)
    assert (spec.kind, spec.labels, spec.users, spec.scope) == (
        "user_vs_user_label", ("human being",), ("12", "345"), "all")
    spec = parse_question(
        "In the above data, was label 'entity' more common, less common, or the same frequency "
        "before 2023-02-02, as compared to after 2023-02-02? Give your final answer in the form "
        "'Answer: entity is [X] before 2023-02-02', where [X] is 'more common', 'less common', "
        "or 'the same frequency'.", LABELS)
    assert spec.date == dt.date(2023, 2, 2)
    spec = parse_question(
        "In the above data, how many dates are represented exactly 4 times? Give your final answer"
        " in the form 'Answer: [X]', where [X] is the number of dates represented exactly 4 "
        "times.", LABELS)
    assert (spec.kind, spec.count) == ("dates_with_count", 4)


def test_solve_counts_and_ties():
    rows = [("Jan 05, 2023", "1", "q", "entity"), ("Jan 06, 2023", "1", "q", "entity"),
            ("Feb 01, 2023", "2", "q", "location"), ("Feb 02, 2023", "2", "q", "entity"),
            ("Feb 02, 2023", "3", "q", "location")]
    most = QuestionSpec("most_common_label", "ANSWER_TYPE.LABEL", labels=("entity", "location"))
    assert solve(most, rows) == "entity"
    assert solve(most, [*rows, ("Mar 01, 2023", "3", "q", "location")]) is None  # 3 and 3
    months = QuestionSpec("months_a_beats_b", "ANSWER_TYPE.NUMERIC", labels=("entity", "location"))
    assert solve(months, rows) == "1"                     # January 2-0, February 1-2
    first = QuestionSpec("first_month_a_beats_b", "ANSWER_TYPE.MONTH_YEAR",
                         labels=("location", "entity"))
    assert solve(first, rows) == "February 2023"
    assert solve(QuestionSpec("first_month_a_beats_b", "ANSWER_TYPE.MONTH_YEAR",
                              labels=("numeric value", "entity")), rows) is None
    before = QuestionSpec("label_before_after", "ANSWER_TYPE.COMPARISON", labels=("entity",),
                          date=dt.date(2023, 2, 1))      # 2/2 before, 1/2 after
    assert solve(before, rows) == "more common"
    users = QuestionSpec("user_most_label", "ANSWER_TYPE.USER", labels=("location",))
    assert solve(users, rows) is None                     # users 2 and 3: one each


def test_unknown_question_names_its_start_and_the_known_kinds():
    with pytest.raises(UnknownQuestionError) as info:
        parse_question("In the above data, how many labels occur more than twice? " + "x" * 200,
                       LABELS)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "'In the above data, how many labels occur more than twice?" in message
    assert all(k in message for k in QUESTION_KINDS)
    with pytest.raises(UnknownQuestionError, match="no prefix"):
        parse_question("In the above data, For how many months is the label 'entity' the single "
                       "most frequently occuring label?", LABELS)


def test_a_label_outside_the_label_set_is_an_error():
    question = ("In the above data, how many data points should be classified as label 'robot'? "
                "Give your final answer in the form 'Answer: number'.")
    with pytest.raises(ValueError, match=re.escape("names label 'robot', not in the task's label "
                                                   "set")):
        parse_question(question, LABELS)
    assert parse_question(question).labels == ("robot",)      # no label set given: taken as is


@pytest.mark.parametrize("question, labels, expected", PUBLISHED)
def test_text_after_the_answer_form_is_ignored(question, labels, expected):
    tail = "\n\nPut your final answer inside \\boxed{}."
    assert parse_question(question + tail, labels) == parse_question(question, labels)
