"""`Turn` on its own: which blocks it traces, speculates and hands on to run, and in what order.
The speculator is a recorder of what the turn reports (a `NoSpeculation`, which ignores it)."""

from __future__ import annotations

import pytest

from agentrt.program_calls import ProgramCalls
from agentrt.results import RunStats
from agentrt.speculation import NoSpeculation
from agentrt.tools import ToolRegistry
from agentrt.trace import Trace
from agentrt.turn import Block, BlockSelection, CellFailed, Turn

RESPONSE = "Prose.\n```python\nx = 1\n```\n```repl\ny = 2\nz = 3\n```\n```repl\nw = 4\n"


class Recorder(NoSpeculation):
    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def start_turn(self, turn):
        self.seen.append(("start_turn", turn))

    def statement_closed(self, block, lineno, end_lineno, source):
        self.seen.append(("statement", block, lineno, source))

    def block_closed(self, block, code, broken=False):
        self.seen.append(("closed", block, code))

    def open_block_grew(self, tail):
        self.seen.append(("tail", tail))

    def block_started(self, block):
        self.seen.append(("started", block))

    def block_executed(self, block):
        self.seen.append(("executed", block))


def make_turn(selection: BlockSelection) -> tuple[Turn, Recorder, list[Block]]:
    calls = ProgramCalls(ToolRegistry(), Trace(), RunStats())
    calls.speculator = recorder = Recorder()
    blocks: list[Block] = []
    turn = Turn(0, calls, blocks.append, selection)
    turn.start()
    for char in RESPONSE:
        turn.feed(char)
    turn.finish()
    return turn, recorder, blocks


def test_every_code_block_by_default():
    turn, recorder, blocks = make_turn(BlockSelection())
    assert blocks == [Block(0, "x = 1\n"), Block(1, "y = 2\nz = 3\n"), Block(2, "w = 4\n")]
    assert [e.data["block"] for e in turn.trace.of("block_opened")] == [0, 1, 2]
    assert turn.prose == "Prose.\n"


def test_a_selection_numbers_its_blocks_and_skips_the_others():
    turn, recorder, blocks = make_turn(BlockSelection(frozenset({"repl"}), unterminated=False))
    assert blocks == [Block(0, "y = 2\nz = 3\n")]  # the unterminated block is not run ...
    assert ("closed", 1, "w = 4\n") in recorder.seen  # ... but speculation sees it
    assert [("statement", 0, 1, "y = 2\n"), ("statement", 0, 2, "z = 3\n")] == \
        [s for s in recorder.seen if s[0] == "statement" and s[1] == 0]
    assert not [s for s in recorder.seen if s[0] == "tail" and "x = 1" in s[1]]
    kinds = [(e.kind, e.data.get("block")) for e in turn.trace.events if e.kind != "delta"]
    assert kinds == [("turn_started", None), ("block_opened", 0), ("statement_closed", 0),
                     ("statement_closed", 0), ("block_closed", 0), ("block_opened", 1),
                     ("statement_closed", 1), ("block_closed", 1)]
    assert recorder.seen[0] == ("start_turn", 0)


class Cell:
    def __init__(self, error=None, final=None):
        self.error, self.final = error, final


@pytest.mark.anyio
async def test_execute_traces_and_tells_speculation_what_a_failure_means():
    turn, recorder, _ = make_turn(BlockSelection())

    async def ok(code):
        return Cell(final="done")

    async def cell_failed(code):
        raise CellFailed("ReplError: gone")

    async def loop_failed(code):
        raise RuntimeError("the loop broke")

    await turn.execute(Block(0, "x = 1\n"), ok)
    with pytest.raises(CellFailed):
        await turn.execute(Block(1, "y = 2\n"), cell_failed)
    with pytest.raises(RuntimeError):
        await turn.execute(Block(2, "w = 4\n"), loop_failed)
    assert turn.calls.block == (0, 2)
    assert [s for s in recorder.seen if s[0] in ("started", "executed")] == [
        ("started", 0), ("executed", 0), ("started", 1), ("executed", 1), ("started", 2)]
    finished = [(e.data["block"], e.data["error"], e.data["final"])
                for e in turn.trace.of("exec_finished")]
    assert finished == [(0, None, True), (1, "ReplError: gone", False),
                        (2, "the loop broke", False)]
