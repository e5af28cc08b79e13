"""The generator, the JSONL task format and its errors."""

import json
import re
from collections import Counter

import pytest

from benchmarks.oolong.generate import QUESTION_TYPES, format_row, generate, make_rows, parse_sizes
from benchmarks.oolong.questions import parse_date
from benchmarks.oolong.tasks import TaskFileError, load_tasks, save_tasks
from benchmarks.oolong.words import LABELS

ROW = re.compile(r"^Date: \w{3} \d{2}, 20(22|23|24|25) \|\| User: \d{5} \|\| Instance: .+$")


def test_generated_context_has_oolong_synth_form_and_size():
    tasks = generate([1024, 8192], 2, seed=3)
    assert len(tasks) == 4
    for t in tasks:
        n = len(t.rows)
        head, _, rest = t.context.partition("\n\n")
        assert head == (f"The following lines contain {n} general-knowledge questions, one per "
                        "line. Each question has an answer that can be described as one of 6 "
                        "categories: 'abbreviation', 'entity', 'description and abstract "
                        "concept', 'human being', 'location', 'numeric value'.")
        assert rest.startswith(f"You will be asked to answer questions about the aggregate label "
                               f"statistics across all {n} examples in this dataset.")
        assert f"\nRecall: the preceding lines contain {n} general-knowledge" in t.context
        assert t.context.endswith("Calculate the exact answer given these datapoints.\n\n")
        rows = [ln for ln in t.context.split("\n") if ln.startswith("Date:")]
        assert rows == [format_row(r) for r in t.rows] and all(ROW.match(r) for r in rows)
        dates = [parse_date(r[0]) for r in t.rows]
        assert dates != sorted(dates)                  # shuffled, as OOLONG-synth's windows
        target = 1024 if "-1k-" in t.id else 8192
        assert 0.9 * target <= t.context_tokens <= 1.1 * target
        assert t.task in QUESTION_TYPES and t.answer_type == QUESTION_TYPES[t.task][1]
        assert t.labels == list(LABELS)


def test_another_dataset_brings_its_own_label_set():
    (t,) = generate([2048], 1, seed=1, dataset="app_reviews")
    assert t.labels == ["negative", "positive"] and {r[3] for r in t.rows} == {"negative", "positive"}
    assert t.context.startswith(f"The following lines contain {len(t.rows)} reviews of software "
                                "applications, one per line.")
    with pytest.raises(ValueError, match="unknown dataset 'x'; known: "):
        generate([2048], 1, seed=1, dataset="x")
    with pytest.raises(ValueError, match="asked in scopes all, users, month, range, not 'year'"):
        generate([2048], 1, seed=1, kinds=["label_count@year"])


def test_generation_is_seeded_and_skewed():
    a = generate([4096], 1, seed=11)[0]
    assert a.to_json() == generate([4096], 1, seed=11)[0].to_json()
    assert a.context != generate([4096], 1, seed=12)[0].context
    import random
    rows = make_rows(random.Random(0), 16384)
    assert rows == make_rows(random.Random(0), 16384)
    users = Counter(r[1] for r in rows).most_common()
    labels = Counter(r[3] for r in rows).most_common()
    assert users[0][1] >= 3 * users[-1][1]          # skewed users
    assert labels[0][1] >= 1.5 * labels[-1][1]      # skewed labels
    assert {r[3] for r in rows} <= set(LABELS)


def test_first_word_does_not_give_the_label_away():
    import random
    rows = make_rows(random.Random(1), 16384)
    by_word: dict[str, set[str]] = {}
    for r in rows:
        by_word.setdefault(r[2].split()[0], set()).add(r[3])
    assert all(len(labels) >= 4 for labels in by_word.values())


def test_question_types_are_taken_in_turn():
    tasks = generate([2048], len(QUESTION_TYPES), seed=5)
    assert len({t.task for t in tasks}) >= len(QUESTION_TYPES) - 3  # ties may skip a few


