"""Engine benchmark under concurrency: many requests at once on one engine.

    python -m benchmarks.run engine --concurrency 1,2,4,8,16 [--systems plain,suffix,vllm,...]
                                    [--max-tokens 64] [--sets agent_code,chat,copy_heavy]
                                    [--step-token-budget off,64]

For each system, the first max(c) prompts (the sets one after another) first run alone one after
another (the c=1 row and the reference outputs); then, for each concurrency c > 1, c of them start
together on one engine (a fresh burst: nothing cached from the runs before). The table gives the
aggregate decode throughput (output tokens after each request's first / the span from the first
request's first token to the last one's last; for c=1 the sum of the solo decode times) and the
aggregate throughput (all output tokens / wall time, prefill included), each with its ratio to
the same prompts one at a time, the mean per-request latency and time to the first token, the
inter-token latency of running requests (p50 and p99 over every gap between two consecutive
deltas of a request, after its first), the throughput of prompt and output tokens together
(/ wall time), and how many outputs equal the same prompt's output at concurrency 1 (greedy).
The longest gap is reported too: p99 misses a pause that only a few requests see once.
``--step-token-budget`` runs each native system once per value (``off`` or a number: the
engine's ``step_token_budget``), each in a process of its own, named ``system budget=value``.
The native systems then run three prefix / priority scenarios:

- *multi-turn*: a ~1K-token first turn, then a second turn that extends it: prompt tokens
  prefilled and time to first token, with the prefix cache and without;
- *sub-queries*: 16 requests sharing a ~1K-token instruction prefix: tokens prefilled in all,
  wall time, with and without the prefix cache;
- *root + 8 sub-queries*: a root request's decode rate alone, then with 8 sub-queries
  (priority 1, the shared 1K prefix) launched once its first token arrived;
- *agent*: an RLM-style task whose ``llm_query`` calls go to the same engine as the root
  (public `Agent` API, the root's program scripted, sub-queries at priority 1), sequential vs
  speculative tools: wall time and answers (a ratio only where both runs answered).

vLLM systems (``vllm``, ``vllm-spec``, in the vLLM virtualenv) take part in the concurrency
table; the scenarios use native-engine metrics and run on the native systems only.

With several systems, each runs alone in a child process of its own (one after another, same
prompts, threads and warm-up): engines sharing a process, or running at once, slow each other's
thread pools and make the comparison an artefact of the mix.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentrt.demo import REVIEWS

from .common import VLLM_SYSTEMS, child_env, load_prompts, write_results

NATIVE = ("plain", "ngram", "suffix", "draft", "eagle", "hybrid", "twin", "hybrid-twin")
RULES = "\n".join(f"Rule {i}: when the input mentions item {i}, answer with the code word "
                  f"alpha-{i * 7 % 13} and nothing else." for i in range(40))


@dataclass
class Request:
    """One streamed request's timings and output."""

    prompt_id: str
    tokens: int = 0
    ttft_s: float = 0.0
    total_s: float = 0.0
    decode_s: float = 0.0
    first_at: float = 0.0
    """perf_counter() of the first output delta (and of the last one, below)."""
    last_at: float = 0.0
    gaps: list[float] = field(default_factory=list)
    """Seconds between consecutive output deltas, after the first (inter-token latency)."""
    prompt_tokens: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    metrics: dict | None = None


async def stream_one(engine, prompt_id: str, messages: list[dict], params,
                     first_token: asyncio.Event | None = None) -> Request:
    """Run one request to its end on ``engine``, timing its stream."""
    out = Request(prompt_id)
    start = time.perf_counter()
    first = last = None
    final = None
    async with contextlib.aclosing(engine.stream(messages, params)) as deltas:
        async for delta in deltas:
            now = time.perf_counter()
            if delta.text or delta.token_ids:
                out.text += delta.text
                out.token_ids.extend(delta.token_ids)
                if first is None:
                    first = now
                    if first_token is not None:
                        first_token.set()
                else:
                    out.gaps.append(now - last)
                last = now
            if delta.finish_reason is not None:
                final = delta
    end = time.perf_counter()
    first, last = first or end, last or end
    out.tokens = final.usage.completion_tokens if final is not None and final.usage else len(out.token_ids)
    out.prompt_tokens = final.usage.prompt_tokens if final is not None and final.usage else 0
    out.ttft_s, out.total_s, out.decode_s = first - start, end - start, last - first
    out.first_at, out.last_at = first, last
    if final is not None and final.metrics is not None:
        out.metrics = final.metrics.to_dict()
    return out


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (linear between ranks; NaN when empty)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    at = (len(ordered) - 1) * q / 100
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


