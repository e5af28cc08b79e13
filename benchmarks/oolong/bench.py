"""OOLONG-style end-to-end benchmark: ``python -m benchmarks.run oolong [options]``.

Every task runs in four modes, interleaved task by task so machine load hits them alike:
{sequential, speculative} tool calls x {plain, speculative} decoding of the root model. The
sub-model behind ``llm_query`` / ``llm_query_batched`` is the simulated deployment
(`benchmarks.oolong.server`, started and stopped here) unless ``--sub-base-url`` or
``--sub native`` says otherwise.

Writes under ``--out`` (default ``benchmarks/results/oolong``): ``tasks.jsonl``, one JSON trace per
task and mode in ``traces/``, ``summary.md`` / ``summary.json`` and ``timeline.png``. ``--resume``
keeps the traces already written and runs only what is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx

from agentrt import Agent
from agentrt.engine.base import Engine, SamplingParams, complete
from agentrt.llm_tools import make_llm_tools

from ..overlap import generation_spans, overlap_limit
from .generate import generate, parse_sizes
from .programs import reference_response, shape_for, shape_of
from .root_prompt import SYSTEM_PROMPT, few_shot, task_message
from .scoring import score
from .server import MODEL_NAME, add_latency_arguments, latency_from_args
from .tasks import Task, TaskFileError, load_tasks, save_tasks

RESULTS = Path(__file__).resolve().parents[1] / "results" / "oolong"
TOOL_MODES = ("sequential", "speculative")
DECODE_MODES = ("plain", "specdec")
MODES = tuple(f"{t}+{d}" for d in DECODE_MODES for t in TOOL_MODES)
BASE_MODE = "sequential+plain"
# Native engine decode speed on agent code, plain and with the suffix drafter (README engine table).
REPLAY_PLAIN_TPS = 34.5
REPLAY_SPEC_TPS = 82.4
DEFAULT_VLLM_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                     "prompt_lookup_min": 2}


class BenchError(Exception):
    """A set-up problem reported to the user (exit status 2)."""


# ------------------------------------------------------------------------------ set-up

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run oolong", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("tasks")
    g.add_argument("--tasks", help="JSONL task file (default: generate tasks)")
    g.add_argument("--sizes", default="4k,16k", help="generated context sizes in tokens")
    g.add_argument("--per-size", type=int, default=2, help="generated tasks per size")
    g.add_argument("--types", help="comma-separated question types to generate")
    g.add_argument("--limit", type=int, help="run only the first N tasks")
    g.add_argument("--seed", type=int, default=0)
    g = p.add_argument_group("root model")
    g.add_argument("--engine", choices=("native", "vllm", "openai", "replay"), default="native")
    g.add_argument("--model", default="smollm2-135m")
    g.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    g.add_argument("--base-url", help="--engine openai: the server's /v1 URL")
    g.add_argument("--spec-config", help="speculative decoding settings (JSON), as for agentrt run")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--max-tokens", type=int, default=450, help="root tokens per turn")
    g.add_argument("--max-turns", type=int, default=3)
    g.add_argument("--replay-plain-tps", type=float, default=REPLAY_PLAIN_TPS)
    g.add_argument("--replay-spec-tps", type=float, default=REPLAY_SPEC_TPS)
    g = p.add_argument_group("sub-model")
    g.add_argument("--sub", choices=("simulated", "native"), default="simulated")
    g.add_argument("--sub-base-url", help="any OpenAI-compatible /v1 URL (overrides --sub)")
    g.add_argument("--sub-model", help="model name at --sub-base-url (default: its first)")
    g.add_argument("--sub-max-tokens", type=int, default=1024)
    g.add_argument("--error-rate", type=float, default=0.0,
                   help="simulated sub-model: share of rows it labels wrongly (seeded)")
    g.add_argument("--tool-concurrency", type=int,
                   help="cap on llm_query calls in flight at once (default: none)")
    add_latency_arguments(g)
    g = p.add_argument_group("output")
    g.add_argument("--modes", default=",".join(MODES), help=f"subset of {', '.join(MODES)}")
    g.add_argument("--out", type=Path, default=RESULTS)
    g.add_argument("--resume", action="store_true", help="keep finished traces in --out")
    g.add_argument("--no-plot", action="store_true")
    return p


def load_or_generate(args) -> list[Task]:
    if args.tasks:
        tasks = load_tasks(args.tasks)
    else:
        kinds = args.types.split(",") if args.types else None
        tasks = generate(parse_sizes(args.sizes), args.per_size, args.seed, kinds)
    return tasks[: args.limit] if args.limit else tasks


def check_url(url: str, timeout: float = 5.0) -> list[str]:
    """The model ids a ``/v1`` server lists; `BenchError` naming the URL when it does not answer."""
    root = url.rstrip("/")
    root = root[:-3] if root.endswith("/v1") else root
    try:
        reply = httpx.get(f"{root}/v1/models", timeout=timeout)
        reply.raise_for_status()
        return [m["id"] for m in reply.json().get("data", [])]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"sub-model unreachable at {url}: {type(exc).__name__}: {exc}") from None


class SimulatedProcess:
    """``python -m benchmarks.oolong.server`` as a child process on a free loopback port."""

    def __init__(self, tasks_file: Path, args) -> None:
        cmd = [sys.executable, "-m", "benchmarks.oolong.server", "--tasks", str(tasks_file),
               "--port", "0", "--error-rate", str(args.error_rate), "--seed", str(args.seed),
               "--sub-prefill-tps", str(args.sub_prefill_tps),
               "--sub-decode-tps", str(args.sub_decode_tps),
               "--sub-slowdown", str(args.sub_slowdown),
               "--sub-max-concurrency", str(args.sub_max_concurrency)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=Path(__file__).resolve().parents[2])
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("listening on "):
            self.close()
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise BenchError(f"the simulated sub-model did not start: {line.strip()} {err.strip()}")
        self.url = line.split()[-1]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class SubModel:
    kind: str
    url: str | None = None
    model: str = MODEL_NAME
    engine: Engine | None = None

    def make_engine(self) -> Engine:
        if self.engine is not None:
            return self.engine
        from agentrt.engine import OpenAIEngine

        return OpenAIEngine(base_url=self.url, model=self.model, server_metrics=False)


def root_engines(args) -> dict[str, Engine | None]:
    """One root engine per decoding mode (None for replay: a fresh one per run)."""
    from agentrt.engines import parse_spec_config

    spec = parse_spec_config(args.spec_config) or {}
    if args.engine == "replay":
        return {"plain": None, "specdec": None}
    if args.engine == "native":
        from agentrt.engine import NativeEngine

        spec = dict(spec)
        method = spec.pop("method", "suffix")
        return {"plain": NativeEngine(model=args.model, dtype=args.dtype, speculation=None, seed=0),
                "specdec": NativeEngine(model=args.model, dtype=args.dtype, speculation=method,
                                        seed=0, **spec)}
    if args.engine == "vllm":
        from agentrt.engine import VLLMEngine

        return {"plain": VLLMEngine(args.model, dtype=args.dtype),
                "specdec": VLLMEngine(args.model, dtype=args.dtype,
                                      speculative_config=spec or DEFAULT_VLLM_SPEC)}
    from agentrt.engine import OpenAIEngine

    if not args.base_url:
        raise BenchError("--engine openai needs --base-url")
    try:
        served = check_url(args.base_url)
    except BenchError:
        served = []  # not every server lists its models; the warm-up request will tell
    model = args.model if args.model != "smollm2-135m" or not served else served[0]
    # The server decides its own decoding: both decoding modes use it as served.
    engine = OpenAIEngine(base_url=args.base_url, model=model)
    return {"plain": engine, "specdec": engine}


# ------------------------------------------------------------------------------ one run

def _gen_seconds(trace) -> float:
    return sum(end - start for start, end in generation_spans(trace).values())


def _metrics(engine) -> Any:
    return engine.metrics() if engine is not None and hasattr(engine, "metrics") else None


async def run_one(task: Task, index: int, mode: str, engine: Engine | None, sub: SubModel,
                  args) -> dict[str, Any]:
    tools_mode, decode_mode = mode.split("+")
    shape = shape_for(index)
    if engine is None:  # replay
        from agentrt.engine import ReplayEngine

        tps = args.replay_plain_tps if decode_mode == "plain" else args.replay_spec_tps
        engine = ReplayEngine([reference_response(task, shape)], tokens_per_second=tps)
        examples: list = []
    else:
        examples = few_shot(task, shape)
    sub_engine = sub.make_engine()
    tools = make_llm_tools(sub_engine, SamplingParams(max_tokens=args.sub_max_tokens),
                           max_concurrency=args.tool_concurrency)
    agent = Agent(engine, tools=tools, builtin_tools=False,
                  speculation=tools_mode == "speculative", max_turns=args.max_turns,
                  system_prompt=SYSTEM_PROMPT, examples=examples,
                  sampling=SamplingParams(max_tokens=args.max_tokens,
                                          temperature=args.temperature, seed=args.seed))
    before = _metrics(engine)
    try:
        result = await agent.run(task_message(task.question), task.context)
    finally:
        if sub.engine is None:
            await sub_engine.aclose()
    after = _metrics(engine)
    tau, tokens, gen_s = None, 0, 0.0
    if before is not None and after is not None:
        # the engine's own count: tokens it generated and the time it spent generating them
        steps = after.verify_steps - before.verify_steps
        accepted = after.accepted_tokens - before.accepted_tokens
        tau = (accepted + steps) / steps if steps else None
        tokens = after.generated_tokens - before.generated_tokens
        gen_s = after.wall_s - before.wall_s
    if tokens <= 0 or gen_s <= 0:  # no engine counters (or a generation cut short by FINAL)
        from agentrt.engine.replay import split_tokens

        tokens = sum(len(split_tokens(t.response)) for t in result.turns)
        gen_s = _gen_seconds(result.trace)
    answer = "" if result.answer is None else str(result.answer)
    code = "\n".join(t.code for t in result.turns)
    return {
        "task": task.id, "type": task.task, "context_tokens": task.context_tokens, "mode": mode,
        "answer": answer, "gold": task.answer, "answer_type": task.answer_type,
        "score": score(answer, task.answer, task.answer_type) if result.answer is not None else 0.0,
        "status": result.status, "error": result.error, "wall_s": result.wall_s,
        "code_ok": bool(result.turns) and all(b.error is None for t in result.turns for b in t.blocks)
                   and any(t.blocks for t in result.turns),
        "shape": shape_of(code), "tau": tau, "tokens": tokens,
        "tok_s": tokens / gen_s if gen_s > 0 else None,
        "stats": result.stats.to_dict(),
        "turns": [{"response": t.response, "output": t.output, "error": t.error}
                  for t in result.turns],
        "trace": result.trace.to_dict(),
    }


def trace_path(out: Path, task: Task, mode: str) -> Path:
    return out / "traces" / f"{task.id}__{mode}.json"


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, default=repr))
    tmp.replace(path)


def read_trace(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


# ------------------------------------------------------------------------------ summary

def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]


def _as_trace(record: dict):
    from agentrt.trace import Event, Trace

    trace = Trace()
    trace.events = [Event(**e) for e in record["trace"]["events"]]
    return trace


def size_bucket(task: Task) -> int:
    """The context size rounded to a power of two (4105 tokens -> 4096)."""
    return 2 ** round(math.log2(max(1, task.context_tokens)))


def first_difference(records: dict[str, dict]) -> int | None:
    """Index of the first turn whose response, output or error differs between modes."""
    turns = [r["turns"] for r in records.values()]
    for i in range(max(len(t) for t in turns)):
        seen = {json.dumps(t[i] if i < len(t) else None, sort_keys=True) for t in turns}
        if len(seen) > 1:
            return i
    return None


def summarise(tasks: list[Task], records: dict[tuple[str, str], dict], modes: list[str]) -> dict:
    rows: dict[str, dict] = {}
    for mode in modes:
        recs = [records[(t.id, mode)] for t in tasks if (t.id, mode) in records]
        if not recs:
            continue
        walls = [r["wall_s"] for r in recs]
        speedups, limits, effs = [], [], []
        for t in tasks:
            r, base = records.get((t.id, mode)), records.get((t.id, BASE_MODE))
            if r and base:
                speedups.append(base["wall_s"] / r["wall_s"])
            seq = records.get((t.id, mode.replace("speculative+", "sequential+")))
            if r and seq and mode.startswith("speculative+"):
                limit = overlap_limit(_as_trace(r), _as_trace(seq))
                limits.append(limit)
                effs.append(limit / r["wall_s"])
        taus = [r["tau"] for r in recs if r["tau"]]
        toks = [r["tok_s"] for r in recs if r["tok_s"]]
        rows[mode] = {
            "n": len(recs), "median_s": statistics.median(walls), "p90_s": _p90(walls),
            "speedup": statistics.median(speedups) if speedups else None,
            "limit_s": statistics.median(limits) if limits else None,
            "efficiency": statistics.median(effs) if effs else None,
            "score": statistics.mean(r["score"] for r in recs),
            "hits": sum(r["stats"]["hits"] for r in recs),
            "wasted": sum(r["stats"]["wasted"] for r in recs),
            "tau": statistics.mean(taus) if taus else None,
            "tok_s": statistics.median(toks) if toks else None,
            "code_ok": sum(r["code_ok"] for r in recs) / len(recs),
            "scored": sum(r["score"] > 0 for r in recs) / len(recs),
        }
    sizes: dict[str, dict[str, float]] = {}
    for size in sorted({size_bucket(t) for t in tasks}):
        in_size = [t for t in tasks if size_bucket(t) == size]
        for mode in modes:
            ratios = [records[(t.id, BASE_MODE)]["wall_s"] / records[(t.id, mode)]["wall_s"]
                      for t in in_size if (t.id, mode) in records and (t.id, BASE_MODE) in records]
            if ratios:
                sizes.setdefault(size, {})[mode] = statistics.median(ratios)
    identical, differing = 0, []
    complete_tasks = [t for t in tasks if all((t.id, m) in records for m in modes)]
    for t in complete_tasks:
        recs = {m: records[(t.id, m)] for m in modes}
        if len({r["answer"] for r in recs.values()}) == 1:
            identical += 1
        else:
            differing.append({"task": t.id, "first_differing_turn": first_difference(recs),
                              "answers": {m: r["answer"] for m, r in recs.items()}})
    shapes = Counter(records[(t.id, m)]["shape"] for t in tasks for m in modes
                     if (t.id, m) in records)
    return {"modes": rows, "sizes": sizes, "identical": identical,
            "compared": len(complete_tasks), "differing": differing, "shapes": dict(shapes)}


def _f(value, fmt: str, none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def markdown(summary: dict, setting: str) -> str:
    lines = [setting, "",
             "| mode | median s | p90 s | speedup | limit s | efficiency | score | score > 0 | "
             "code ran | hits | wasted | tau | tok/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mode, r in summary["modes"].items():
        lines.append(
            f"| {mode} | {r['median_s']:.2f} | {r['p90_s']:.2f} | {_f(r['speedup'], '.2f')}x | "
            f"{_f(r['limit_s'], '.2f')} | {_f(r['efficiency'], '.2f')} | {r['score']:.2f} | "
            f"{r['scored']:.0%} | {r['code_ok']:.0%} | {r['hits']} | {r['wasted']} | {_f(r['tau'], '.2f')} | "
            f"{_f(r['tok_s'], '.1f')} |")
    modes = list(summary["modes"])
    lines += ["", "Median speedup over sequential+plain by context size:", "",
              "| context tokens | " + " | ".join(modes) + " |",
              "|---|" + "---|" * len(modes)]
    for size, by_mode in summary["sizes"].items():
        lines.append(f"| {size // 1024}K | " + " | ".join(_f(by_mode.get(m), ".2f") + "x" for m in modes)
                     + " |")
    n = summary["compared"]
    share = summary["identical"] / n if n else 0.0
    lines += ["", f"Identical answers across the modes: {summary['identical']}/{n} ({share:.0%})."]
    for d in summary["differing"]:
        lines.append(f"- {d['task']}: first differing turn {d['first_differing_turn']}; "
                     f"answers {d['answers']}")
    lines += ["", "Call shapes in the root's code: "
              + ", ".join(f"{k} {v}" for k, v in sorted(summary["shapes"].items()))]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ timeline

def _spans(record: dict) -> list[tuple[str, float, float, str]]:
    events = record["trace"]["events"]
    spans: list[tuple[str, float, float, str]] = []
    start, last = {}, {}
    for e in events:
        if e["kind"] == "turn_started":
            start[e["data"]["turn"]] = e["t"]
        elif e["kind"] == "delta":
            last[e["data"]["turn"]] = e["t"]
    for turn, t0 in start.items():
        spans.append((f"root tokens t{turn}", t0, last.get(turn, t0), "tab:gray"))
    open_: dict[tuple, float] = {}
    for e in events:
        d = e["data"]
        if e["kind"] == "tool_started":
            open_[(d.get("mode"), d.get("call_id"))] = e["t"]
        elif e["kind"] == "tool_finished" and (d.get("mode"), d.get("call_id")) in open_:
            color = "tab:orange" if d.get("mode") == "early" else "tab:blue"
            spans.append((d["tool"], open_.pop((d.get("mode"), d.get("call_id"))), e["t"], color))
        elif e["kind"] == "exec_started":
            open_[("exec", d["turn"], d["block"])] = e["t"]
        elif e["kind"] == "exec_finished":
            t0 = open_.pop(("exec", d["turn"], d["block"]), e["t"])
            spans.append((f"block t{d['turn']}b{d['block']}", t0, e["t"], "tab:green"))
    return spans


def plot_timeline(records: dict[str, dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(records), 1, figsize=(10, 1.6 + 1.5 * len(records)), sharex=True)
    axes = list(axes) if len(records) > 1 else [axes]
    for ax, (mode, record) in zip(axes, records.items()):
        spans = _spans(record)
        for i, (_, t0, t1, color) in enumerate(spans):
            ax.barh(i, max(t1 - t0, 0.02), left=t0, color=color, height=0.7)
        ax.set_yticks(range(len(spans)), [s[0] for s in spans], fontsize=5)
        ax.invert_yaxis()
        ax.set_title(f"{mode}: {record['wall_s']:.1f} s, answer {record['answer'][:40]!r}",
                     fontsize=8)
    axes[-1].set_xlabel("seconds since the run started")
    axes[0].legend(handles=[Patch(color=c, label=l) for c, l in (
        ("tab:gray", "root tokens"), ("tab:blue", "sub-model call (at its statement)"),
        ("tab:orange", "early sub-model call"), ("tab:green", "block execution"))],
        fontsize=6, loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------ main

async def _warm_up(engines: dict[str, Engine | None]) -> None:
    from agentrt.engine.base import EngineError

    for engine in {id(e): e for e in engines.values() if e is not None}.values():
        try:
            await complete(engine, [{"role": "user", "content": "Hi"}],
                           SamplingParams(max_tokens=2))
        except EngineError as exc:
            where = getattr(engine, "server_url", engine.name)
            raise BenchError(f"the root model at {where} does not answer: {exc}") from None


async def _prefill(task: Task, index: int, engines: dict[str, Engine | None],
                   signatures: str) -> None:
    """Prefill the task's first prompt once on each root engine before its timed runs.

    The native engine keeps a prefix cache: without this, the first mode of every task would pay
    the prompt's prefill and the later modes would not.
    """
    if all(e is None for e in engines.values()):
        return
    from agentrt import prompts

    messages = [{"role": "system",
                 "content": prompts.system_prompt(signatures, task.context, SYSTEM_PROMPT)},
                *few_shot(task, shape_for(index)),
                {"role": "user", "content": task_message(task.question)}]
    for engine in {id(e): e for e in engines.values() if e is not None}.values():
        await complete(engine, messages, SamplingParams(max_tokens=1))


async def run_all(tasks, modes, engines, sub, args, records) -> None:
    from tqdm import tqdm

    await _warm_up(engines)
    todo = [(i, t, m) for i, t in enumerate(tasks) for m in modes if (t.id, m) not in records]
    bar = tqdm(total=len(tasks) * len(modes), initial=len(tasks) * len(modes) - len(todo),
               desc="oolong runs", unit="run", file=sys.stderr)
    from agentrt.tools import ToolRegistry

    probe = sub.make_engine()
    signatures = ToolRegistry(make_llm_tools(probe)).render_signatures()
    if sub.engine is None:
        await probe.aclose()
    warmed: set[str] = set()
    for index, task, mode in todo:
        if task.id not in warmed:
            await _prefill(task, index, engines, signatures)
            warmed.add(task.id)
        record = await run_one(task, index, mode, engines[mode.split("+")[1]], sub, args)
        write_json(trace_path(args.out, task, mode), record)
        records[(task.id, mode)] = record
        bar.set_postfix_str(f"{task.id[:28]} {mode} {record['wall_s']:.1f}s "
                            f"score {record['score']:.2f}")
        bar.update()
    bar.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    started = time.monotonic()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        bad = [m for m in modes if m not in MODES]
        if bad or not modes:
            raise BenchError(f"unknown mode(s) {bad}; choose from {', '.join(MODES)}")
        if args.tool_concurrency is not None and args.tool_concurrency < 1:
            raise BenchError("--tool-concurrency must be >= 1")
        tasks = load_or_generate(args)
        latency_from_args(args)
        from agentrt.engines import parse_spec_config

        parse_spec_config(args.spec_config)
    except (TaskFileError, ValueError, BenchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "traces").mkdir(exist_ok=True)
    tasks_file = save_tasks(tasks, args.out / "tasks.jsonl")
    records: dict[tuple[str, str], dict] = {}
    for t in tasks:
        for m in modes:
            path = trace_path(args.out, t, m)
            if args.resume and (record := read_trace(path)) is not None:
                records[(t.id, m)] = record
            elif path.exists():
                path.unlink()
    server: SimulatedProcess | None = None
    engines: dict[str, Engine | None] = {}
    try:
        if args.sub_base_url:
            served = check_url(args.sub_base_url)
            sub = SubModel("url", args.sub_base_url,
                           args.sub_model or (served[0] if served else "default"))
        elif args.sub == "native":
            from agentrt.engine import NativeEngine

            sub = SubModel("native", engine=NativeEngine(model=args.model, dtype=args.dtype,
                                                         speculation=None, seed=0))
        else:
            server = SimulatedProcess(tasks_file, args)
            check_url(server.url)
            sub = SubModel("simulated", server.url)
        engines = root_engines(args)
        anyio.run(run_all, tasks, modes, engines, sub, args, records)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted: {len(records)} finished traces kept in {args.out / 'traces'}; "
              "rerun with --resume", file=sys.stderr)
        return 130
    finally:
        if server is not None:
            server.close()
        for engine in {id(e): e for e in engines.values() if e is not None}.values():
            close = getattr(engine, "close", None)
            if close is not None:
                close()
    summary = summarise(tasks, records, modes)
    sizes = sorted({size_bucket(t) // 1024 for t in tasks})
    setting = (f"{len(tasks)} tasks ({', '.join(f'{s}K' for s in sizes)} context tokens), root `{args.engine}` ({args.model}, temperature "
               f"{args.temperature:g}), sub-model {sub.kind}"
               + (f" (error rate {args.error_rate:g})" if sub.kind == "simulated" else "")
               + f", seed {args.seed}.")
    table = markdown(summary, setting)
    (args.out / "summary.md").write_text(table + "\n")
    write_json(args.out / "summary.json", {"setting": setting, "args": vars(args) | {
        "out": str(args.out)}, **summary})
    complete_tasks = [t for t in tasks if all((t.id, m) in records for m in modes)]
    if not args.no_plot and complete_tasks and importlib.util.find_spec("matplotlib") is None:
        print("timeline skipped: matplotlib is not installed (pip install 'agentrt[bench]')")
    elif not args.no_plot and complete_tasks:
        # the largest task every mode answered (else the largest task)
        answered = [t for t in complete_tasks
                    if all(records[(t.id, m)]["status"] == "final" for m in modes)]
        chosen = max(answered or complete_tasks, key=lambda t: t.context_tokens)
        plot_timeline({m: records[(chosen.id, m)] for m in modes},
                      f"{chosen.id} ({chosen.context_tokens} tokens)", args.out / "timeline.png")
    print("\n" + table)
    print(f"\nwrote {args.out} in {time.monotonic() - started:.0f}s")
    return 0
