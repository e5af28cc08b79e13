"""Convert published OOLONG rows (oolong-synth, oolong-real) into the runner's JSONL task file.

    python -m benchmarks.oolong.convert IN [IN ...] --out FILE.jsonl [--limit N]
        [--dataset trec_coarse] [--max-context-tokens N]

Inputs: ``.jsonl`` (one row a line), ``.json`` (a list of rows, a datasets-server page
``{"rows": [{"row": {...}}, ...]}``, or columns ``{"id": [...], ...}``) or ``.parquet`` as the
hub publishes it (needs ``pyarrow``).

oolong-synth rows (fields ``id``, ``context_len``, ``dataset``, ``context_window_id``,
``context_window_text``, ``context_window_text_with_labels``, ``question``, ``task_group``,
``task``, ``answer``, ``answer_type``, ``input_subset``, ``num_labels``) become tasks with

- ``context`` = ``context_window_text`` (what the root model reads);
- ``rows`` = ``[date, user, instance, label]`` per line of ``context_window_text_with_labels``
  (checked line by line against ``context_window_text``);
- ``labels`` = the dataset's label set (OOLONG-synth's lists for its ten datasets; otherwise
  the labels the context header lists, else those found in the rows);
- ``answer`` unwrapped (``"['human being']"`` -> ``human being``, ``"[datetime.date(2023, 5,
  1)]"`` -> ``2023-05-01``), ``answer_type`` kept, ``context_tokens`` = ``context_len``;
- ``task`` = the question kind `benchmarks.oolong.questions.parse_question` reads, or the row's
  own ``task`` (``TASK_TYPE.MOST_FREQ`` ...) when the wording is not recognised (counted in the
  summary).

oolong-real rows (``id``, ``context_window_id``, ``context_window_text``, ``question``,
``answer``, ``question_type``, ...) become tasks with answer type ``OOLONG_REAL`` (scored by
OOLONG-real's rules), ``task`` = ``question_type``, no label set and no ``rows``: the simulated
sub-model cannot answer them; run them with ``--sub-base-url`` and a real model.

``--dataset`` keeps the rows whose ``dataset`` field equals it; ``--max-context-tokens`` drops
rows whose context is longer (``context_len``, else characters / 4); ``--limit`` stops after N
tasks. A bad row stops the conversion before anything is written, naming the file, the line (or
row) and the field.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .questions import parse_question, solve
from .scoring import ANSWER_TYPES, REAL_ANSWER_TYPE, normalize_answer
from .tasks import Row, Task, save_tasks

DATASET_LABELS: dict[str, tuple[str, ...]] = {
    "trec_coarse": ("abbreviation", "entity", "description and abstract concept", "human being",
                    "location", "numeric value"),
    "spam": ("ham", "spam"),
    "imdb": ("negative", "positive"),
    "agnews": ("World", "Sports", "Business", "Sci/Tech"),
    "negation": ("True", "False"),
    "yahoo": ("Society & Culture", "Science & Mathematics", "Health", "Education & Reference",
              "Computers & Internet", "Sports", "Business & Finance", "Entertainment & Music",
              "Family & Relationships", "Politics & Government"),
    "formality": ("formal", "informal"),
    "multinli": ("entailment", "neutral", "contradiction"),
    "metaphors": ("correct", "incorrect"),
    "app_reviews": ("negative", "positive"),
}
"""OOLONG-synth's label set of each of its source datasets."""

_LABELLED = re.compile(r"^Date: (?P<date>.*?) \|\| User: (?P<user>.*?) \|\| Instance: "
                       r"(?P<instance>.*) \|\| Label: (?P<label>.*?)\s*$")
_PLAIN = re.compile(r"^Date: (?P<date>.*?) \|\| User: (?P<user>.*?) \|\| Instance: "
                    r"(?P<instance>.*?)\s*$")
_HEADER_LABELS = re.compile(r"categories: ((?:'[^']*'(?:, )?)+)\.")


class ConvertError(ValueError):
    """A row that cannot be converted; the message names the file, the row and the field."""


@dataclass
class Summary:
    synth: int = 0
    real: int = 0
    skipped_dataset: int = 0
    skipped_length: int = 0
    unparsed: Counter = field(default_factory=Counter)
    """Dataset task names kept for questions whose wording was not recognised."""
    differing: list[str] = field(default_factory=list)
    """Tasks whose stored answer differs from the answer computed from their rows."""

    def lines(self, path: Path) -> list[str]:
        out = [f"wrote {self.synth + self.real} tasks to {path} "
               f"(oolong-synth {self.synth}, oolong-real {self.real})"]
        if self.skipped_dataset or self.skipped_length:
            out.append(f"skipped {self.skipped_dataset} rows by --dataset, "
                       f"{self.skipped_length} by --max-context-tokens")
        if self.unparsed:
            kinds = ", ".join(f"{k} x{n}" for k, n in self.unparsed.most_common())
            out.append(f"{sum(self.unparsed.values())} questions are not in a known wording and "
                       f"keep their dataset task name: {kinds}")
        if self.differing:
            shown = ", ".join(self.differing[:5]) + (" ..." if len(self.differing) > 5 else "")
            out.append(f"{len(self.differing)} stored answers differ from the answer computed "
                       f"from the rows (kept as stored): {shown}")
        if self.real:
            out.append(f"{self.real} oolong-real tasks have no rows: run them with "
                       "--sub-base-url URL (a real model), not the simulated sub-model")
        return out


