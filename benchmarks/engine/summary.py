"""The rows summed up per prompt set and system: decode speed, prefill, drafting counters,
speedups against the bases that ran, the ceilings and whether outputs match the reference."""

from __future__ import annotations

import statistics

from ..ceiling import Walk
from .anchor import AnchorCheck
from .catalogue import ANCHOR, INT8_SYSTEMS, REFERENCE_SYSTEMS, SPEEDUP_BASES
from .systems import Row


def reference_system(systems: list[str]) -> str | None:
    """The system whose output the others are compared with."""
    return next((s for s in REFERENCE_SYSTEMS if s in systems), None)


def summarise(rows: list[Row], systems: list[str], sets: list[str],
              ceilings: dict[str, dict[str, Walk]] | None = None,
              anchor: AnchorCheck | None = None) -> dict:
    """Per prompt set (and ``"all"``), per system: tokens, decode tok/s over all its runs,
    mean prefill, drafting counters, speedups against the `SPEEDUP_BASES` that ran, and
    ``prefill_speedup_vs_llamacpp``. Ratios against llama.cpp appear only when ``anchor``
    (its steadiness over the invocation) is ``ok``."""
    summary: dict = {}
    for prompt_set in [*sets, "all"]:
        per = {}
        for system in systems:
            mine = [r for r in rows if r.system == system and prompt_set in (r.prompt_set, "all")]
            if not mine:
                continue
            decode_tokens = sum(max(r.new_tokens - 1, 0) for r in mine)
            decode_s = sum(r.decode_s for r in mine)
            steps = sum(r.verify_steps for r in mine)
            drafted = sum(r.draft_tokens for r in mine)
            accepted = sum(r.accepted_tokens for r in mine)
            per[system] = {
                "prompts": len(mine),
                "new_tokens": sum(r.new_tokens for r in mine),
                "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
                "mean_prefill_s": statistics.mean(r.prefill_s for r in mine),
                "mean_total_s": statistics.mean(r.total_s for r in mine),
                "tau": (accepted + steps) / steps if steps else None,
                "acceptance_rate": accepted / drafted if drafted else None,
            }
        for system, totals in (ceilings or {}).get(prompt_set, {}).items():
            if system in per:
                per[system]["ceiling_tau"] = totals.tau
                per[system]["ceiling_speedup_vs_plain"] = totals.speedup
        for system, entry in per.items():
            for base in SPEEDUP_BASES:
                if base == ANCHOR and not (anchor and anchor.ok):
                    continue
                if base in per and per[base]["decode_tok_s"] > 0:
                    entry[f"speedup_vs_{base}"] = entry["decode_tok_s"] / per[base]["decode_tok_s"]
            if ANCHOR in per and anchor and anchor.ok and entry["mean_prefill_s"] > 0:
                entry[f"prefill_speedup_vs_{ANCHOR}"] = (per[ANCHOR]["mean_prefill_s"]
                                                         / entry["mean_prefill_s"])
        summary[prompt_set] = per
    same_as_int8_plain(rows, systems, summary)
    reference = reference_system(systems)
    texts = {(r.prompt_set, r.prompt_id): r.text for r in rows if r.system == reference}
    if texts:
        for system in systems:
            mine = [r for r in rows if r.system == system and (r.prompt_set, r.prompt_id) in texts]
            if mine:
                same = sum(r.text == texts[(r.prompt_set, r.prompt_id)] for r in mine)
                summary["all"].setdefault(system, {})[f"same_output_as_{reference}"] = \
                    f"{same}/{len(mine)}"
    return summary


def same_as_int8_plain(rows: list[Row], systems: list[str], summary: dict) -> None:
    """``same_output_as_plain-int8`` for the other int8 systems (greedy speculative == greedy
    plain within a precision; int8 outputs may differ from exact plain's)."""
    texts = {(r.prompt_set, r.prompt_id): r.text for r in rows if r.system == "plain-int8"}
    for system in systems:
        mine = [r for r in rows if r.system == system and (r.prompt_set, r.prompt_id) in texts]
        if system in INT8_SYSTEMS and system != "plain-int8" and mine:
            same = sum(r.text == texts[(r.prompt_set, r.prompt_id)] for r in mine)
            summary["all"].setdefault(system, {})["same_output_as_plain-int8"] = f"{same}/{len(mine)}"
