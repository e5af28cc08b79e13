"""The lookup ceiling (`benchmarks.ceiling`): an oracle walk with a real drafter, by hand, and
the engine benchmark reporting it next to the measured systems."""

from __future__ import annotations

import json

import pytest
from agentrt.engine.drafters import NgramDrafter

from benchmarks.ceiling import walk


def cost(n: int) -> float:
    return 1.0 + 0.1 * (n - 1)


def test_walk_drafts_exactly_what_verification_would_accept():
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    output = [9, 1, 2, 3, 4, 10, 5, 6]
    totals = walk(NgramDrafter().begin(prompt), output, cost)
    # steps: 1 (nothing matches 9) | 2 3 4 accepted + 10 | 5 (nothing matches 10) | 6, the last
    # token, always comes from the target
    assert (totals.tokens, totals.steps) == (7, 4)
    assert totals.tau == pytest.approx(7 / 4)
    assert totals.drafted_s == pytest.approx(1.0 + 1.3 + 1.0 + 1.0)
    assert totals.speedup == pytest.approx(7 / 4.3)


def test_walk_adds_up_and_handles_tiny_outputs():
    one = walk(NgramDrafter().begin([5, 6]), [7], cost)
    assert (one.tokens, one.steps, one.tau, one.speedup) == (0, 0, None, None)
    two = walk(NgramDrafter().begin([5, 6, 5]), [6, 5, 6, 5, 6], cost)  # a period-2 repeat
    assert (two.tokens, two.steps) == (4, 1)
    both = one + two
    assert (both.tokens, both.steps, both.plain_s) == (4, 1, 4.0)


def test_engine_benchmark_reports_the_ceiling_next_to_the_measured_system(tmp_path):
    from benchmarks.engine import cli

    code = cli.main(["--systems", "plain,ngram", "--sets", "agent_code", "--limit", "1",
                     "--max-tokens", "24", "--out", str(tmp_path)])
    assert code == 0
    result = json.loads(next(tmp_path.glob("engine-*.json")).read_text())
    ngram = result["summary"]["agent_code"]["ngram"]
    assert ngram["ceiling_tau"] >= 1.0 and ngram["ceiling_speedup_vs_plain"] > 0
    assert "ceiling_tau" not in result["summary"]["agent_code"]["plain"]
    plain_row = next(r for r in result["rows"] if r["system"] == "plain")
    assert plain_row["new_tokens"] - 1 <= len(plain_row["token_ids"]) <= plain_row["new_tokens"]
    assert "ceiling x plain" in next(tmp_path.glob("engine-*.md")).read_text()
