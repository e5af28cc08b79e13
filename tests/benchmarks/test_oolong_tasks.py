"""The generator, the JSONL task format and its errors."""

import json
import re
from collections import Counter

import pytest

from benchmarks.oolong.generate import QUESTION_TYPES, generate, make_rows, parse_sizes
from benchmarks.oolong.programs import SHAPES, reference_code, shape_of
from benchmarks.oolong.tasks import TaskFileError, load_tasks, save_tasks
from benchmarks.oolong.words import LABELS

ROW = re.compile(r"^Date: \w{3} \d{2}, 20(22|23|24|25) \|\| User: \d{5} \|\| Instance: .+$")


def test_generated_context_has_oolong_synth_form_and_size():
    tasks = generate([1024, 8192], 2, seed=3)
    assert len(tasks) == 4
    for t in tasks:
        lines = t.context.split("\n")
        assert lines[0].startswith(f"The following lines contain {len(t.rows)} general-knowledge")
        assert "6 categories" in lines[0]
        assert "Recall:" in lines[-1]
        rows = [ln for ln in lines if ln.startswith("Date:")]
        assert len(rows) == len(t.rows) and all(ROW.match(r) for r in rows)
        target = 1024 if "-1k-" in t.id else 8192
        assert 0.9 * target <= t.context_tokens <= 1.1 * target
        assert t.task in QUESTION_TYPES and t.answer_type == QUESTION_TYPES[t.task][1]


def test_generation_is_seeded_and_skewed():
    a = generate([4096], 1, seed=11)[0]
    assert a.to_json() == generate([4096], 1, seed=11)[0].to_json()
    assert a.context != generate([4096], 1, seed=12)[0].context
    import random
    rows = make_rows(random.Random(0), 16384)
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


def test_every_question_type_gets_a_correct_gold_answer_from_its_reference_program():
    tasks = generate([2048], len(QUESTION_TYPES), seed=5)
    assert len({t.task for t in tasks}) >= len(QUESTION_TYPES) - 1  # a tie may skip one
    for i, t in enumerate(tasks):
        code = reference_code(t, SHAPES[i % 3])
        assert shape_of(code) == SHAPES[i % 3]
        compile(code, "<program>", "exec")


def test_roundtrip_and_oolong_answer_form(tmp_path):
    tasks = generate([1024], 2, seed=0)
    path = save_tasks(tasks, tmp_path / "t.jsonl")
    assert [t.to_json() for t in load_tasks(path)] == [t.to_json() for t in tasks]
    line = json.dumps({"id": 7, "context": "x", "question": "q?", "answer": "['human being']",
                       "answer_type": "ANSWER_TYPE.LABEL"})
    (tmp_path / "o.jsonl").write_text(line + "\n")
    (task,) = load_tasks(tmp_path / "o.jsonl")
    assert task.answer == "human being" and task.id == "7" and task.rows == []


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