def token_latency(requests: list[dict[str, Any]], wall: float) -> dict[str, float]:
    """Inter-token latency of running requests (p50, p99 and the longest over all their gaps)
    and the throughput of prompt and output tokens together over ``wall`` seconds."""
    gaps = [g for r in requests for g in r["gaps"]]
    processed = sum(r["prompt_tokens"] + r["tokens"] for r in requests)
    return {"itl_p50_s": percentile(gaps, 50), "itl_p99_s": percentile(gaps, 99),
            "itl_max_s": max(gaps, default=float("nan")), "gaps": len(gaps),
            "processed_tok_s": processed / wall if wall > 0 else 0.0}


async def run_level(engine, prompts: list[tuple[str, list[dict]]], concurrency: int,
                    max_tokens: int) -> dict[str, Any]:
    """``concurrency`` requests at once; aggregate and per-request figures."""
    from agentrt.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens)
    chosen = [prompts[i % len(prompts)] for i in range(concurrency)]
    start = time.perf_counter()
    results = await asyncio.gather(*[stream_one(engine, pid, m, params) for pid, m in chosen])
    wall = time.perf_counter() - start
    tokens = sum(r.tokens for r in results)
    window = max(r.last_at for r in results) - min(r.first_at for r in results)
    requests = [asdict(r) | {"metrics": None} for r in results]
    return {
        "concurrency": concurrency,
        "wall_s": wall,
        "tokens": tokens,
        "aggregate_tok_s": tokens / wall if wall > 0 else 0.0,
        "decode_window_s": window,
        "aggregate_decode_tok_s": sum(max(r.tokens - 1, 0) for r in results) / window if window > 0 else 0.0,
        "mean_latency_s": statistics.mean(r.total_s for r in results),
        "mean_ttft_s": statistics.mean(r.ttft_s for r in results),
        "mean_request_decode_tok_s": statistics.mean(
            max(r.tokens - 1, 0) / r.decode_s for r in results if r.decode_s > 0) if any(
            r.decode_s > 0 for r in results) else 0.0,
        **token_latency(requests, wall),
        "requests": requests,
    }


async def run_solo(engine, prompts: list[tuple[str, list[dict]]], max_tokens: int) -> dict[str, Any]:
    """Each prompt alone, one after another: the concurrency-1 row (and every prompt's solo
    output, which the other rows are compared with)."""
    levels = [await run_level(engine, [p], 1, max_tokens) for p in prompts]
    wall = sum(lv["wall_s"] for lv in levels)
    tokens = sum(lv["tokens"] for lv in levels)
    requests = [r for lv in levels for r in lv["requests"]]
    window = sum(r["decode_s"] for r in requests)
    return {
        "concurrency": 1, "wall_s": wall, "tokens": tokens,
        "aggregate_tok_s": tokens / wall if wall > 0 else 0.0,
        "decode_window_s": window,
        "aggregate_decode_tok_s": sum(max(r["tokens"] - 1, 0) for r in requests) / window if window > 0 else 0.0,
        "mean_latency_s": statistics.mean(r["total_s"] for r in requests),
        "mean_ttft_s": statistics.mean(r["ttft_s"] for r in requests),
        "mean_request_decode_tok_s": statistics.mean(lv["mean_request_decode_tok_s"] for lv in levels),
        **token_latency(requests, wall),
        "requests": requests,
    }


