"""The converter from published OOLONG rows, on fixture rows in the published formats."""

import json
import re
import sys
from pathlib import Path

import httpx
import pytest

from benchmarks.oolong import convert
from benchmarks.oolong.generate import format_row
from benchmarks.oolong.scoring import REAL_ANSWER_TYPE
from benchmarks.oolong.server import Oracle, SimulatedSubModel, check_simulatable
from benchmarks.oolong.server import LatencyModel
from benchmarks.oolong.tasks import load_tasks
from benchmarks.oolong.words import LABELS

FIXTURES = Path(__file__).parent / "fixtures"
SYNTH = FIXTURES / "oolong_synth_rows.jsonl"
REAL = FIXTURES / "oolong_real_rows.jsonl"


def _rows(path: Path = SYNTH) -> list[dict]:
    return [json.loads(line) for line in path.open()]


def test_cli_converts_synth_and_real_rows(tmp_path, capsys):
    out = tmp_path / "tasks.jsonl"
    assert convert.main([str(SYNTH), str(REAL), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "wrote 24 tasks" in printed and "oolong-synth 21, oolong-real 3" in printed
    assert "1 questions are not in a known wording and keep their dataset task name: " \
           "TASK_TYPE.COUNT_ABOVE x1" in printed
    assert "1 stored answers differ from the answer computed from the rows (kept as stored): " \
           "13000290" in printed
    assert "3 oolong-real tasks have no rows: run them with --sub-base-url URL" in printed
    tasks = {t.id: t for t in load_tasks(out)}
    raw = {str(r["id"]): r for r in _rows()}
    first = tasks["13000200"]
    assert first.context == raw["13000200"]["context_window_text"]
    assert first.labels == list(LABELS) and first.context_tokens == 1024
    assert [format_row(r) for r in first.rows] == [
        ln for ln in first.context.split("\n") if ln.startswith("Date:")]
    labelled = [ln.rsplit(" || Label: ", 1)[1] for ln in
                raw["13000200"]["context_window_text_with_labels"].split("\n") if " || Label: " in ln]
    assert [r[3] for r in first.rows] == labelled
    assert (first.task, first.answer) == ("most_common_label", "entity")
    assert tasks["13000210"].answer == "2023-05-01"          # [datetime.date(2023, 5, 1)]
    assert tasks["13000203"].answer == "44106"               # [44106]
    assert tasks["13000215"].answer == "May 2023"            # ['May 2023']
    assert tasks["13000291"].task == "TASK_TYPE.COUNT_ABOVE"
    assert tasks["110010000"].labels == ["ham", "spam"]
    real = tasks["5b0f9c1e-2d7a-4c1b-9e63-0a1f2b3c4d5e"]
    assert (real.answer_type, real.answer, real.task, real.rows, real.labels) == (
        REAL_ANSWER_TYPE, "3", "singledoc_rolls", [], [])


def test_filters_and_limit(tmp_path):
    tasks, summary = convert.convert([SYNTH, REAL], dataset="spam", progress=False)
    assert [t.id for t in tasks] == ["110010000"] and summary.skipped_dataset == 23
    tasks, summary = convert.convert([SYNTH], max_context_tokens=512, progress=False)
    assert tasks == [] and summary.skipped_length == 21
    tasks, _ = convert.convert([SYNTH, REAL], limit=2, progress=False)
    assert len(tasks) == 2
    assert convert.main([str(SYNTH), "--dataset", "yahoo", "--out", str(tmp_path / "o")]) == 2


@pytest.mark.parametrize("layout", ["list", "page", "columns"])
def test_json_layouts(tmp_path, layout):
    rows = _rows()[:3]
    data = {"list": rows,
            "page": {"rows": [{"row_idx": i, "row": r} for i, r in enumerate(rows)]},
            "columns": {k: [r[k] for r in rows] for k in rows[0]}}[layout]
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(data))
    tasks, _ = convert.convert([path], progress=False)
    assert [t.id for t in tasks] == [str(r["id"]) for r in rows]


def test_parquet_as_the_hub_publishes_it(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "test-00000-of-00001.parquet"
    pq.write_table(pa.Table.from_pylist(_rows()), path)
    tasks, _ = convert.convert([path], progress=False)
    assert len(tasks) == 21 and tasks[0].rows


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "rows.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(convert.ConvertError, match=r"reading parquet needs pyarrow \(pip install "
                                                    r"pyarrow\)"):
        convert.convert([path], progress=False)


def _bad(tmp_path: Path, change) -> str:
    rows = _rows()[:2]
    change(rows[1])
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(convert.ConvertError) as info:
        convert.convert([path], progress=False)
    return str(info.value)


def test_bad_rows_name_file_line_and_field(tmp_path):
    where = f"{tmp_path / 'bad.jsonl'}, line 2: "
    assert _bad(tmp_path, lambda r: r.pop("question")) == where + "field 'question' is missing"
    assert _bad(tmp_path, lambda r: r.update(answer_type="LABEL")).startswith(
        where + "field 'answer_type' must be one of ANSWER_TYPE.LABEL")
    assert _bad(tmp_path, lambda r: r.update(answer=None)).startswith(where + "field 'answer'")

    def relabel(r):
        r["context_window_text_with_labels"] = r["context_window_text_with_labels"].replace(
            "|| Label: entity", "|| Label: robot", 1)
    assert re.search(r"field 'context_window_text_with_labels' data line \d+ has label 'robot', "
                     r"not in the label set of trec_coarse", _bad(tmp_path, relabel))

    def drop_line(r):
        lines = r["context_window_text_with_labels"].split("\n")
        r["context_window_text_with_labels"] = "\n".join(lines[:5] + lines[6:])
    assert "has 17 data lines, 'context_window_text' 18" in _bad(tmp_path, drop_line)

    def edit_instance(r):
        r["context_window_text"] = r["context_window_text"].replace("NASA", "ESA")
    assert re.search(r"data line \d+ differs from line \d+ of 'context_window_text'",
                     _bad(tmp_path, edit_instance))
    assert "field 'id' repeats '13000200' (first at" in _bad(
        tmp_path, lambda r: r.update(id=13000200))
    path = tmp_path / "broken.jsonl"
    path.write_text('{"id": 1,\n')
    with pytest.raises(convert.ConvertError, match=r"broken.jsonl, line 1: not valid JSON"):
        convert.convert([path], progress=False)
    with pytest.raises(convert.ConvertError, match="unknown input type '.csv'"):
        convert.convert([tmp_path / "rows.csv"], progress=False)


def test_converted_rows_drive_the_simulated_sub_model():
    """A converted OOLONG-synth task is served from its recovered rows; OOLONG-real tasks are
    refused by the simulator with the way out."""
    tasks, _ = convert.convert([SYNTH, REAL], progress=False)
    synth = [t for t in tasks if t.rows]
    check_simulatable(synth)
    with pytest.raises(ValueError, match="3 of 24 tasks have no 'rows'.*--sub-base-url URL"):
        check_simulatable(tasks)
    task = synth[0]
    fast = LatencyModel(prefill_tokens_per_s=1e6, ttft_overhead_s=0.0, decode_tokens_per_s=5000.0)
    prompt = "Give the label of each line.\n" + "\n".join(format_row(r) for r in task.rows)
    with SimulatedSubModel(Oracle.from_tasks(synth), fast) as server:
        reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
            "model": "m", "messages": [{"role": "user", "content": prompt}]}).json()
    assert reply["choices"][0]["message"]["content"].split("\n") == [r[3] for r in task.rows]
