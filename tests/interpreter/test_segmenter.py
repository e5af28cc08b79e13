"""Tests of the stream segmenter (agentrt.interpreter.segmenter)."""

from __future__ import annotations

import ast
import random
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentrt.interpreter.segmenter import BlockClosed, BlockOpened, CodeStream, StatementClosed


def chunks_of(text: str, rng: random.Random, max_size: int = 12) -> list[str]:
    out, i = [], 0
    while i < len(text):
        size = rng.randint(1, max_size)
        out.append(text[i : i + size])
        i += size
    return out


def run(text: str, chunks: list[str] | None = None) -> list:
    stream = CodeStream()
    events = []
    for chunk in chunks if chunks is not None else [text]:
        events += stream.feed(chunk)
    return events + stream.finish()


def statements(events: list) -> list[str]:
    return [e.source for e in events if isinstance(e, StatementClosed)]


def block(code: str, lang: str = "python") -> str:
    return f"```{lang}\n{code}```\n"


def assert_same_at_any_chunking(text: str, expected: list[str], seeds: int = 25) -> None:
    assert statements(run(text)) == expected
    for seed in range(seeds):
        chunks = chunks_of(text, random.Random(seed))
        assert statements(run(text, chunks)) == expected, f"seed {seed}: {chunks}"


# -- closing rules ---------------------------------------------------------------------------


def test_simple_statement_closes_when_its_newline_arrives():
    stream = CodeStream()
    assert stream.feed("Sure.\n```repl\nx = 1") == [BlockOpened(0, "repl")]
    assert stream.feed(" + 2") == []
    assert stream.feed("\ny") == [StatementClosed(0, 0, "x = 1 + 2\n", 1, 1)]
    assert stream.open_tail == "y"
    assert stream.feed(" = x\n```\n") == [
        StatementClosed(0, 1, "y = x\n", 2, 2),
        BlockClosed(0, "x = 1 + 2\ny = x\n", unterminated=False),
    ]
    assert stream.finish() == []


def test_brackets_spanning_lines_close_at_the_closing_line():
    code = "data = [\n    1,\n2,  # col 0 inside brackets\n]\ntotal = sum(\n    data)\n"
    assert_same_at_any_chunking(block(code), ["data = [\n    1,\n2,  # col 0 inside brackets\n]\n",
                                              "total = sum(\n    data)\n"])
    stream = CodeStream()
    stream.feed("```python\ndata = [\n    1,\n")
    assert stream.open_tail == "data = [\n    1,\n"
    assert [type(e) for e in stream.feed("]\n")] == [StatementClosed]


def test_multiline_strings_hide_column_zero_lines():
    code = 's = """\nelse:\ndef f():\n# not a comment\n)]}\n"""\nt = \'\'\'a\nb\'\'\'\n'
    assert_same_at_any_chunking(block(code), ['s = """\nelse:\ndef f():\n# not a comment\n)]}\n"""\n',
                                              "t = '''a\nb'''\n"])


def test_comment_lines_between_statements_are_dropped():
    code = "# setup\nx = 1  # trailing ) comment\n\n   # indented comment\ny = '#'\n# end\n"
    assert_same_at_any_chunking(block(code), ["x = 1  # trailing ) comment\n", "y = '#'\n"])


def test_decorators_belong_to_the_function():
    code = "@cache\n@route(\n    '/x')\n# about f\ndef f():\n    return 1\nclass C:\n    pass\nz = f()\n"
    assert_same_at_any_chunking(block(code), [
        "@cache\n@route(\n    '/x')\n# about f\ndef f():\n    return 1\n",
        "class C:\n    pass\n",
        "z = f()\n",
    ])