async def multi_turn(engine_factory, max_tokens: int) -> dict[str, Any]:
    """Second turn of a ~1K-token conversation with and without the prefix cache."""
    from agentrt.engine import SamplingParams

    first = [{"role": "user", "content": RULES + "\nWhich code word goes with item 3?"}]
    out: dict[str, Any] = {}
    for cached in (True, False):
        engine = engine_factory(prefix_cache=cached)
        try:
            one = await stream_one(engine, "turn-1", first, SamplingParams(max_tokens=max_tokens))
            second = first + [{"role": "assistant", "content": one.text},
                              {"role": "user", "content": "And item 5?"}]
            two = await stream_one(engine, "turn-2", second, SamplingParams(max_tokens=max_tokens))
            out["cache" if cached else "no_cache"] = {
                "prompt_tokens": len(engine.tokenizer.encode_chat(second)),
                "prefilled_tokens": two.metrics["prefill_tokens"],
                "cached_tokens": two.metrics["cached_tokens"],
                "ttft_s": two.ttft_s, "text": two.text}
        finally:
            await engine.aclose()
    out["same_output"] = out["cache"]["text"] == out["no_cache"]["text"]
    return out


def _subqueries(n: int) -> list[list[dict]]:
    return [[{"role": "system", "content": RULES},
             {"role": "user", "content": f"Item {i}: which code word?"}] for i in range(n)]


async def shared_prefix(engine_factory, max_tokens: int) -> dict[str, Any]:
    """16 sub-queries sharing a ~1K-token prefix, with and without the prefix cache."""
    from agentrt.engine import SamplingParams

    queries = _subqueries(16)
    out: dict[str, Any] = {}
    for cached in (True, False):
        engine = engine_factory(prefix_cache=cached)
        try:
            before = engine.batch_metrics().prefill_tokens
            start = time.perf_counter()
            results = await asyncio.gather(*[stream_one(engine, f"sub-{i}", q, SamplingParams(
                max_tokens=max_tokens)) for i, q in enumerate(queries)])
            out["cache" if cached else "no_cache"] = {
                "prompt_tokens": sum(len(engine.tokenizer.encode_chat(q)) for q in queries),
                "prefilled_tokens": engine.batch_metrics().prefill_tokens - before,
                "wall_s": time.perf_counter() - start,
                "texts": [r.text for r in results]}
        finally:
            await engine.aclose()
    out["same_output"] = out["cache"]["texts"] == out["no_cache"]["texts"]
    return out


async def root_with_subqueries(engine, root: list[dict], max_tokens: int,
                               subqueries: int = 8) -> dict[str, Any]:
    """The root's decode rate alone, then with ``subqueries`` less urgent requests in flight."""
    from agentrt.engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, priority=0)
    alone = await stream_one(engine, "root", root, params)
    started = asyncio.Event()
    root_task = asyncio.create_task(stream_one(engine, "root", root, params, started))
    await started.wait()
    subs = [asyncio.create_task(stream_one(engine, f"sub-{i}", q, SamplingParams(
        max_tokens=max_tokens, priority=1))) for i, q in enumerate(_subqueries(subqueries))]
    busy = await root_task
    sub_results = await asyncio.gather(*subs)

    def rate(r: Request) -> float:
        return max(r.tokens - 1, 0) / r.decode_s if r.decode_s > 0 else 0.0

    return {"alone_tok_s": rate(alone), "with_subqueries_tok_s": rate(busy),
            "ratio": rate(busy) / rate(alone) if rate(alone) else 0.0,
            "same_output": busy.text == alone.text,
            "subqueries_done": sum(r.tokens > 0 for r in sub_results)}


