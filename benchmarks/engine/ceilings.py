"""The lookup ceiling next to the measured systems: its inputs, measured in native plain's
process (`ceiling_inputs`), and the walks over plain's outputs (`lookup_ceilings`; the
arithmetic is `benchmarks.ceiling`'s)."""

from __future__ import annotations

import statistics

from ..ceiling import Walk, walk
from .catalogue import LOOKUP_SYSTEMS
from .systems import Row


def ceiling_inputs(plain, prompts: list[tuple[str, dict]], sets: list[str]) -> dict:
    """What the lookup ceiling needs from native plain's process: each prompt's token ids and,
    per set, the step costs (seconds by rows) measured on plain's model at the set's mean
    prompt length."""
    from agentrt.engine.draft_policy import StepCosts

    prompt_ids = [plain.tokenizer.encode_chat(p["messages"]) for _, p in prompts]
    costs = {}
    for name in sets:
        lengths = [len(ids) for ids, (s, _) in zip(prompt_ids, prompts) if s == name]
        if lengths:
            costs[name] = StepCosts.measure(plain.model, 17,
                                            context=int(statistics.mean(lengths))).points
    return {"prompt_ids": prompt_ids, "costs": costs}


def lookup_ceilings(inputs: dict | None, prompts: list[tuple[str, dict]], rows: list[Row],
                    systems: list[str]) -> dict[str, dict[str, Walk]]:
    """``{set or "all": {system: Walk}}``: the lookup ceiling (see `benchmarks.ceiling`) of each
    n-gram / suffix system in ``systems`` on native plain's outputs (its first run's), at the step
    costs of ``inputs`` (`ceiling_inputs`). Drafters are fresh and see the prompts in run order,
    as the systems did. Empty without those inputs or a lookup system."""
    from agentrt.engine.draft_policy import StepCosts
    from agentrt.engine.drafters import NgramDrafter, SuffixDrafter

    lookups = [s for s in LOOKUP_SYSTEMS if s in systems]
    if not inputs or not lookups:
        return {}
    first_run = min((r.run for r in rows if r.system == "plain"), default=0)
    outputs = {(r.prompt_set, r.prompt_id): r.token_ids for r in rows
               if r.system == "plain" and r.run == first_run}
    costs = {name: StepCosts({int(n): s for n, s in points})
             for name, points in inputs["costs"].items()}
    result: dict[str, dict[str, Walk]] = {name: {} for name in [*costs, "all"]}
    for system in lookups:
        drafter = NgramDrafter() if system == "ngram" else SuffixDrafter()
        for ids, (name, prompt) in zip(inputs["prompt_ids"], prompts):
            totals = walk(drafter.begin(ids), outputs[(name, prompt["id"])], costs[name])
            for key in (name, "all"):
                result[key][system] = result[key].get(system, Walk()) + totals
    return result