# ------------------------------------------------------------------------------ reading

Located = tuple[str, dict]
"""(where: 'FILE, line N' or 'FILE, row N', the row)"""


def _columns_to_rows(columns: dict) -> list[dict]:
    lengths = {len(v) for v in columns.values() if isinstance(v, list)}
    if len(lengths) != 1 or not all(isinstance(v, list) for v in columns.values()):
        raise ValueError("a JSON object must hold 'rows' or equal-length columns")
    n = lengths.pop()
    return [{k: v[i] for k, v in columns.items()} for i in range(n)]


def read_rows(path: Path) -> tuple[int | None, Iterator[Located]]:
    """(number of rows when known, the rows with their location)."""
    suffix = path.suffix.lower()
    if suffix not in (".parquet", ".jsonl", ".json"):
        raise ConvertError(f"{path}: unknown input type {suffix or '(none)'!r}; use .jsonl, .json "
                           "or .parquet")
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConvertError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), "
                               "or convert the file to JSONL first") from None
        try:
            pf = pq.ParquetFile(path)
        except Exception as exc:  # pyarrow raises several types for a bad file
            raise ConvertError(f"{path}: not a readable parquet file ({exc})") from None

        def batches() -> Iterator[Located]:
            i = 0
            for batch in pf.iter_batches(batch_size=64):
                for row in batch.to_pylist():
                    i += 1
                    yield f"{path}, row {i}", row

        return pf.metadata.num_rows, batches()
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConvertError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if suffix == ".jsonl":
        def lines() -> Iterator[Located]:
            for n, line in enumerate(text.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    yield f"{path}, line {n}", json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConvertError(f"{path}, line {n}: not valid JSON ({exc.msg})") from None

        return text.count("\n") + 1, lines()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConvertError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    try:
        if isinstance(data, dict) and isinstance(data.get("rows"), list):
            data = [r["row"] if isinstance(r, dict) and "row" in r else r for r in data["rows"]]
        elif isinstance(data, dict):
            data = _columns_to_rows(data)
    except ValueError as exc:
        raise ConvertError(f"{path}: {exc}") from None
    if not isinstance(data, list):
        raise ConvertError(f"{path}: expected a list of rows")
    return len(data), ((f"{path}, row {i}", row) for i, row in enumerate(data, 1))


# ------------------------------------------------------------------------------ converting

def _field(where: str, name: str, problem: str) -> ConvertError:
    return ConvertError(f"{where}: field {name!r} {problem}")


def _text(row: dict, name: str, where: str) -> str:
    value = row.get(name)
    if not isinstance(value, str) or not value.strip():
        raise _field(where, name, "is missing" if value is None else "must be a non-empty string")
    return value


def recover_rows(labelled: str, plain: str, where: str) -> list[Row]:
    """``[date, user, instance, label]`` per line of ``context_window_text_with_labels``, checked
    against the lines of ``context_window_text``."""
    rows: list[Row] = []
    for line in labelled.splitlines():
        if line.startswith("Date: "):
            m = _LABELLED.match(line)
            if not m:
                raise _field(where, "context_window_text_with_labels",
                             f"line {len(rows) + 1} of its data has no ' || Label: ': {line[:80]!r}")
            rows.append((m["date"], m["user"], m["instance"].strip(), m["label"].strip()))
    shown = [m.groups() for m in map(_PLAIN.match, plain.splitlines()) if m]
    if len(shown) != len(rows):
        raise _field(where, "context_window_text_with_labels",
                     f"has {len(rows)} data lines, 'context_window_text' {len(shown)}")
    for i, (row, (date, user, instance)) in enumerate(zip(rows, shown), 1):
        if row[:3] != (date, user, instance.strip()):
            raise _field(where, "context_window_text_with_labels",
                         f"data line {i} differs from line {i} of 'context_window_text'")
    return rows


def label_set(dataset: str, context: str, rows: Sequence[Row], where: str) -> list[str]:
    """The dataset's label set (see the module docstring); every row's label must be in it."""
    if dataset in DATASET_LABELS:
        labels = list(DATASET_LABELS[dataset])
    elif m := _HEADER_LABELS.search(context):
        labels = re.findall(r"'([^']*)'", m.group(1))
    else:
        labels = list(dict.fromkeys(r[3] for r in rows))
    for i, row in enumerate(rows, 1):
        if row[3] not in labels:
            raise _field(where, "context_window_text_with_labels",
                         f"data line {i} has label {row[3]!r}, not in the label set of "
                         f"{dataset or 'the data'} ({', '.join(labels)})")
    return labels


def _tokens(row: dict, context: str) -> int:
    n = row.get("context_len")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else len(context) // 4


def _id(row: dict, where: str) -> str:
    value = row.get("id")
    if isinstance(value, bool) or not isinstance(value, (str, int)) or str(value) == "":
        raise _field(where, "id", "is missing" if value is None else
                     "must be a non-empty string or an integer")
    return str(value)


def convert_synth(row: dict, where: str, summary: Summary) -> Task:
    context = _text(row, "context_window_text", where)
    question = _text(row, "question", where)
    answer_type = row.get("answer_type")
    if answer_type not in ANSWER_TYPES:
        raise _field(where, "answer_type", f"must be one of {', '.join(ANSWER_TYPES)}; "
                                           f"got {answer_type!r}")
    try:
        answer = normalize_answer(row.get("answer"))
    except ValueError as exc:
        raise _field(where, "answer", str(exc)) from None
    labelled = row.get("context_window_text_with_labels")
    rows = recover_rows(labelled, context, where) if isinstance(labelled, str) and labelled else []
    dataset = row.get("dataset") if isinstance(row.get("dataset"), str) else ""
    labels = label_set(dataset, context, rows, where)
    task_id = _id(row, where)
    try:
        spec = parse_question(question, labels)
        kind = spec.kind
        if rows and solve(spec, rows) != answer:
            summary.differing.append(task_id)
    except ValueError:  # UnknownQuestionError, or a named label outside the set
        kind = str(row.get("task") or "unknown")
        summary.unparsed[kind] += 1
    return Task(id=task_id, context=context, question=question, answer=answer,
                answer_type=answer_type, task=kind, context_tokens=_tokens(row, context),
                rows=rows, labels=labels)


def convert_real(row: dict, where: str) -> Task:
    context = _text(row, "context_window_text", where)
    question = _text(row, "question", where)
    try:
        answer = normalize_answer(row.get("answer"))
    except ValueError as exc:
        raise _field(where, "answer", str(exc)) from None
    return Task(id=_id(row, where), context=context, question=question, answer=answer,
                answer_type=REAL_ANSWER_TYPE, task=str(row.get("question_type") or ""),
                context_tokens=_tokens(row, context), rows=[], labels=[])


def is_synth(row: dict) -> bool:
    return "answer_type" in row or "context_window_text_with_labels" in row


def convert(paths: Sequence[Path], limit: int | None = None, dataset: str | None = None,
            max_context_tokens: int | None = None, progress: bool = True,
            ) -> tuple[list[Task], Summary]:
    """The tasks the rows of ``paths`` convert to, and what was converted and skipped."""
    from tqdm import tqdm

    summary = Summary()
    tasks: list[Task] = []
    seen: dict[str, str] = {}
    for path in paths:
        total, rows = read_rows(Path(path))
        for where, row in tqdm(rows, total=total, desc=Path(path).name, unit="row",
                               disable=None if progress else True, leave=False):
            if limit is not None and len(tasks) >= limit:
                break
            if not isinstance(row, dict):
                raise ConvertError(f"{where}: a row must be a JSON object")
            if dataset is not None and row.get("dataset") != dataset:
                summary.skipped_dataset += 1
                continue
            context = row.get("context_window_text")
            if (max_context_tokens is not None and isinstance(context, str)
                    and _tokens(row, context) > max_context_tokens):
                summary.skipped_length += 1
                continue
            task = convert_synth(row, where, summary) if is_synth(row) else convert_real(row, where)
            if task.id in seen:
                raise _field(where, "id", f"repeats {task.id!r} (first at {seen[task.id]})")
            seen[task.id] = where
            tasks.append(task)
            if task.answer_type == REAL_ANSWER_TYPE:
                summary.real += 1
            else:
                summary.synth += 1
    return tasks, summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.oolong.convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", type=Path, help=".jsonl, .json or .parquet files")
    p.add_argument("--out", required=True, type=Path, help="the task file to write (JSONL)")
    p.add_argument("--limit", type=int, help="stop after this many tasks")
    p.add_argument("--dataset", help="keep rows of this OOLONG-synth dataset (e.g. trec_coarse)")
    p.add_argument("--max-context-tokens", type=int, help="drop rows with longer contexts")
    args = p.parse_args(argv)
    try:
        if args.limit is not None and args.limit < 1:
            raise ConvertError("--limit must be >= 1")
        tasks, summary = convert(args.inputs, args.limit, args.dataset, args.max_context_tokens)
        if not tasks:
            raise ConvertError("no rows left to convert (check --dataset and "
                               "--max-context-tokens)")
    except ConvertError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    save_tasks(tasks, args.out)
    print("\n".join(summary.lines(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