def run(args, systems: list[str], sets: list[str], make_engine,
        prefix_scenarios: bool = True) -> int:
    """The concurrency suite (``--concurrency``) for ``systems`` on the prompt ``sets``; writes
    results like the main benchmark. ``make_engine(system, loop, **options)`` builds a system's
    engine on the suite's event loop (``options``: more `NativeConfig` fields);
    ``prefix_scenarios``: whether a single native system also runs the prefix scenarios (off in
    the children for all but the first native system of a multi-system run).

    One system runs here, in this process. Several (or one native system at several
    ``--step-token-budget`` values) run one after another, each alone in a child process of its
    own (same prompts, threads and warm-up), so no system's threads compete with another's
    engine; the prefix scenarios run once, with the first native system."""
    levels = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    if not levels or levels[0] < 1:
        print("engine bench: --concurrency needs positive integers, e.g. 1,2,4,8,16", file=sys.stderr)
        return 2
    try:
        budgets = budget_values(args.step_token_budget)
    except ValueError as exc:
        print(f"engine bench: {exc}", file=sys.stderr)
        return 2
    runnable = (*NATIVE, *VLLM_SYSTEMS)
    skipped = [s for s in systems if s not in runnable]
    systems = [s for s in systems if s in runnable]
    if not systems:
        print(f"engine bench: --concurrency runs {', '.join(runnable)}; "
              "none of those was asked for", file=sys.stderr)
        return 2
    if skipped:
        print(f"engine bench: --concurrency skips {', '.join(skipped)} (it runs "
              f"{', '.join(runnable)})", file=sys.stderr)
    variants = [(system, budget) for system in systems
                for budget in (budgets if system in NATIVE else [None])]
    failed: dict[str, str] = {}
    load_before = os.getloadavg()
    if len(variants) == 1:
        (system, budget), = variants
        results = run_here(args, system, sets, levels, make_engine,
                           prefix_scenarios=prefix_scenarios, budget=budget)
        isolation = "one system, alone in this process"
    else:
        prefix_variant = next((v for v in variants if v[0] in NATIVE), None)
        results = {"levels": {}, "scenarios": {}, "processes": {}}
        for system, budget in variants:
            try:
                child = run_in_child(args, system, budget,
                                     prefix_scenarios=(system, budget) == prefix_variant)
            except BenchChildError as exc:
                print(f"engine bench: {exc}", file=sys.stderr)
                failed[variant_name(system, budget)] = str(exc)
                continue
            for key in results:
                results[key].update(child[key])
        isolation = "each system alone in a child process of its own, one after another"
    meta = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "model": args.model, "dtype": args.dtype,
            "threads": args.threads, "max_tokens": args.max_tokens, "levels": levels,
            "systems": systems, "step_token_budgets": budgets, "sets": sets,
            "isolation": isolation, "failed": failed,
            "load_avg_before_after": [load_before[0], os.getloadavg()[0]],
            "vllm_cpu_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_CPU_")}}
    md = markdown(results, meta)
    print(md)
    write_results({"meta": meta, "results": results}, md, args.out)
    return 1 if failed else 0


def budget_values(option: str | None) -> list[str | None]:
    """``--step-token-budget`` as a list of values (``"off"`` or a positive number); [None]
    (the engine's default) when it is not given."""
    if not option:
        return [None]
    values = [v.strip() for v in option.split(",") if v.strip()]
    bad = [v for v in values if v != "off" and not (v.isdigit() and int(v) > 0)]
    if bad or not values:
        raise ValueError(f"--step-token-budget takes 'off' or positive numbers, got {option!r}")
    return values


def budget_options(budget: str | None) -> dict[str, Any]:
    """The `NativeEngine` options for one ``--step-token-budget`` value."""
    if budget is None:
        return {}
    return {"step_token_budget": None if budget == "off" else int(budget)}


def variant_name(system: str, budget: str | None) -> str:
    """How the tables name ``system`` run at ``budget`` (its own name at the default)."""
    return system if budget is None else f"{system} budget={budget}"


def fresh_start(engine, loop: asyncio.AbstractEventLoop) -> None:
    """Clear what the engine learnt from the runs before: a native engine's prefix cache,
    drafter corpus and acceptance estimates, vLLM's prefix cache. Every level runs the same
    prompts, and a level that found the earlier levels' prompts cached (or their outputs in
    the drafter's corpus) would be flattered."""
    reset = getattr(engine, "reset", None)
    if reset is not None:
        reset()
    else:
        loop.run_until_complete(engine.reset_prefix_cache())


