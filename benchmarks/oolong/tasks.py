"""OOLONG-style tasks: the `Task` record and the JSONL task-file format (read and write).

One JSON object per line:

- ``id`` (str or int), ``context`` (str), ``question`` (str);
- ``answer``: a string or a number; OOLONG's stored forms are accepted and unwrapped
  (``"['human being']"`` -> ``human being``, ``"[3]"`` -> ``3``,
  ``"[datetime.date(2023, 5, 1)]"`` -> ``2023-05-01``; of a list, the first item, as OOLONG
  scores);
- ``answer_type``: one of OOLONG-synth's `ANSWER_TYPES` (``ANSWER_TYPE.LABEL``, ``.NUMERIC``,
  ``.COMPARISON``, ``.USER``, ``.DATE``, ``.MONTH_YEAR``) or `REAL_ANSWER_TYPE` (an OOLONG-real
  task, scored by OOLONG-real's rules);
- optional ``task`` (the question kind, `benchmarks.oolong.questions.QUESTION_KINDS`, or a
  dataset's own task name), ``context_tokens`` (int; default: characters / 4);
- optional ``labels``: the task's label set, a list of distinct non-empty strings. Absent: the
  six TREC-coarse labels (task files written before the field existed). ``[]``: no label set
  (an OOLONG-real task);
- optional ``rows``: ``[[date, user, instance, label], ...]`` in context order, every label in
  ``labels`` — the ground truth the simulated sub-model answers from; never shown to the root
  model. A task without rows needs a real sub-model.

A malformed line raises `TaskFileError` naming the file, the line and the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .scoring import ANSWER_TYPES, REAL_ANSWER_TYPE, normalize_answer
from .words import LABELS as TREC_COARSE_LABELS

TASK_ANSWER_TYPES = (*ANSWER_TYPES, REAL_ANSWER_TYPE)

Row = tuple[str, str, str, str]
"""(date, user, instance, label)"""


class TaskFileError(ValueError):
    """A task file line that cannot be used; the message names the line and the field."""


@dataclass
class Task:
    id: str
    context: str
    question: str
    answer: str
    answer_type: str
    task: str = ""
    context_tokens: int = 0
    rows: list[Row] = field(default_factory=list)
    labels: list[str] = field(default_factory=lambda: list(TREC_COARSE_LABELS))
    """The task's label set (the categories a row can have)."""

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "id": self.id, "context": self.context, "question": self.question,
            "answer": self.answer, "answer_type": self.answer_type,
        }
        if self.task:
            d["task"] = self.task
        if self.context_tokens:
            d["context_tokens"] = self.context_tokens
        d["labels"] = list(self.labels)
        if self.rows:
            d["rows"] = [list(r) for r in self.rows]
        return d


def _labels(value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(x, str) and x.strip() for x in value):
        raise ValueError("must be a list of non-empty strings")
    repeated = [x for i, x in enumerate(value) if x in value[:i]]
    if repeated:
        raise ValueError(f"repeats a label: {repeated[0]!r}")
    return list(value)


def _rows(value: Any, labels: Sequence[str]) -> list[Row]:
    if not isinstance(value, list):
        raise ValueError("must be a list of [date, user, instance, label]")
    rows = []
    for i, row in enumerate(value):
        if not isinstance(row, list) or len(row) != 4:
            raise ValueError(f"row {i} must be a list [date, user, instance, label]")
        if not all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in row):
            raise ValueError(f"row {i} must hold strings (or a number for the user)")
        if row[3] not in labels:
            raise ValueError(f"row {i} has label {row[3]!r}, not in field 'labels' "
                             f"({', '.join(labels) or 'empty'})")
        rows.append(tuple(str(x) for x in row))
    return rows


def parse_task(obj: Any) -> Task:
    """Check one decoded line; raises ``KeyError``/``ValueError`` carrying the field name."""
    if not isinstance(obj, dict):
        raise _FieldError("(line)", "must be a JSON object")
    for name in ("id", "context", "question", "answer", "answer_type"):
        if name not in obj:
            raise _FieldError(name, "is missing")
    for name in ("context", "question"):
        if not isinstance(obj[name], str) or not obj[name].strip():
            raise _FieldError(name, "must be a non-empty string")
    if isinstance(obj["id"], bool) or not isinstance(obj["id"], (str, int)) or str(obj["id"]) == "":
        raise _FieldError("id", "must be a non-empty string or an integer")
    if obj["answer_type"] not in TASK_ANSWER_TYPES:
        raise _FieldError("answer_type", f"must be one of {', '.join(TASK_ANSWER_TYPES)}; "
                                         f"got {obj['answer_type']!r}")
    try:
        answer = normalize_answer(obj["answer"])
    except ValueError as exc:
        raise _FieldError("answer", str(exc)) from None
    task = obj.get("task", "")
    if not isinstance(task, str):
        raise _FieldError("task", "must be a string")
    tokens = obj.get("context_tokens", 0)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise _FieldError("context_tokens", "must be a non-negative integer")
    try:
        labels = _labels(obj.get("labels", list(TREC_COARSE_LABELS)))
    except ValueError as exc:
        raise _FieldError("labels", str(exc)) from None
    try:
        rows = _rows(obj.get("rows", []), labels)
    except ValueError as exc:
        raise _FieldError("rows", str(exc)) from None
    return Task(
        id=str(obj["id"]), context=obj["context"], question=obj["question"], answer=answer,
        answer_type=obj["answer_type"], task=task,
        context_tokens=tokens or len(obj["context"]) // 4, rows=rows, labels=labels,
    )


class _FieldError(ValueError):
    def __init__(self, name: str, problem: str) -> None:
        super().__init__(f"field {name!r} {problem}" if name != "(line)" else problem)


def load_tasks(path: str | Path) -> list[Task]:
    """Read a JSONL task file; `TaskFileError` names the first bad line and field."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TaskFileError(f"{path}: cannot read the task file: {exc.strerror or exc}") from None
    tasks: list[Task] = []
    seen: set[str] = set()
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskFileError(f"{path}, line {lineno}: not valid JSON ({exc.msg})") from None
        try:
            task = parse_task(obj)
        except _FieldError as exc:
            raise TaskFileError(f"{path}, line {lineno}: {exc}") from None
        if task.id in seen:
            raise TaskFileError(f"{path}, line {lineno}: field 'id' repeats {task.id!r}")
        seen.add(task.id)
        tasks.append(task)
    if not tasks:
        raise TaskFileError(f"{path}: no tasks in the file")
    return tasks


def save_tasks(tasks: Iterable[Task], path: str | Path) -> Path:
    """Write tasks as JSONL (written to a temporary name, then renamed)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for t in tasks:
            f.write(json.dumps(t.to_json(), ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path
