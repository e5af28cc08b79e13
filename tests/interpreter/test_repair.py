"""Open-tail repair: the longest runnable prefix of a statement that is still streaming."""

from __future__ import annotations

import re
import time

import pytest

from agentrt.interpreter.repair import TailRepair, repair_tail


def test_for_loop_with_partial_body():
    tail = "for x in xs:\n    y = f(x)\n    z = g(y"
    assert repair_tail(tail) == "for x in xs:\n    y = f(x)\n"


def test_mid_line_cut_drops_the_unfinished_line():
    cut = "total = 0\nfor q in qs:\n    total += sc"
    assert repair_tail(cut) == "total = 0\nfor q in qs:\n    pass\n"
    assert repair_tail("x = 1\ny = fetch") == "x = 1\n"
    assert repair_tail("x = fetch") is None


def test_nested_ifs():
    tail = "for x in xs:\n    if x > 1:\n        a = f(x)\n        if a:\n"
    assert repair_tail(tail) == tail + "            pass\n"
    tail2 = "if a:\n    if b:\n        c = 1\n    else:\n        d = 2\n        e = h(\n"
    assert repair_tail(tail2) == "if a:\n    if b:\n        c = 1\n    else:\n        d = 2\n"


def test_open_bracket_across_lines_is_dropped_back_to_the_last_complete_line():
    tail = "items = load()\nfor x in items:\n    r = call(x, [\n        1,\n        2,\n"
    assert repair_tail(tail) == "items = load()\nfor x in items:\n    pass\n"
    closed = "items = load()\nfor x in items:\n    r = call(x, [\n        1,\n    ])\n"
    assert repair_tail(closed) == closed


def test_header_without_body():
    assert repair_tail("for x in xs:\n") is None
    assert repair_tail("for x in xs:\n    if x:\n") is None
    assert repair_tail("while True:\n    pass\n    y = ") is None
    assert repair_tail("x = fetch()\nwith open_it(x) as f:\n") == (
        "x = fetch()\nwith open_it(x) as f:\n    pass\n")
    assert repair_tail("for x in xs:\n    y = f(x)\nelse:\n") == (
        "for x in xs:\n    y = f(x)\nelse:\n    pass\n")


def test_decorators():
    assert repair_tail("@cache\n") is None
    assert repair_tail("@cache\ndef f(x):\n") is None
    assert repair_tail("@cache\ndef f(x):\n    y = x + 1\n    return y\n@other\n") == (
        "@cache\ndef f(x):\n    y = x + 1\n    return y\n")
    assert repair_tail("@cache\ndef f(x):\n    y = x + 1\n    return g(") == (
        "@cache\ndef f(x):\n    y = x + 1\n")


def test_strings_containing_colons_and_hashes():
    tail = 's = "a: b"\nt = \'#: {x}\'\nd = {"k": 1}\nu = s[1:]\nfor k in d:  # loop:\n'
    assert repair_tail(tail) == tail + "    pass\n"
    triple = 'doc = """first:\nsecond: # not a comment\n"""\nfor x in y:\n    z = f"{x}:"\n'
    assert repair_tail(triple) == triple
    open_triple = 'x = 1\ndoc = """first:\nsecond:\n'
    assert repair_tail(open_triple) == "x = 1\n"


def test_try_without_handlers_gets_finally_pass():
    assert repair_tail("try:\n    x = f()\n    y = g(") == "try:\n    x = f()\nfinally:\n    pass\n"
    assert repair_tail("try:\n    x = f()\nexcept KeyError:\n") == (
        "try:\n    x = f()\nexcept KeyError:\n    pass\n")
    nested = "for q in qs:\n    try:\n        r = f(q)\n"
    assert repair_tail(nested) == nested + "    finally:\n        pass\n"


def test_backslash_continuation_and_bad_dedent():
    assert repair_tail("x = 1 + \\\n    2\ny = 3 + \\\n") == "x = 1 + \\\n    2\n"
    assert repair_tail("while go:\n    x = 1\n  y = 2\n") == "while go:\n    x = 1\n"


def test_crlf_and_comments_only():
    assert repair_tail("x = 1\r\ny = 2\r\nz") == "x = 1\ny = 2\n"
    assert repair_tail("# just a comment\n\n") is None
    assert repair_tail("") is None


SAMPLE_PROGRAM = '''\
import json
results = []
for i, doc in enumerate(search("cats: big", limit=5)):
    text = fetch(doc["id"])  # the body: maybe long
    if len(text) > 100:
        summary = summarize(text[:100],
                            style="short")
    elif text:
        summary = text
    else:
        continue
    try:
        score = rate(summary)
    except ValueError as exc:
        score = 0
    results.append({"i": i, "s": score, "t": f"{doc['id']}: {summary!r:>10}"})

@memo
def best(rs):
    """Pick one: the best."""
    return max(rs, key=lambda r: r["s"])
while results and \\
        results[-1]["s"] < 0:
    results.pop()
FINAL(json.dumps(best(results)))
'''

_ADDED_LINE = re.compile(r"\s*(pass|finally:)")


@pytest.mark.parametrize("program", [SAMPLE_PROGRAM, SAMPLE_PROGRAM.replace("    ", "\t")])
def test_every_cut_of_a_program_repairs_to_a_compiling_line_prefix(program):
    lines = program.splitlines(keepends=True)
    longest = 0
    for cut in range(len(program) + 1):
        tail = program[:cut]
        repaired = repair_tail(tail)
        if repaired is None:
            continue
        compile(repaired, "<repaired>", "exec")
        got = repaired.splitlines(keepends=True)
        kept = 0
        while kept < len(got) and kept < len(lines) and got[kept] == lines[kept]:
            kept += 1
        assert "".join(lines[:kept]) == tail[: len("".join(lines[:kept]))]
        assert all(_ADDED_LINE.fullmatch(line.rstrip("\n")) for line in got[kept:]), repaired
        longest = max(longest, kept)
    assert longest == len(lines)


def test_a_complete_tail_is_returned_unchanged():
    assert repair_tail(SAMPLE_PROGRAM) == SAMPLE_PROGRAM


def test_fifty_line_tail_is_repaired_quickly():
    body = "".join(f"    y{i} = f(x, {i}) + g('a: b', [1, 2, 3])\n" for i in range(48))
    tail = "for x in xs:\n" + body + "    z = h(1,"
    assert repair_tail(tail) == "for x in xs:\n" + body
    distinct = [tail.replace("xs", f"xs{k}") for k in range(20)]  # defeat the cache
    start = time.perf_counter()
    for text in distinct:
        assert repair_tail(text) is not None
    per_call = (time.perf_counter() - start) / len(distinct)
    assert per_call < 0.05  # coarse sanity bound only; speed is measured by benchmarks


def test_streaming_the_same_line_reuses_the_result():
    prefix = "for x in xs:\n    y = f(x)\n"
    line = "    z = g(y, [1, 2, 3])"
    repair = TailRepair()
    results = [repair(prefix + line[:n]) for n in range(len(line))]
    assert set(results) == {prefix} and len({id(result) for result in results}) == 1
    assert repair(prefix + line + "\n") == prefix + line + "\n"