def test_if_elif_else_stays_open_until_a_new_statement_starts():
    code = "if a:\n    x = 1\n# comment at column 0\nelif b:\n    x = 2\n\nelse:\n    x = 3\nprint(x)\n"
    assert_same_at_any_chunking(block(code), [
        "if a:\n    x = 1\n# comment at column 0\nelif b:\n    x = 2\n\nelse:\n    x = 3\n",
        "print(x)\n",
    ])
    stream = CodeStream()
    stream.feed("```python\nif a:\n    x = 1\n")
    assert stream.feed("e") == []  # could be "else"
    assert stream.feed("l") == []
    assert stream.feed("se:\n    x = 2\n") == []
    # "x" can't start a continuation clause: the `if` is closed before the line is complete
    assert statements(stream.feed("x")) == ["if a:\n    x = 1\nelse:\n    x = 2\n"]
    assert stream.open_tail == "x"


def test_a_word_that_merely_starts_like_a_clause_closes_the_statement():
    stream = CodeStream()
    stream.feed("```python\nif a:\n    pass\nels")
    assert statements(stream.feed("e")) == []  # "else" so far
    assert statements(stream.feed("w")) == ["if a:\n    pass\n"]  # "elsew..." is a name

    stream = CodeStream()
    stream.feed("```python\nif a:\n    pass\nelse")
    assert statements(stream.feed(":")) == []  # the clause itself


def test_try_except_else_finally():
    code = ("try:\n    x = risky()\nexcept (ValueError,\n        KeyError) as e:\n    x = None\n"
            "except Exception:\n    raise\nelse:\n    pass\nfinally:\n    done()\nafter = 1\n")
    assert_same_at_any_chunking(block(code), [code[: code.index("after")], "after = 1\n"])


def test_nested_definitions_and_loops():
    code = ("def outer(n):\n    def inner(k):\n        return k\n\n    for i in range(n):\n"
            "        if i:\n            continue\n    else:\n        pass\n    return inner\n"
            "async def fetch():\n    async with lock:\n        await go()\n"
            "while cond():\n    break\nelse:\n    pass\nr = outer(3)\n")
    assert_same_at_any_chunking(block(code), [
        code[: code.index("async def")],
        "async def fetch():\n    async with lock:\n        await go()\n",
        "while cond():\n    break\nelse:\n    pass\n",
        "r = outer(3)\n",
    ])


def test_backslash_continuation_and_semicolons():
    code = "total = 1 + \\\n    2 + \\\n3\na = 1; b = 2\nif a: b = 3\nelse: b = 4\n"
    assert_same_at_any_chunking(block(code), [
        "total = 1 + \\\n    2 + \\\n3\n", "a = 1; b = 2\n", "if a: b = 3\nelse: b = 4\n",
    ])


@pytest.mark.skipif(sys.version_info < (3, 10), reason="match statement")
def test_match_statement_and_match_as_a_name():
    code = ("match = re.match(p, s)\nmatch cmd:\n    case 1:\n        x = 1\n    case _:\n        x = 2\n"
            "y = x\n")
    assert_same_at_any_chunking(block(code), [
        "match = re.match(p, s)\n", "match cmd:\n    case 1:\n        x = 1\n    case _:\n        x = 2\n",
        "y = x\n",
    ])


def test_crlf_line_endings():
    text = "```python\r\nx = 1\r\nif x:\r\n    y = 2\r\nz = 3\r\n```\r\n"
    assert_same_at_any_chunking(text, ["x = 1\r\n", "if x:\r\n    y = 2\r\n", "z = 3\r\n"])


# -- blocks ----------------------------------------------------------------------------------


def test_several_blocks_with_prose_between():
    text = ("Plan: use ```python inline, not a fence.\n```python\na = 1\n```\nThen\n"
            "```py \nb = 2\n```  \nand ```repl\n```REPL\nc = 3\n```\nDone.")
    for seed in range(25):
        events = run(text, chunks_of(text, random.Random(seed)))
        assert events == [
            BlockOpened(0, "python"), StatementClosed(0, 0, "a = 1\n", 1, 1),
            BlockClosed(0, "a = 1\n", False),
            BlockOpened(1, "py"), StatementClosed(1, 0, "b = 2\n", 1, 1),
            BlockClosed(1, "b = 2\n", False),
            BlockOpened(2, "repl"), StatementClosed(2, 0, "c = 3\n", 1, 1),
            BlockClosed(2, "c = 3\n", False),
        ]


