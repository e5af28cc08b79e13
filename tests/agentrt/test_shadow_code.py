"""`ShadowCode` on its own: the statements a shadow runs, numbered through the blocks it holds."""

from __future__ import annotations

from agentrt.shadow_code import ShadowCode


def test_closed_blocks_and_the_open_tail_numbered_through():
    code = ShadowCode()
    code.start_turn()
    code.statement_closed(0, 1, 1, "a = f(1)\n")
    code.statement_closed(0, 2, 3, "for i in r:\n    g(i)\n")
    code.block_closed(0, "a = f(1)\nfor i in r:\n    g(i)\n")
    code.statement_closed(1, 1, 1, "b = f(2)\n")
    code.open_block_grew("while b:\n    b = h(b)\n    pri")
    program = code.program()
    assert program.statements == (
        (0, 1, "a = f(1)\n"), (0, 2, "for i in r:\n    g(i)\n"), (1, 4, "b = f(2)\n"),
        (1, 5, "while b:\n    b = h(b)\n"))
    assert program.layout == ((0, 1), (1, 4))
    assert program.tail_line == 5 and program.tail == "while b:\n    b = h(b)\n"
    assert program.lines == 6


def test_executed_blocks_leave_and_a_broken_block_is_skipped_but_counted():
    code = ShadowCode()
    code.start_turn()
    code.statement_closed(0, 1, 1, "x = 1\n")
    code.block_closed(0, "x = 1\n")
    code.block_closed(1, "y = (\n2\n", broken=True)
    code.statement_closed(2, 1, 1, "z = 3\n")
    code.block_closed(2, "z = 3")  # no final newline: still one line
    assert code.program().statements == ((0, 1, "x = 1\n"), (2, 4, "z = 3\n"))
    code.block_executed(0)
    assert code.executed == 1
    program = code.program()
    assert program.statements == ((2, 3, "z = 3\n"),)
    assert program.layout == ((2, 3),) and program.tail is None


def test_a_tail_that_cannot_run_yet_adds_nothing_and_a_new_turn_starts_empty():
    code = ShadowCode()
    code.start_turn()
    code.open_block_grew("for x in xs:\n")  # a header alone is not worth running
    assert code.program().statements == ()
    code.statement_closed(0, 1, 1, "a = 1\n")
    code.open_block_grew("   \n")
    assert code.program().tail_line is None
    code.start_turn()
    assert code.program().statements == () and code.executed == 0
