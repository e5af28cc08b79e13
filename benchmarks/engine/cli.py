"""Engine benchmark: HF ``generate``, the native engine, vLLM, llama.cpp and OpenAI-compatible
servers, side by side on the same prompts. Greedy decoding throughout.

    python -m benchmarks.run engine [--engine native|vllm|openai] [--dtype bf16]
                                    [--max-tokens 128] [--limit 4] [--sets chat,copy_heavy]
                                    [--systems hf,hf-lookup,plain,ngram,suffix,draft,vllm,...]
                                    [--repeats 1] [--anchor-tolerance 0.1] [--threads 2]
                                    [--drafter-config JSON] [--base-url URL] [--served-model NAME]

Each system runs alone, in a process of its own (`run_isolated`): the same prompts, the same
``--threads``, one warm-up, then every prompt; the parent only gathers the rows. Two systems in one
process fight for the same cores (a native engine's threads starve llama.cpp's, and the other way
round), so figures taken side by side in one process measure the contention, not the systems.
``--repeats`` passes go over the systems in rotated order (pass i starts at system i), so drift in
the machine's load hits every system alike. ``openai`` runs in the benchmark's own process: its work
happens in the server's.

The llama.cpp anchor: with ``llamacpp`` and other systems, llama.cpp also runs before the first
pass, between passes and after the last (``A, pass 1, A, pass 2, ..., A``), each time in a fresh
process. Its decode speed in those runs is its standalone speed at that moment of this invocation;
when the fastest and slowest differ by more than ``--anchor-tolerance`` (of the fastest), the
machine's load moved during the run and no ratio against llama.cpp is printed (the table shows
"-" and a note says why; `AnchorCheck`); bounds are printed instead, each system's slowest run
over the fastest anchor run and its fastest over the slowest, which hold whatever the drift.

``--engine`` picks the default systems (``--systems`` overrides them):

- ``native`` (default): ``hf, hf-lookup, plain, ngram, suffix, draft``; ``--drafter-config``
  holds extra `NativeConfig` options for the drafting systems, e.g. ``{"draft_tokens": 6}``;
- ``vllm``: ``plain, vllm, vllm-spec`` (native plain next to vLLM eager, and vLLM with its
  ``speculative_config`` = ``--drafter-config``, by default n-gram with k=4); needs vLLM importable
  (on CPU: the .venv-vllm virtualenv from ``bash .ci/vllm-venv.sh``);
- systems in no default set: ``plain-int8`` and ``suffix-int8`` (native with
  ``precision="int8"``), ``plain-bf16`` (``precision="bf16"``), ``plain-avx2`` (exact, matmuls
  kept on AVX2) and ``llamacpp`` (llama-cpp-python, ``pip install llama-cpp-python``, on the
  GGUF file the model was pulled from, or ``--gguf``; skipped with a note when
  ``llama_cpp`` is not importable), e.g. ``--systems plain,plain-int8,llamacpp --threads 2``;
- ``openai``: ``openai``, an `OpenAIEngine` at ``--base-url`` asking for ``--served-model``
  (default: the first id of ``GET /v1/models``); the server decides its own speculation, whose
  counters are read from its ``/metrics`` when it is vLLM.

Decode speed is ``(new tokens - 1) / (time from the first to the last output delta)``; prefill
(time to the first output delta) is reported apart, and against llama.cpp as "prefill x
llama.cpp" (llama.cpp's prefill time / the system's: above 1 is faster). Engine systems are timed
on their stream, on one asyncio event loop per process. "same as" compares the generated text
with the reference system's (``plain`` if run, else ``vllm``). With native ``plain`` and a lookup
system (``ngram``, ``suffix``), the tables also show that drafter's ceiling on plain's outputs: the
tau and speedup perfect k would reach at this machine's step costs (`benchmarks.ceiling`), measured
in plain's process. Prompt sets live in ``benchmarks/prompts/*.jsonl``. Results go to
``benchmarks/results/engine-<time>.{json,md}``.
Each run records what its system says of its build: llama.cpp's version and the CPU features it
was built with and uses (``llama_print_system_info``), the native engine's precision and matmul
paths (`GemmPaths`); the report lists them.
``--prefill 512,2048,8190`` measures prefill alone at those prompt lengths, next to the machine's
matmul peak (``benchmarks/engine/prefill.py``), e.g. ``--systems plain,plain-avx2,plain-bf16,
plain-int8,llamacpp``.
``--synthetic`` measures only the model's forward speed on random weights of the same shape (for
machines without the pulled model).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import asdict

import torch

from . import prefill
from .anchor import AnchorCheck
from .catalogue import ALL_SYSTEMS, DEFAULT_ANCHOR_TOLERANCE, ENGINES, LOOKUP_SYSTEMS
from .ceilings import lookup_ceilings
from .common import (PROMPT_SETS, RESULTS_DIR, VLLM_SYSTEMS, load_average, load_prompts,
                     write_results)
from .plan import BenchSetupError, check_backends, describe, drop_missing_llamacpp, make_plan
from .report import markdown
from .runs import Run, run_isolated, run_one, schedule, worker
from .summary import reference_system, summarise
from .synthetic import synthetic
from .systems import engine_factory


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = argparse.ArgumentParser(prog="benchmarks.run engine", description=__doc__.split("\n")[0])
    parser.add_argument("--engine", default="native", choices=ENGINES,
                        help="which backends to compare; picks the default --systems")
    parser.add_argument("--model", default="smollm2-135m", help="local model (name or directory)")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None, help="prompts per set")
    parser.add_argument("--sets", default=",".join(PROMPT_SETS))
    parser.add_argument("--systems", default=None,
                        help=f"comma-separated, from {', '.join(ALL_SYSTEMS)} (default: by --engine)")
    parser.add_argument("--drafter-config", default=None,
                        help="JSON (or a JSON file): native -> extra NativeConfig options for the "
                             "drafting systems; vllm -> vllm-spec's speculative_config")
    parser.add_argument("--spec-config", dest="drafter_config", help=argparse.SUPPRESS)  # former name
    parser.add_argument("--base-url", default=None, help="OpenAI-compatible server (openai system)")
    parser.add_argument("--served-model", default=None,
                        help="model name to request from --base-url (default: first of /v1/models)")
    parser.add_argument("--k", default="auto", help="'auto' (adaptive) or a fixed draft length")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--gguf", default=None,
                        help="GGUF file for the llamacpp system (default: the model's, see "
                             "models.gguf_file)")
    parser.add_argument("--out", default=str(RESULTS_DIR))
    parser.add_argument("--synthetic", action="store_true", help="forward speed on random weights only")
    parser.add_argument("--repeats", type=int, default=1,
                        help="passes over the systems, each in rotated order, every run in a "
                             "process of its own")
    parser.add_argument("--anchor-tolerance", type=float, default=DEFAULT_ANCHOR_TOLERANCE,
                        help="largest spread of llama.cpp's decode speed over its runs (of the "
                             "fastest) for which ratios against it are printed")
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-ceiling", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--concurrency", default=None,
                        help="e.g. 1,2,4,8,16: many requests at once per system, plus the prefix "
                             "and priority scenarios (benchmarks/engine/concurrency.py)")
    parser.add_argument("--step-token-budget", default=None,
                        help="with --concurrency: e.g. off,128: each native system once per value "
                             "of the engine's step_token_budget ('off': none)")
    parser.add_argument("--worker-no-prefix-scenarios", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prefill", default=None,
                        help="e.g. 512,2048,8190: prefill speed at these prompt lengths, next to "
                             "the matmul peak (benchmarks/engine/prefill.py)")
    parser.add_argument("--prefill-repeats", type=int, default=2,
                        help="with --prefill: prompts per length in each run (the best counts)")
    parser.add_argument("--max-seq-len", type=int, default=None,
                        help="context of the native systems and llama.cpp (default 4096; with "
                             "--prefill at least the longest prompt)")
    return parser.parse_args(argv), parser


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns a process exit code (2: it could not start as asked)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, parser = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.synthetic:
        return synthetic(args)
    if args.concurrency and not args.systems:
        args.systems = "plain,suffix" if args.engine == "native" else "plain,vllm,vllm-spec"
    plan = make_plan(args, parser)
    notes = [note] if (note := drop_missing_llamacpp(plan)) else []
    for note in notes:
        print(f"engine bench: {note}", file=sys.stderr)
    if not plan.systems:
        print("engine bench: no system left to run", file=sys.stderr)
        return 2
    try:
        check_backends(plan)
    except BenchSetupError as exc:
        print(f"engine bench: {exc}", file=sys.stderr)
        return 2

    path = None
    if any(s != "openai" for s in plan.systems):
        from agentrt.engine import models

        if args.model in models.REGISTRY:
            path = models.ensure(args.model, args.dtype)
        else:
            path = models.resolve(args.model, args.dtype)
    if args.concurrency:
        # imported here: it needs agentrt.demo (pydantic), the other benchmarks do not
        from . import concurrency

        return concurrency.run(args, plan.systems, plan.sets, engine_factory(plan, args, path),
                               prefix_scenarios=not args.worker_no_prefix_scenarios)
    if args.prefill:
        try:
            sizes = prefill.lengths(args.prefill)
        except ValueError as exc:
            parser.error(str(exc))
        from agentrt.engine.tokenizer import ChatTokenizer

        args.max_seq_len = max(args.max_seq_len or 0, max(sizes) + 2)
        args.max_tokens = 1
        prompts = prefill.prompts(ChatTokenizer(path), sizes, args.prefill_repeats)
    else:
        prompts = load_prompts(plan.sets, args.limit)
    if args.worker_out:
        return worker(args, plan, path, prompts)
    if args.prefill:
        return run_prefill(args, argv, plan, path, prompts, sizes)

    def run_here(system: str, index: int) -> Run:
        return run_one(system, index, plan, args, path, prompts)

    order = schedule(plan.systems, args.repeats)
    ceiling_from = "plain" if any(s in LOOKUP_SYSTEMS for s in plan.systems) else None
    try:
        runs = run_isolated(argv, order, ceiling_from, run_here)
    except BenchSetupError as exc:
        print(f"engine bench: {exc}", file=sys.stderr)
        return 1
    rows = [row for run in runs for row in run.rows]
    ceiling = next((run.ceiling for run in runs if run.ceiling), None)
    infos = {run.system: run.info for run in runs if run.info}
    ceilings = lookup_ceilings(ceiling, prompts, rows, plan.systems)
    anchor = AnchorCheck.of(runs, args.anchor_tolerance) if len(plan.systems) > 1 else None

    meta = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "engine": plan.engine, "model": args.model,
            "dtype": args.dtype, "device": args.device,
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "max_tokens": args.max_tokens,
            "systems": plan.systems, "reference": reference_system(plan.systems), "k": args.k,
            "drafter_config": plan.drafter_config, "base_url": plan.base_url,
            "served_model": plan.served_model, "torch": torch.__version__,
            "descriptions": {s: describe(s, plan) for s in plan.systems}, "notes": notes,
            "repeats": args.repeats,
            "runs": [{"system": r.system, "pid": r.pid, "load_s": r.load_s,
                      "decode_tok_s": r.decode_tok_s} for r in runs],
            "anchor": anchor.describe() if anchor else None,
            "anchor_ok": anchor.ok if anchor else None,
            "anchor_bounds": anchor.bounds(runs) if anchor else None,
            "anchor_prefill_bounds": anchor.prefill_bounds(runs) if anchor else None,
            "system_info": infos}
    if any(s in VLLM_SYSTEMS for s in plan.systems):
        import vllm

        meta["vllm"] = vllm.__version__
        meta["vllm_cpu_env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_CPU_")}
    if args.device.startswith("cuda"):
        meta["cpu"] = torch.cuda.get_device_name()
    summary = summarise(rows, plan.systems, plan.sets, ceilings, anchor)
    md = markdown(summary, meta)
    print(md)
    write_results({"meta": meta, "summary": summary, "rows": [asdict(r) for r in rows]}, md, args.out)
    return 0


def run_prefill(args, argv: list[str], plan, path, prompts, sizes: list[int]) -> int:
    """The parent side of ``--prefill``: the matmul peak, then every system in its own process
    (the llama.cpp anchor around the passes), then the tables (`benchmarks.engine.prefill`)."""
    from agentrt.engine.llama import LlamaConfig

    load_before = load_average()
    peak = prefill.matmul_peak(args.threads)
    order = schedule(plan.systems, args.repeats)
    try:
        runs = run_isolated(argv, order, None, lambda system, index: None)
    except BenchSetupError as exc:
        print(f"engine bench: {exc}", file=sys.stderr)
        return 1
    gflops = prefill.layer_gflops(peak)
    summary = prefill.summarise(runs, sizes, LlamaConfig.from_dir(path), gflops,
                                args.anchor_tolerance)
    meta = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "model": args.model, "dtype": args.dtype,
            "threads": torch.get_num_threads(), "systems": plan.systems, "lengths": sizes,
            "prefill_repeats": args.prefill_repeats, "repeats": args.repeats,
            "load_before": load_before, "load_after": load_average(), "isas": peak["isas"],
            "gemm_gflops": gflops, "anchor_tolerance": args.anchor_tolerance,
            "runs": [{"system": r.system, "pid": r.pid} for r in runs],
            "system_info": {r.system: r.info for r in runs if r.info}}
    md = prefill.markdown(summary, meta)
    print(md)
    write_results({"meta": meta, "summary": summary, "peak": peak,
                   "rows": [asdict(row) for run in runs for row in run.rows]}, md, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