def test_other_languages_are_quoted_blocks_neither_code_nor_prose():
    assert run("```bash\nls\n```\n```json\n{}\n```\n") == []
    text = ("Intro FINAL(1)\n```json\nFINAL(2)\n```\nmid\n```\nFINAL(3)\n```\n"
            "```python\nFINAL(4)\n```\nafter ```python inline\n```text\nq\n```repl\nx = 1\n"
            "```\nFINAL(5)\n```\nquoted to the end FINAL(6)")
    for seed in range(10):
        stream = CodeStream()
        events = [e for chunk in chunks_of(text, random.Random(seed)) for e in stream.feed(chunk)]
        events += stream.finish()
        # A code fence inside a quoted block still opens a code block (and ends the quote).
        assert [e.code for e in events if isinstance(e, BlockClosed)] == ["FINAL(4)\n",
                                                                         "x = 1\n"]
        assert stream.prose == "Intro FINAL(1)\nmid\nafter ```python inline\nFINAL(5)\n"


def test_a_block_whose_code_cannot_be_split_is_broken():
    closed = [e for e in run(block("x = 1\nfor i in xs:\n    f(i,\n")) if isinstance(e, BlockClosed)]
    assert closed[0].broken
    for code in ("x = 1\n# done\n\n", "for i in xs:\n    f(i)\n", ""):
        (closed,) = [e for e in run(block(code)) if isinstance(e, BlockClosed)]
        assert not closed.broken, code


def test_unterminated_block_is_closed_by_finish():
    stream = CodeStream()
    stream.feed("```python\nx = 1\ndef f():\n    return x")
    assert stream.finish() == [
        StatementClosed(0, 1, "def f():\n    return x", 2, 3),
        BlockClosed(0, "x = 1\ndef f():\n    return x", unterminated=True),
    ]
    with pytest.raises(RuntimeError, match="after finish"):
        stream.feed("more")


def test_fence_without_newline_at_the_end_terminates_the_block():
    events = run("```python\nx = 1\n```")
    assert events[-1] == BlockClosed(0, "x = 1\n", unterminated=False)
    assert run("Here:\n```python") == [BlockOpened(0, "python"), BlockClosed(0, "", unterminated=True)]


def test_a_fence_line_inside_a_string_closes_the_block():
    # The documented ambiguity: a line that is exactly ``` closes the block, wherever it is.
    events = run('```python\ns = """\n```\nstill string"""\n')
    assert events[-1] == BlockClosed(0, 's = """\n', unterminated=False, broken=True)
    assert statements(events) == []


def test_partial_fence_is_not_shown_as_code():
    stream = CodeStream()
    stream.feed("```python\nx = 1\n``")
    assert stream.current_block_code == "x = 1\n"
    assert stream.open_tail == ""
    stream.feed("`")
    assert stream.current_block_code == "x = 1\n"
    assert [type(e) for e in stream.feed("\n")] == [BlockClosed]
    assert stream.current_block_code == "" and not stream.in_block


# -- broken code -----------------------------------------------------------------------------


def test_syntax_errors_do_not_stall_the_segmenter():
    code = ("a = 1\nprint(a))\nb = = 2\nc = 'unterminated\nd = $\n  e = 4\nf = 5\n"
            "def g(:)\n    pass\nh = 6\n")
    assert_same_at_any_chunking(block(code), [
        "a = 1\n", "print(a))\n", "b = = 2\n", "c = 'unterminated\n", "d = $\n", "  e = 4\n",
        "f = 5\n", "def g(:)\n    pass\n", "h = 6\n",
    ])


def test_unclosed_bracket_swallows_the_rest_but_the_block_is_complete():
    code = "a = 1\nb = foo(\nc = 2\nd = 3\n"
    events = run(block(code))
    assert statements(events) == ["a = 1\n"]
    assert events[-1] == BlockClosed(0, code, unterminated=False, broken=True)


def test_an_incomplete_body_line_drops_its_statement_at_block_end():
    events = run(block("x = 1\nfor i in xs:\n    f(i,\n"))
    assert statements(events) == ["x = 1\n"]


# -- cost ------------------------------------------------------------------------------------


