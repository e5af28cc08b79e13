"""Which calls of a loop still streaming have results the code has not used yet.

In ``for i in range(20):\n    d = fetch(i)\n`` the loop so far looks like a parallel map, but
``d`` is overwritten every iteration and read nowhere: the line that uses it has not streamed
yet, and it may be an exit (``if d > t: break``). ``summaries.append(summarize(doc))`` or
``total += score(x)`` consume the result at once: a map or a reduction. The runtime windows the
launches of the first kind only (`agentrt.speculation`).

`while_loop_lines` tells the other case the runtime must stop: a call that repeats its
arguments at one site is a loop making no progress only in a ``while`` (its update has not
streamed); a ``for`` loop advances by itself (``for _ in range(5): votes.append(vote(q))``).
"""

from __future__ import annotations

import ast

_LOOPS = (ast.For, ast.AsyncFor, ast.While)


def unread_result_lines(source: str) -> frozenset[int]:
    """Lines (from 1) of the statements in a loop of ``source`` that bind a call's result to
    names that ``source`` reads nowhere else; empty if ``source`` does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return frozenset()
    lines: set[int] = set()
    for loop in ast.walk(tree):
        if not isinstance(loop, _LOOPS):
            continue
        for stmt in ast.walk(loop):
            if not isinstance(stmt, (ast.Assign, ast.AnnAssign)) or stmt.value is None \
                    or not any(isinstance(node, ast.Call) for node in ast.walk(stmt.value)):
                continue
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            names = {node.id for target in targets for node in ast.walk(target)
                     if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
            if names and not _read_elsewhere(tree, stmt, names):
                lines.update(range(stmt.lineno, (stmt.end_lineno or stmt.lineno) + 1))
    return frozenset(lines)


def _read_elsewhere(tree: ast.AST, stmt: ast.stmt, names: set[str]) -> bool:
    inside = {id(node) for node in ast.walk(stmt)}
    return any(isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
               and node.id in names and id(node) not in inside for node in ast.walk(tree))


def while_loop_lines(source: str) -> frozenset[int] | None:
    """Lines (from 1) of ``source`` inside a ``while`` loop (its test and body); None if
    ``source`` does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    return frozenset(line for loop in ast.walk(tree) if isinstance(loop, ast.While)
                     for line in range(loop.lineno, (loop.end_lineno or loop.lineno) + 1))
