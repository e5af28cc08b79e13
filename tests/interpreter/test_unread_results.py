"""Which results of a loop still streaming the code has not used yet (their use may be an exit)."""

from __future__ import annotations

import pytest

from agentrt.interpreter.unread_results import unread_result_lines, while_loop_lines


@pytest.mark.parametrize("source, lines", [
    ("for i in range(20):\n    d = fetch(i)\n", {2}),  # the `if d > t: break` may follow
    ("while i < n:\n    r: int = lookup(i)\n", {2}),
    ("for i in xs:\n    a, b = pair(\n        i)\n", {2, 3}),
    ("for i in range(20):\n    d = fetch(i)\n    if d > 3:\n        pass\n", set()),
    ("for i in xs:\n    if d > 3:\n        break\n    d = fetch(i)\n", set()),  # read above
    ("for doc in docs:\n    out.append(summarize(doc))\n", set()),  # a map
    ("for x in xs:\n    total += score(x)\n", set()),  # a reduction
    ("for x in xs:\n    labels[x] = classify(x)\n", set()),  # stored
    ("d = fetch(1)\n", set()),  # not in a loop
    ("xs = [f(i) for i in range(9)]\n", set()),  # a comprehension has no exit
    ("for i in xs:\n    d = i + 1\n", set()),  # no call
    ("for i in xs:\n    d = fetch(\n", set()),  # does not parse
])
def test_unread_result_lines(source, lines):
    assert unread_result_lines(source) == lines


@pytest.mark.parametrize("source, lines", [
    ("while i < n:\n    r = lookup(i)\n", {1, 2}),
    ("for _ in range(5):\n    v.append(vote(q))\n", set()),
    ("x = 1\nfor i in xs:\n    while ok(i):\n        f(i)\n", {3, 4}),
    ("while ok(\n", None),  # does not parse
])
def test_while_loop_lines(source, lines):
    assert while_loop_lines(source) == (None if lines is None else frozenset(lines))