def test_long_blocks_are_segmented_incrementally():
    body = []
    for i in range(100):
        body += [f"def f{i}(x):", f"    return llm_query(f'q{{x}} {i}')", f"v{i} = [", f"    '{i}',", "]"]
    body += ["big = ["] + [f"    'item {i}'," for i in range(300)] + ["]"]
    code = "\n".join(body) + "\n"
    text = block(code)
    start = time.perf_counter()
    events = run(text, [text[i : i + 3] for i in range(0, len(text), 3)])
    elapsed = time.perf_counter() - start
    assert len(statements(events)) == 201
    assert elapsed < 20, f"segmenting {len(code)} characters took {elapsed:.1f} s"


# -- property: closed statements are always a prefix of the program's statements ---------------

NAMES = st.sampled_from(["a", "b", "xs", "total", "match", "result"])
STRING_LINES = st.sampled_from([
    "else:", "def f():", "    x = (", "]", "# not a comment", "", "'single' \"double\"", "elif x:", "`` `",
])


def simple_lines(draw) -> list[str]:
    name, other = draw(NAMES), draw(NAMES)
    kind = draw(st.integers(0, 11))
    if kind == 0:
        return [f"{name} = {draw(st.integers(-5, 500))}"]
    if kind == 1:
        return [f"print(llm_query({other!r}))  # trailing ) comment"]
    if kind == 2:
        items = draw(st.lists(st.sampled_from(["1,", "    2,", "(3, 4),", "'x',"]), max_size=4))
        split_item = ["    (5,", "6),"] if draw(st.booleans()) else []
        return [f"{name} = ["] + items + split_item + ["]"]
    if kind == 3:
        return [f'{name} = """'] + draw(st.lists(STRING_LINES, max_size=4)) + ['"""']
    if kind == 4:
        return [f"{name} = 1 + \\", "    2 + \\", "3"]
    if kind == 5:
        return [f"{name} = 1; {other} = 2"]
    if kind == 6:
        return [f"{name} = {{", "'k': (1,", "2),", "}"]
    if kind == 7:
        return [f"{name} = f'{{{other}!r}} ({other})'"]
    if kind == 8:
        return ["import os"]
    if kind == 9:
        return [f"{name} = lambda v: (", "    v + 1)"]
    if kind == 10:
        return [f"{name} = '#' + \"'\""]
    return ["pass"]


def indented(lines: list[str]) -> list[str]:
    return ["    " + line if line else line for line in lines]


def body_lines(draw, depth: int) -> list[str]:
    out: list[str] = []
    for _ in range(draw(st.integers(1, 3))):
        if draw(st.integers(0, 4)) == 0:
            out.append(draw(st.sampled_from(["", "# body comment", "  # odd comment"])))
        out += statement_lines(draw, depth + 1)
    return indented(out)


def statement_lines(draw, depth: int) -> list[str]:
    if depth >= 2 or draw(st.integers(0, 2)) > 0:
        return simple_lines(draw)
    maybe_comment = lambda: ["# between clauses"] if draw(st.booleans()) else []  # noqa: E731
    kind = draw(st.integers(0, 9))
    if kind == 0:
        out = ["if a:"] + body_lines(draw, depth)
        if draw(st.booleans()):
            out += maybe_comment() + ["elif b:"] + body_lines(draw, depth)
        if draw(st.booleans()):
            out += maybe_comment() + ["else:"] + body_lines(draw, depth)
        return out
    if kind == 1:
        out = ["for i in xs:"] + body_lines(draw, depth)
        return out + (["else:"] + body_lines(draw, depth) if draw(st.booleans()) else [])
    if kind == 2:
        out = ["try:"] + body_lines(draw, depth) + maybe_comment() + ["except ValueError:"]
        out += body_lines(draw, depth)
        if draw(st.booleans()):
            out += ["else:"] + body_lines(draw, depth)
        return out + (["finally:"] + body_lines(draw, depth) if draw(st.booleans()) else [])
    if kind == 3:
        decorators = draw(st.lists(st.sampled_from(["@cache", "@route(", "# about"]), max_size=2))
        lines = []
        for d in decorators:
            lines += ["@route(", "    '/x')"] if d == "@route(" else [d]
        doc = ['    """Doc.', "", 'else: not code."""'] if draw(st.booleans()) else []
        return lines + ["def helper(a, b=1):"] + doc + body_lines(draw, depth)
    if kind == 4:
        return ["class Thing:"] + body_lines(draw, depth)
    if kind == 5:
        return ["with open('p') as fh:"] + body_lines(draw, depth)
    if kind == 6:
        cases = ["    case 1:"] + indented(body_lines(draw, depth)) + ["    case _:", "        pass"]
        return ["match a:"] + cases
    if kind == 7:
        return ["if a: b = 1"] + (["else: b = 2"] if draw(st.booleans()) else [])
    if kind == 8:
        return ["async def go():", "    await thing()"] + (["", "# gap"] if draw(st.booleans()) else [])
    out = ["async for item in source():"] + body_lines(draw, depth)
    if draw(st.booleans()):
        return out + ["else:"] + body_lines(draw, depth)
    return out + ["async with lock:", "    pass"]