def run_here(args, system: str, sets: list[str], levels: list[int], make_engine,
             prefix_scenarios: bool, budget: str | None = None) -> dict[str, Any]:
    """One system's concurrency table (and, for a native system, its scenarios) in this
    process, at ``budget`` (a ``--step-token-budget`` value; None: the engine's default):
    ``{"levels": {...}, "scenarios": {...}, "processes": {name: pid}}``, under its
    `variant_name`."""
    prompts = [(f"{name}/{row['id']}", row["messages"]) for name, row in
               load_prompts(sets, args.limit)]
    name, options = variant_name(system, budget), budget_options(budget)
    loop = asyncio.new_event_loop()
    results: dict[str, Any] = {"levels": {}, "scenarios": {}, "processes": {name: os.getpid()}}
    try:
        engine = make_engine(system, loop, **options)
        try:
            loop.run_until_complete(run_level(engine, prompts[:1], 1, 8))  # warm-up
            fresh_start(engine, loop)
            table = [loop.run_until_complete(run_solo(engine, prompts[:max(levels)],
                                                      args.max_tokens))]
            for c in levels:
                if c != 1:
                    fresh_start(engine, loop)
                level = table[0] if c == 1 else loop.run_until_complete(
                    run_level(engine, prompts, c, args.max_tokens))
                if c != 1:
                    table.append(level)
                print(f"{name:10s} c={c:2d} {level['aggregate_decode_tok_s']:7.1f} decode tok/s "
                      f"latency {level['mean_latency_s']:6.2f}s inter-token p99 "
                      f"{1000 * level['itl_p99_s']:6.1f} ms", file=sys.stderr)
            solo = {r["prompt_id"]: r for r in table[0]["requests"]}
            table = [lv for lv in table if lv["concurrency"] in levels]
            for level in table:
                mine = level["requests"]
                level["same_as_solo"] = (
                    f"{sum(r['text'] == solo[r['prompt_id']]['text'] for r in mine)}/{len(mine)}")
                # one request at a time on the same prompts: their tokens over their solo time
                alone = [solo[r["prompt_id"]] for r in mine]
                level["x_one"] = _ratio(level["aggregate_tok_s"] * sum(a["total_s"] for a in alone),
                                        sum(a["tokens"] for a in alone))
                level["decode_x_one"] = _ratio(
                    level["aggregate_decode_tok_s"] * sum(a["decode_s"] for a in alone),
                    sum(max(a["tokens"] - 1, 0) for a in alone))
            results["levels"][name] = table
            if system in NATIVE:
                results["levels"][name + ":batch"] = engine.batch_metrics().to_dict() | {
                    "timeline": None}
                root = prompts[0][1]
                results["scenarios"][name] = {
                    "root_with_8_subqueries": loop.run_until_complete(
                        root_with_subqueries(engine, root, args.max_tokens))}
        finally:
            loop.run_until_complete(engine.aclose())
        if system in NATIVE and prefix_scenarios:
            def factory(prefix_cache: bool):
                return make_engine(system, loop, prefix_cache=prefix_cache, **options)
            scen = results["scenarios"][name]
            scen["multi_turn"] = loop.run_until_complete(multi_turn(factory, args.max_tokens))
            scen["shared_prefix_16"] = loop.run_until_complete(
                shared_prefix(factory, min(args.max_tokens, 16)))
            scen["agent_rlm"] = loop.run_until_complete(agent_run(lambda: factory(True)))
    finally:
        with contextlib.suppress(Exception):
            loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
    return results


def _ratio(num: float, den: float) -> float:
    """``num / den``, NaN when ``den`` is 0 (e.g. replies of one streamed delta)."""
    return num / den if den else float("nan")


class BenchChildError(RuntimeError):
    """A system's child process failed or wrote no results."""


def run_in_child(args, system: str, budget: str | None, prefix_scenarios: bool) -> dict[str, Any]:
    """Run ``system`` at ``budget`` alone through ``python -m benchmarks.engine`` (this
    invocation's options, one system, one budget) and return its results. Its progress goes to
    this process's stderr; its table is dropped (this process prints the merged one)."""
    name = variant_name(system, budget)
    with tempfile.TemporaryDirectory(prefix="engine-concurrency-") as out:
        overrides = {"systems": system, "step_token_budget": budget, "out": out,
                     "worker_no_prefix_scenarios": not prefix_scenarios}
        command = [sys.executable, "-m", "benchmarks.engine", *bench_argv(args, overrides)]
        print(f"engine bench: {name} in its own process", file=sys.stderr)
        done = subprocess.run(command, env=child_env(), stdout=subprocess.DEVNULL, check=False)
        found = sorted(Path(out).glob("engine-*.json"))
        if done.returncode != 0 or not found:
            raise BenchChildError(f"{name}: its process exited with status {done.returncode}"
                                  + ("" if found else " and wrote no results"))
        return json.loads(found[-1].read_text())["results"]


