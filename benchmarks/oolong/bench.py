"""OOLONG-style end-to-end benchmark: ``python -m benchmarks.run oolong [options]``.

Every task runs in every mode, ``--repeats`` times: {sequential, speculative} tool calls x
{plain, speculative} decoding of the root (replay roots: tool modes only, at each
``--root-tps``). The sub-model behind ``llm_query`` / ``llm_query_batched`` is the simulated
deployment (`benchmarks.oolong.server`, started and stopped here) unless ``--sub-base-url``,
``--sub native`` or ``--sub forced`` (the same answers, teacher-forced through the root's native
engine: `benchmarks.oolong.forced_sub`) says otherwise. The root is ``--engine forced`` by
default: reference RLM-style trajectories streamed through the native engine by teacher forcing
(real forwards, real tau).

Honest measurement (docs/oolong.md): mode order rotates per task and repeat; every run starts
from reset engine state; failed runs (error, no FINAL, turn limit) are counted and never enter a
speedup or an identity; speedups are medians of per-task ratios with a bootstrap 95% CI; the
runner exits 1 when no speedup could be measured.

Writes under ``--out`` (default ``benchmarks/results/oolong``): ``tasks.jsonl``, one JSON record
per run in ``traces/<setting>/``, ``summary.md`` / ``summary.json`` and plots. ``--resume`` keeps
the records already written and runs only what is missing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

from agentrt.engine.base import Engine, SamplingParams, complete
from agentrt.llm_tools import make_llm_tools
from agentrt.trace import Trace, save_chrome_trace

from .generate import generate, parse_sizes
from .root_prompt import LeakError, check_no_leak, few_shot
from .runs import (LOCAL_MODE, PEER_MODE, ROOT_KINDS, SCRIPTED, Root, Setting, SubModel,
                   isolate, run_one)
from .server import add_latency_arguments, check_simulatable, latency_cli_args, latency_from_args
from .summary import any_speedup, markdown, size_label, summarise
from .tasks import Task, TaskFileError, load_tasks, save_tasks
from .trajectories import STYLES, trajectory

RESULTS = Path(__file__).resolve().parents[1] / "results" / "oolong"
TOOL_MODES = ("sequential", "speculative")
DECODE_MODES = ("plain", "specdec")
LIVE_FEW_SHOT = {"native": 2, "vllm": 0, "openai": 0}
DEFAULT_VLLM_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                     "prompt_lookup_min": 2}
FORCED_SUB_ENGINE = {"max_seq_len": 8192, "kv_cache_bytes": 2 * 2**30}
"""Root engine settings with ``--sub forced``: room for a sub-call prompt of a 64K task (~5K
tokens, within SmolLM2's 8,192 positions) and KV blocks for ~90K tokens, so a batch of fat
prompts fits at once."""
FORCED_SUB_CELL_WALL_S = 1800.0
"""A cell's wall-clock limit with ``--sub forced``: a batch of fat prompts prefilled and answered
on a CPU takes minutes (a 16K task's batch ~2 min on 2 cores), past the REPL's default 120 s."""


class BenchError(Exception):
    """A set-up problem reported to the user (exit status 2)."""


def all_modes(engine: str, harness: str = "agentrt", peer: bool = False) -> tuple[str, ...]:
    """Every mode of a run, the base mode (the one speedups are taken over) first."""
    decodes = ("replay",) if engine == "replay" else DECODE_MODES
    tools = (LOCAL_MODE, *TOOL_MODES) if harness == "rlm" else TOOL_MODES
    modes = tuple(f"{t}+{d}" for d in decodes for t in tools)
    return modes + ((f"{PEER_MODE}+replay",) if peer else ())


# ------------------------------------------------------------------------------ set-up

def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"not a comma-separated list of numbers: {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"need positive numbers, got {text!r}")
    return values


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
    g.add_argument("--styles", default="batched,loop,small",
                   help=f"reference trajectory styles, taken in turn over the tasks "
                        f"({', '.join(STYLES)}); live roots: the few-shot examples use the "
                        "other call shape")
    g = p.add_argument_group("root model")
    g.add_argument("--engine", choices=ROOT_KINDS, default="forced",
                   help="forced: trajectories through the native engine (default); replay: "
                        "trajectories at --root-tps; native/vllm/openai: a live model")
    g.add_argument("--model", default="smollm2-135m")
    g.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    g.add_argument("--base-url", help="--engine openai: the server's /v1 URL")
    g.add_argument("--drafter-config", help="drafter settings (JSON), as for agentrt run")
    g.add_argument("--spec-config", dest="drafter_config", help=argparse.SUPPRESS)  # former name
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--max-tokens", type=int, default=700, help="root tokens per turn")
    g.add_argument("--max-turns", type=int, default=6)
    g.add_argument("--few-shot", type=int,
                   help="live roots: worked examples of other question types in the prompt "
                        "(default 2 for native, 0 for vllm/openai)")
    g.add_argument("--root-tps", default="160",
                   help="replay root: comma-separated token rates, one setting each")
    g.add_argument("--harness", choices=("agentrt", "rlm"), default="agentrt",
                   help="rlm: the stock RLM library (rlms) drives the root, with agentrt's REPL "
                        "(sequential / speculative) or its own (local, the base mode); needs "
                        "an HTTP root: --engine replay or openai")
    g.add_argument("--peer", action="store_true",
                   help="replay roots: also run the peer (spec-ptc, its virtualenv built by "
                        ".ci/peer-venv.sh) on the same trajectories, pace and sub-model")
    g = p.add_argument_group("sub-model")
    g.add_argument("--sub", choices=("simulated", "native", "forced"), default="simulated",
                   help="simulated: the simulated deployment (default); native: SmolLM2 "
                        "generating freely; forced: the simulated answers teacher-forced through "
                        "the root's native engine (roots forced and native)")
    g.add_argument("--sub-base-url", help="any OpenAI-compatible /v1 URL (overrides --sub)")
    g.add_argument("--sub-model", help="model name at --sub-base-url (default: its first)")
    g.add_argument("--sub-max-tokens", type=int, default=8192)
    g.add_argument("--error-rate", type=float, default=0.0,
                   help="simulated sub-model: share of rows it labels wrongly (seeded)")
    g.add_argument("--cell-wall-s", type=float,
                   help="wall-clock limit of one REPL cell, its tool calls included (default "
                        f"{FORCED_SUB_CELL_WALL_S:g} s with --sub forced, whose sub-calls run on "
                        "this CPU; else the REPL's own, 120 s)")
    g.add_argument("--tool-concurrency", type=int,
                   help="cap on llm_query calls in flight at once per run (default: none)")
    add_latency_arguments(g)
    g = p.add_argument_group("runs and output")
    g.add_argument("--modes", help="subset of the modes (default: all for the root kind)")
    g.add_argument("--repeats", type=int, default=3, help="runs per task and mode")
    g.add_argument("--concurrent-tasks", default="1",
                   help="comma-separated levels: tasks run at once on one sub-model")
    g.add_argument("--out", type=Path, default=RESULTS)
    g.add_argument("--resume", action="store_true", help="keep finished records in --out")
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
        import subprocess

        cmd = [sys.executable, "-m", "benchmarks.oolong.server", "--tasks", str(tasks_file),
               "--port", "0", "--error-rate", str(args.error_rate), "--seed", str(args.seed),
               *latency_cli_args(args)]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=Path(__file__).resolve().parents[2])
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line.startswith("listening on "):
            self.close()
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise BenchError(f"the simulated sub-model did not start: {line.strip()} {err.strip()}")
        self.url = line.split()[-1]

    def close(self) -> None:
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def build_root(args, tasks: list[Task], styles: dict[str, str]) -> Root:
    """The root engines (and few-shot turns) for ``args.engine``."""
    from agentrt.engine_options import parse_drafter_config

    spec = dict(parse_drafter_config(args.drafter_config) or {})
    kind = args.engine
    root = Root(kind)
    if args.peer:
        from ..peer import PeerDriver, PeerUnavailable, peer_python

        try:
            root.peer = PeerDriver(peer_python())
        except PeerUnavailable as exc:
            raise BenchError(str(exc)) from None
    if kind in ("native", "vllm", "openai"):
        count = LIVE_FEW_SHOT[kind] if args.few_shot is None else args.few_shot
        root.few_shot = {t.id: few_shot(t, styles[t.id], count) for t in tasks} if count else {}
        check_no_leak(tasks, root.few_shot)
    if kind == "replay":
        root.engines = {"replay": None}
    elif kind in ("forced", "native"):
        from agentrt.engine import NativeEngine

        method = spec.pop("method", "suffix")
        extra = FORCED_SUB_ENGINE if args.sub == "forced" and not args.sub_base_url else {}
        root.engines = {
            "plain": NativeEngine(model=args.model, dtype=args.dtype, drafter=None, seed=0,
                                  **extra),
            "specdec": NativeEngine(model=args.model, dtype=args.dtype, drafter=method,
                                    seed=0, **{**spec, **extra})}
    elif kind == "vllm":
        from agentrt.engine import VLLMEngine

        root.engines = {"plain": VLLMEngine(args.model, dtype=args.dtype),
                        "specdec": VLLMEngine(args.model, dtype=args.dtype,
                                              speculative_config=spec or DEFAULT_VLLM_SPEC)}
    else:
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
        root.served_model = model
        root.engines = {"plain": engine, "specdec": engine}
    return root


# ------------------------------------------------------------------------------ records

def record_path(out: Path, setting: Setting, task: Task, mode: str, repeat: int) -> Path:
    return out / "traces" / setting.tag / f"{task.id}__{mode}__r{repeat}.json"


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, default=repr))
    tmp.replace(path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


# ------------------------------------------------------------------------------ the runs

def waves(tasks: list[Task], size: int) -> list[list[Task]]:
    """Groups of ``size`` tasks run at once (the last one may be smaller)."""
    return [tasks[i:i + size] for i in range(0, len(tasks), size)]


def rotated(modes: list[str], by: int) -> list[str]:
    """``modes`` in another order per task and repeat, so no mode always runs first."""
    k = by % len(modes)
    return modes[k:] + modes[:k]


async def _warm_up(root: Root) -> None:
    from agentrt.engine.base import EngineError

    for engine in {id(e): e for e in root.engines.values() if e is not None}.values():
        try:
            await complete(engine, [{"role": "user", "content": "Hi"}],
                           SamplingParams(max_tokens=2))
        except EngineError as exc:
            where = getattr(engine, "server_url", engine.name)
            raise BenchError(f"the root model at {where} does not answer: {exc}") from None


async def run_all(plan, root: Root, sub: SubModel, args, records: dict) -> None:
    """Every (setting, wave, repeat, mode) not in ``records`` yet, writing each record as soon
    as its run ends."""
    from tqdm import tqdm

    settings, tasks, styles, modes = plan
    await _warm_up(root)
    probe = sub.make_engine()
    from agentrt.tools import ToolRegistry

    signatures = ToolRegistry(make_llm_tools(probe)).render_signatures()
    if sub.engine is None:
        await probe.aclose()
    total = len(settings) * len(tasks) * len(modes) * args.repeats
    bar = tqdm(total=total, initial=len(records), desc="oolong runs", unit="run",
               file=sys.stderr)
    for setting in settings:
        for w, wave in enumerate(waves(tasks, setting.concurrency)):
            for repeat in range(args.repeats):
                for mode in rotated(modes, w + repeat):
                    todo = [t for t in wave if (setting.tag, t.id, mode, repeat) not in records]
                    if not todo:
                        continue
                    if args.harness == "agentrt":
                        await isolate(root, mode.split("+")[1], todo, signatures)

                    async def one(task: Task, mode=mode, repeat=repeat, setting=setting) -> None:
                        record = await run_one(task, styles[task.id], mode, repeat, setting,
                                               root, sub, args)
                        path = record_path(args.out, setting, task, mode, repeat)
                        write_json(path, record)
                        if record["trace"]["events"]:  # Perfetto / chrome://tracing
                            save_chrome_trace(Trace.from_dict(record["trace"]),
                                              path.with_name(path.stem + ".perfetto.json"),
                                              name=f"{task.id} {mode} r{repeat}")
                        records[(setting.tag, task.id, mode, repeat)] = record
                        bar.set_postfix_str(f"{task.id[:24]} {mode} {record['wall_s']:.1f}s "
                                            f"{record['status']}")
                        bar.update()

                    async with anyio.create_task_group() as tg:
                        for task in todo:
                            tg.start_soon(one, task)
    bar.close()


# ------------------------------------------------------------------------------ main

def _plan(args) -> tuple[list[Setting], list[Task], dict[str, str], list[str]]:
    if args.harness == "rlm" and args.engine not in ("replay", "openai"):
        raise BenchError("--harness rlm needs an HTTP root: --engine replay or --engine openai")
    if args.peer and args.engine != "replay":
        raise BenchError("--peer runs the peer on replayed trajectories: use --engine replay")
    modes_all = all_modes(args.engine, args.harness, args.peer)
    modes = ([m.strip() for m in args.modes.split(",") if m.strip()] if args.modes
             else list(modes_all))
    bad = [m for m in modes if m not in modes_all]
    if bad or not modes:
        raise BenchError(f"unknown mode(s) {bad} for --engine {args.engine}; choose from "
                         f"{', '.join(modes_all)}")
    if modes_all[0] not in modes:
        raise BenchError(f"--modes must include {modes_all[0]}, the mode speedups are taken over")
    modes = [m for m in modes_all if m in modes]  # the base first, in a fixed order
    if args.repeats < 1:
        raise BenchError("--repeats must be >= 1")
    if args.cell_wall_s is not None and not args.cell_wall_s > 0:
        raise BenchError("--cell-wall-s must be > 0")
    if args.tool_concurrency is not None and args.tool_concurrency < 1:
        raise BenchError("--tool-concurrency must be >= 1")
    levels = [int(x) for x in _floats(args.concurrent_tasks)]
    tps = _floats(args.root_tps) if args.engine == "replay" else [None]
    styles_list = [s.strip() for s in args.styles.split(",") if s.strip()]
    unknown = [s for s in styles_list if s not in STYLES]
    if unknown or not styles_list:
        raise BenchError(f"unknown style(s) {unknown}; choose from {', '.join(STYLES)}")
    tasks = load_or_generate(args)
    styles = {t.id: styles_list[i % len(styles_list)] for i, t in enumerate(tasks)}
    if args.engine in SCRIPTED:
        for t in tasks:  # fails early, naming the task and the known question kinds
            try:
                trajectory(t, styles[t.id])
            except ValueError as exc:
                raise BenchError(f"task {t.id}: {exc}") from None
    settings = [Setting(c, r) for c in levels for r in tps]
    return settings, tasks, styles, modes


def _sub_model(args, tasks: list[Task], tasks_file: Path):
    if args.sub_base_url:
        served = check_url(args.sub_base_url)
        return SubModel("url", args.sub_base_url,
                        args.sub_model or (served[0] if served else "default")), None
    if args.sub == "native":
        from agentrt.engine import NativeEngine

        return SubModel("native", engine=NativeEngine(model=args.model, dtype=args.dtype,
                                                      drafter=None, seed=0)), None
    check_simulatable(tasks)
    if args.sub == "forced":
        if not 0.0 <= args.error_rate <= 1.0:
            raise BenchError("--error-rate must be within [0, 1]")
        if args.engine not in ("forced", "native") or args.harness != "agentrt":
            raise BenchError("--sub forced shares the root's native engine: use --engine forced "
                             "or native, with agentrt's own harness")
        from .server import Oracle

        return SubModel("forced", oracle=Oracle.from_tasks(tasks, args.error_rate,
                                                           args.seed)), None
    server = SimulatedProcess(tasks_file, args)
    check_url(server.url)
    return SubModel("simulated", server.url), server


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cell_wall_s is None and args.sub == "forced" and not args.sub_base_url:
        args.cell_wall_s = FORCED_SUB_CELL_WALL_S
    started = time.monotonic()
    try:
        latency_from_args(args)
        from agentrt.engine_options import parse_drafter_config

        parse_drafter_config(args.drafter_config)
        settings, tasks, styles, modes = _plan(args)
    except (TaskFileError, ValueError, BenchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    tasks_file = save_tasks(tasks, args.out / "tasks.jsonl")
    records: dict[tuple, dict] = {}
    for s in settings:
        for t in tasks:
            for m in modes:
                for r in range(args.repeats):
                    path = record_path(args.out, s, t, m, r)
                    if args.resume and (record := read_json(path)) is not None:
                        records[(s.tag, t.id, m, r)] = record
                    elif path.exists():
                        path.unlink()
    server = None
    root = Root(args.engine)
    try:
        sub, server = _sub_model(args, tasks, tasks_file)
        root = build_root(args, tasks, styles)
        anyio.run(run_all, (settings, tasks, styles, modes), root, sub, args, records)
    except (BenchError, LeakError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted: {len(records)} finished records kept in {args.out / 'traces'}; "
              "rerun with --resume", file=sys.stderr)
        return 130
    finally:
        if server is not None:
            server.close()
        for engine in {id(e): e for e in root.engines.values() if e is not None}.values():
            close = getattr(engine, "close", None)
            if close is not None:
                close()
        if root.peer is not None:
            root.peer.close()
    report = write_report(args, settings, tasks, modes, root, sub, records)
    print("\n" + report)
    print(f"\nwrote {args.out} in {time.monotonic() - started:.0f}s")
    measured = [s for s in report_summaries(settings, tasks, modes, records, args.harness)
                if any_speedup(s[1])]
    if not measured:
        print("error: no speedup could be measured (no task succeeded in the base mode and "
              "another mode)", file=sys.stderr)
        return 1
    return 0


def report_summaries(settings, tasks, modes, records, harness: str = "agentrt"
                     ) -> list[tuple[Setting, dict]]:
    from ..overlap import overlap_limit
    from .plots import as_trace

    def limit(spec, seq):  # the overlap model reads agentrt's own loop's traces
        return overlap_limit(as_trace(spec), as_trace(seq))

    out = []
    for s in settings:
        recs = [r for (tag, *_), r in records.items() if tag == s.tag]
        summary = summarise(recs, modes, modes[0], limit=limit if harness == "agentrt" else None)
        out.append((s, summary))
    return out


def write_report(args, settings, tasks, modes, root: Root, sub: SubModel, records) -> str:
    from .plots import plot_root_speed, plot_timeline

    summaries = report_summaries(settings, tasks, modes, records, args.harness)
    few = {len(v) // 2 for v in root.few_shot.values()} or {0}
    root_desc = {"forced": "reference trajectories through the native engine by teacher forcing",
                 "replay": "reference trajectories streamed at a fixed rate"}.get(
        args.engine, f"live model `{args.model}`")
    sizes = sorted({size_label(t.context_tokens) for t in tasks}, key=lambda x: float(x[:-1]))
    head = (f"{len(tasks)} tasks ({', '.join(sizes)} context tokens), root `{args.engine}` ({root_desc}; temperature "
            f"{args.temperature:g}), few-shot {max(few)}, sub-model {sub.kind}"
            + (" (the simulated answers teacher-forced through the root's native engine)"
               if sub.kind == "forced" else "")
            + (f" (error rate {args.error_rate:g})" if sub.kind in ("simulated", "forced")
               else "")
            + f", {args.repeats} repeats, seed {args.seed}. Isolation: {root.isolation()}.")
    parts = [head]
    for s, summary in summaries:
        parts.append(markdown(summary, f"### {s.label}"))
    if len(summaries) > 1:
        parts.append(_settings_table(summaries, modes))
    text = "\n\n".join(parts)
    (args.out / "summary.md").write_text(text + "\n")
    write_json(args.out / "summary.json", {
        "setting": head, "args": vars(args) | {"out": str(args.out)},
        "few_shot": max(few), "isolation": root.isolation(),
        "settings": [{"concurrency": s.concurrency, "root_tps": s.root_tps, "tag": s.tag,
                      **summary} for s, summary in summaries]})
    if not args.no_plot:
        if importlib.util.find_spec("matplotlib") is None:
            print("plots skipped: matplotlib is not installed (pip install 'agentrt[bench]')")
        else:
            plot_timeline(args.out, settings[0], tasks, modes, records)
            if args.engine == "replay" and len(settings) > 1:
                plot_root_speed(args.out / "root_speed.png", summaries, modes)
    return text


def _settings_table(summaries, modes) -> str:
    lines = ["### By setting (median per-task speedup over " + modes[0] + ", 95% CI)", "",
             "| setting | " + " | ".join(modes[1:]) + " |", "|---|" + "---|" * (len(modes) - 1)]
    for s, summary in summaries:
        cells = []
        for m in modes[1:]:
            row = summary["modes"].get(m)
            if row is None or row["speedup"] is None:
                cells.append("-")
            else:
                ci = row["ci"]
                cells.append(f"{row['speedup']:.2f}x" + (f" ({ci[0]:.2f}-{ci[1]:.2f})" if ci else "")
                             + f", failed {row['failed']}/{row['runs']}")
        lines.append(f"| {s.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