@st.composite
def programs(draw) -> str:
    lines: list[str] = []
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.integers(0, 3)) == 0:
            lines.append(draw(st.sampled_from(["", "# top comment", "   "])))
        lines += statement_lines(draw, 0)
    return "\n".join(lines) + "\n"


COMPOUND = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.With, ast.AsyncWith,
            ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Match)


def expected_spans(program: str) -> list[tuple[int, int, bool]]:
    """(first line, last line, is compound) of each top-level statement; one line's statements merge."""
    spans: list[tuple[int, int, bool]] = []
    for node in ast.parse(program).body:
        start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        compound = isinstance(node, COMPOUND)
        if spans and start <= spans[-1][1]:
            first, last, was_compound = spans[-1]
            spans[-1] = (first, max(last, node.end_lineno), was_compound or compound)
        else:
            spans.append((start, node.end_lineno, compound))
    return spans


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(program=programs(), data=st.data())
def test_closed_statements_are_a_prefix_of_the_programs_statements(program, data):
    spans = expected_spans(program)
    lines = program.splitlines(keepends=True)
    line_end = [sum(map(len, lines[: i + 1])) for i in range(len(lines))]  # offset after line i+1
    prefix = "Let me compute.\n```python\n"
    text = prefix + program + "```\nThe answer follows.\n"
    cuts = sorted(set(data.draw(st.lists(st.integers(1, len(text) - 1), max_size=40), label="cuts")))
    stream = CodeStream()
    reported: list[StatementClosed] = []
    position = 0
    for cut in cuts + [len(text)]:
        reported += [e for e in stream.feed(text[position:cut]) if isinstance(e, StatementClosed)]
        position = cut
        fed = position - len(prefix)  # characters of the program received
        got = [(e.lineno, e.end_lineno) for e in reported]
        assert got == [(s, e) for s, e, _ in spans[: len(got)]], f"fed {fed}: {got}"
        for event in reported:
            assert event.source == "".join(lines[event.lineno - 1 : event.end_lineno])
        # Liveness: a simple statement is reported once its last newline is in, any statement
        # once the whole first line of the next statement is in, the last one at the fence.
        due = 0
        for i, (_, end, compound) in enumerate(spans):
            if i + 1 < len(spans):
                ready = fed >= line_end[spans[i + 1][0] - 1] or (not compound and fed >= line_end[end - 1])
            else:
                ready = fed >= len(program) + 4 or (not compound and fed >= line_end[end - 1])
            if not ready:
                break
            due += 1
        assert len(reported) >= due, f"fed {fed}: {len(reported)} reported, {due} due"
        if 0 <= fed <= len(program) and stream.in_block:
            code = stream.current_block_code
            assert program.startswith(code)
            closed_to = line_end[reported[-1].end_lineno - 1] if reported else 0
            assert stream.open_tail == code[closed_to:]
    stream.finish()
    assert [(e.lineno, e.end_lineno) for e in reported] == [(s, e) for s, e, _ in spans]
