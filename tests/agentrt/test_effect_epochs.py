"""`EffectEpochs` on its own: epochs, stale readers, and when a new shadow may start."""

from __future__ import annotations

from agentrt import tool
from agentrt.effect_epochs import EffectEpochs
from agentrt.tools import ToolRegistry


def registry() -> ToolRegistry:
    @tool(speculate=True, reads={"accounts"})
    def balance() -> int:
        """Reads accounts."""
        return 0

    @tool(speculate=True, reads={"notes"})
    def notes() -> int:
        """Reads notes."""
        return 0

    @tool(speculate=True)
    def anything() -> int:
        """Reads every scope."""
        return 0

    @tool(speculate=True, pure=True)
    def square(x: int) -> int:
        """Pure."""
        return x * x

    @tool(writes={"accounts"})
    def pay(x: int) -> int:
        """Writes accounts."""
        return x

    @tool
    def log(x: int) -> int:
        """Writes every scope."""
        return x

    tools = ToolRegistry()
    for t in (balance, notes, anything, square, pay, log):
        tools.register(t)
    return tools


def test_an_effect_makes_the_readers_of_its_scopes_stale():
    tools = registry()
    epochs = EffectEpochs(tools)
    assert epochs.current == 0
    assert sorted(epochs.advance(tools.get("pay"))) == ["anything", "balance"]
    assert epochs.current == 1
    assert sorted(epochs.advance(tools.get("log"))) == ["anything", "balance", "notes"]
    assert epochs.current == 2


def test_a_shadow_of_an_older_epoch_may_not_overtake_a_write_it_reads():
    tools = registry()
    epochs = EffectEpochs(tools)
    epochs.advance(tools.get("pay"))
    assert epochs.overtakes("balance", 0) and epochs.overtakes("anything", 0)
    assert not epochs.overtakes("notes", 0) and not epochs.overtakes("square", 0)
    assert not epochs.overtakes("balance", 1)  # a shadow that began after the effect


def test_no_new_shadow_while_the_running_block_has_passed_an_effect():
    tools = registry()
    epochs = EffectEpochs(tools)
    assert epochs.shadow_epoch() == 0
    epochs.block_started()
    assert epochs.shadow_epoch() == 0
    epochs.advance(tools.get("log"))
    assert epochs.shadow_epoch() is None
    epochs.block_executed()
    assert epochs.shadow_epoch() == 1