def test_roundtrip_and_oolong_answer_forms(tmp_path):
    tasks = generate([1024], 2, seed=0) + generate([1024], 1, seed=0, dataset="app_reviews")
    path = save_tasks(tasks, tmp_path / "t.jsonl")
    assert [t.to_json() for t in load_tasks(path)] == [t.to_json() for t in tasks]
    lines = [{"id": 7, "context": "x", "question": "q?", "answer": "['human being']",
              "answer_type": "ANSWER_TYPE.LABEL"},
             {"id": 8, "context": "x", "question": "q?", "answer": "[datetime.date(2023, 5, 1)]",
              "answer_type": "ANSWER_TYPE.DATE", "labels": ["ham", "spam"],
              "rows": [["May 01, 2023", 123, "hi", "ham"]]},
             {"id": 9, "context": "x", "question": "q?", "answer": 3,
              "answer_type": "OOLONG_REAL", "labels": []}]
    (tmp_path / "o.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    old, new, real = load_tasks(tmp_path / "o.jsonl")
    assert old.answer == "human being" and old.id == "7" and old.rows == []
    assert old.labels == list(LABELS)                  # absent: TREC-coarse's six labels
    assert new.answer == "2023-05-01" and new.labels == ["ham", "spam"]
    assert new.rows == [("May 01, 2023", "123", "hi", "ham")]
    assert real.answer == "3" and real.labels == []


@pytest.mark.parametrize("obj, message", [
    ({"context": "c", "question": "q", "answer": "1", "answer_type": "ANSWER_TYPE.NUMERIC"},
     "line 2: field 'id' is missing"),
    ({"id": "a", "context": "c", "question": "q", "answer": "1", "answer_type": "NUMERIC"},
     "line 2: field 'answer_type' must be one of"),
    ({"id": "a", "context": "", "question": "q", "answer": "1",
      "answer_type": "ANSWER_TYPE.NUMERIC"}, "line 2: field 'context'"),
    ({"id": "a", "context": "c", "question": "q", "answer": "1",
      "answer_type": "ANSWER_TYPE.NUMERIC", "rows": [["Jun 01, 2022", "12345", "q"]]},
     "line 2: field 'rows' row 0"),
    ({"id": "a", "context": "c", "question": "q", "answer": None,
      "answer_type": "ANSWER_TYPE.NUMERIC"}, "line 2: field 'answer'"),
    ({"id": "a", "context": "c", "question": "q", "answer": "1",
      "answer_type": "ANSWER_TYPE.NUMERIC", "labels": ["ham", "ham"]},
     "line 2: field 'labels' repeats a label: 'ham'"),
    ({"id": "a", "context": "c", "question": "q", "answer": "1",
      "answer_type": "ANSWER_TYPE.NUMERIC", "labels": "ham,spam"},
     "line 2: field 'labels' must be a list of non-empty strings"),
    ({"id": "a", "context": "c", "question": "q", "answer": "1",
      "answer_type": "ANSWER_TYPE.NUMERIC", "labels": ["ham", "spam"],
      "rows": [["Jun 01, 2022", "12345", "q", "eggs"]]},
     "line 2: field 'rows' row 0 has label 'eggs', not in field 'labels' (ham, spam)"),
])
def test_malformed_line_names_line_and_field(tmp_path, obj, message):
    good = {"id": "ok", "context": "c", "question": "q", "answer": "1",
            "answer_type": "ANSWER_TYPE.NUMERIC"}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(obj) + "\n")
    with pytest.raises(TaskFileError, match=re.escape(message)):
        load_tasks(path)


def test_bad_json_and_duplicate_ids(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": 1\n')
    with pytest.raises(TaskFileError, match=r"bad.jsonl, line 1: not valid JSON"):
        load_tasks(path)
    line = json.dumps({"id": "a", "context": "c", "question": "q", "answer": "1",
                       "answer_type": "ANSWER_TYPE.NUMERIC"})
    path.write_text(line + "\n" + line + "\n")
    with pytest.raises(TaskFileError, match=r"line 2: field .id. repeats"):
        load_tasks(path)


def test_parse_sizes():
    assert parse_sizes("1k,4K,16384") == [1024, 4096, 16384]
    with pytest.raises(ValueError, match="bad size"):
        parse_sizes("4kb")