def bench_argv(args, overrides: dict[str, Any]) -> list[str]:
    """The engine benchmark's command line for ``args`` (its parsed options), with
    ``overrides`` replacing some of them."""
    argv: list[str] = []
    for name, value in (vars(args) | overrides).items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    return argv


def fmt_load(meta: dict) -> str:
    """The run's 1-minute load average before and after, as text."""
    load = meta.get("load_avg_before_after")
    return f"{load[0]:.1f} before, {load[1]:.1f} after" if load else "not recorded"


def markdown(results: dict, meta: dict) -> str:
    lines = [f"# Engine benchmark under concurrency ({meta['time']})", "",
             f"model `{meta['model']}` {meta['dtype']}, torch threads {meta['threads']}, "
             f"max_tokens {meta['max_tokens']}, greedy; sets {', '.join(meta['sets'])}; "
             f"{meta.get('isolation', '')}; 1-minute load average {fmt_load(meta)}.", "",
             "| system | c | aggregate decode tok/s | x one request | aggregate tok/s (with prefill) "
             "| x one request | mean latency s | mean TTFT s | per-request decode tok/s "
             "| inter-token p50 / p99 / max ms | prompt + output tok/s | same as c=1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for system, table in results["levels"].items():
        if system.endswith(":batch"):
            continue
        for lv in table:
            lines.append(f"| {system} | {lv['concurrency']} | {lv['aggregate_decode_tok_s']:.1f} | "
                         f"{lv['decode_x_one']:.2f} | {lv['aggregate_tok_s']:.1f} | "
                         f"{lv['x_one']:.2f} | {lv['mean_latency_s']:.2f} | {lv['mean_ttft_s']:.2f} | "
                         f"{lv['mean_request_decode_tok_s']:.1f} | {1000 * lv['itl_p50_s']:.0f} / "
                         f"{1000 * lv['itl_p99_s']:.0f} / {1000 * lv['itl_max_s']:.0f} | "
                         f"{lv['processed_tok_s']:.1f} | {lv['same_as_solo']} |")
    lines += [f"- **{system} failed**: {why}" for system, why in meta.get("failed", {}).items()]
    lines.append("")
    for system, scen in results["scenarios"].items():
        lines += [f"## {system}: prefixes and priority", ""]
        r = scen.get("root_with_8_subqueries")
        if r:
            lines.append(f"- root decode alone {r['alone_tok_s']:.1f} tok/s, with 8 sub-queries in "
                         f"flight {r['with_subqueries_tok_s']:.1f} tok/s: **{r['ratio']:.2f}x** "
                         f"(same output: {r['same_output']})")
        m = scen.get("multi_turn")
        if m:
            c, n = m["cache"], m["no_cache"]
            lines.append(f"- second turn of {c['prompt_tokens']} tokens: prefilled {c['prefilled_tokens']} "
                         f"(cached {c['cached_tokens']}), TTFT {c['ttft_s']:.2f}s; without the "
                         f"prefix cache {n['prefilled_tokens']}, TTFT {n['ttft_s']:.2f}s "
                         f"(same output: {m['same_output']})")
        s = scen.get("shared_prefix_16")
        if s:
            c, n = s["cache"], s["no_cache"]
            lines.append(f"- 16 sub-queries, {c['prompt_tokens']} prompt tokens in all: prefilled "
                         f"{c['prefilled_tokens']} in {c['wall_s']:.2f}s; without the prefix cache "
                         f"{n['prefilled_tokens']} in {n['wall_s']:.2f}s (same outputs: {s['same_output']})")
        a = scen.get("agent_rlm")
        if a:
            q, p = a["sequential"], a["speculative"]
            ratio = (f"**{a['speedup']:.2f}x**" if a.get("speedup") is not None else
                     f"no ratio: a run ended without an answer (sequential {q['status']}, "
                     f"speculative {p['status']})")
            lines.append(f"- agent (RLM task, scripted root, `llm_query` on the same engine at priority 1): "
                         f"sequential tools {q['wall_s']:.2f}s, speculative {p['wall_s']:.2f}s "
                         f"({ratio}), tool calls {q['tool_calls']} / {p['tool_calls']}, "
                         f"early hits {p['early_hits']}, same answer: "
                         f"{'n/a' if a['same_answer'] is None else a['same_answer']} "
                         f"({p['answer'][:80]})")
        lines.append("")
    for system, table in results["levels"].items():
        if system.endswith(":batch"):
            lines.append(f"- `{system[:-6]}` batching: mean batch {table['mean_batch']:.1f}, max "
                         f"{table['max_batch']}, mean queue wait {table['mean_queue_s']:.3f}s, "
                         f"prefix-cache hit tokens {table['cached_tokens']}, preemptions "
                         f"{table['preemptions']}")
    lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------- agent-level run

AGENT_SYSTEM = (
    "You are a Python agent. Answer with one ```repl code block that uses the list `context` "
    "and the tool `llm_query(prompt)`, which asks a language model one question and returns its "
    "reply, and ends with FINAL(answer).")
AGENT_TASK = "Which reviews in context are negative?"
AGENT_PROGRAM = (
    "```repl\nanswers = [llm_query('Is this review negative? Answer yes or no. ' + review) "
    "for review in context]\nprint(answers)\nFINAL(answers)\n```")
"""The root's reply, scripted (`ForcedEngine`): the 135M model does not write a working program
for the task (its runs ended at max_turns without an answer), and a timing of failed runs
means nothing. Each of its ``llm_query`` calls is the real model's, on the same engine."""


async def agent_run(engine_factory) -> dict[str, Any]:
    """An RLM-style task whose root reply is scripted (`AGENT_PROGRAM`, streamed through the
    native engine by teacher forcing) and whose ``llm_query`` calls are served by the same
    `NativeEngine` (sub-queries at priority 1): tools run when their block is complete, then
    with the shadow interpreter starting them while the root's reply still streams."""
    from agentrt import Agent
    from agentrt.engine import ForcedEngine, SamplingParams

    out: dict[str, Any] = {}
    for speculative in (False, True):
        engine = engine_factory()
        try:
            await stream_one(engine, "warm", [{"role": "user", "content": "Hi"}],
                             SamplingParams(max_tokens=2))
            agent = Agent(ForcedEngine(engine, [AGENT_PROGRAM]), sub_engine=engine,
                          speculation=speculative, max_turns=1, system_prompt=AGENT_SYSTEM,
                          sampling=SamplingParams(max_tokens=160),
                          sub_sampling=SamplingParams(max_tokens=24, priority=1))
            start = time.perf_counter()
            result = await agent.run(AGENT_TASK, REVIEWS)
            wall = time.perf_counter() - start
            out["speculative" if speculative else "sequential"] = {
                "wall_s": wall, "status": result.status, "answer": repr(result.answer)[:300],
                "tool_calls": sum(result.stats.tool_calls.values()), "early_hits": result.stats.hits,
                "mean_batch": engine.batch_metrics().mean_batch}
        finally:
            await engine.aclose()
    out.update(agent_summary(out["sequential"], out["speculative"]))
    return out


def agent_summary(sequential: dict[str, Any], speculative: dict[str, Any]) -> dict[str, Any]:
    """Whether both runs finished with an answer (status ``final``, not None) and then whether
    it was the same one and the speedup; None for both where a run failed (failed runs are
    neither identical nor faster)."""
    finished = all(r["status"] == "final" and r["answer"] != "None" for r in (sequential, speculative))
    return {"finished": finished,
            "same_answer": sequential["answer"] == speculative["answer"] if finished else None,
            "speedup": sequential["wall_s"] / speculative["wall_s"] if finished else None}

