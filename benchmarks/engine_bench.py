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
  ``precision="int8"``) and ``llamacpp`` (llama-cpp-python, ``pip install llama-cpp-python``,
  on the GGUF file the model was pulled from, or ``--gguf``; skipped with a note when
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
``--synthetic`` measures only the model's forward speed on random weights of the same shape (for
machines without the pulled model).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .ceiling import Walk, walk
from .engine_common import (PROMPT_DIR, PROMPT_SETS, RESULTS_DIR, VLLM_SYSTEMS, child_env,
                            load_prompts, write_results)

ENGINES = ("native", "vllm", "openai")
NATIVE_SYSTEMS = ("hf", "hf-lookup", "plain", "ngram", "suffix", "draft")
HEAD_SYSTEMS = ("eagle", "hybrid")
"""Native systems drafting with the learned head (`agentrt draft train`; not in any default set)."""
TWIN_SYSTEMS = ("twin", "hybrid-twin")
"""Native systems drafting with the target's own int8 twin (exact precision; not in any default
set)."""
INT8_SYSTEMS = ("plain-int8", "suffix-int8", "eagle-int8", "hybrid-int8")
"""Native systems in ``precision="int8"`` (not in any default set)."""
LLAMACPP_SYSTEMS = ("llamacpp",)
ALL_SYSTEMS = (*NATIVE_SYSTEMS, *HEAD_SYSTEMS, *TWIN_SYSTEMS, *INT8_SYSTEMS, *VLLM_SYSTEMS,
               *LLAMACPP_SYSTEMS, "openai")
DEFAULT_SYSTEMS = {
    "native": NATIVE_SYSTEMS,
    "vllm": ("plain", "vllm", "vllm-spec"),
    "openai": ("openai",),
}
DEFAULT_VLLM_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                     "prompt_lookup_min": 2}
SPEEDUP_BASES = ("plain", "hf", "hf-lookup", "vllm", "llamacpp")
REFERENCE_SYSTEMS = ("plain", "vllm")
DESCRIPTIONS = {
    "hf": "transformers generate, greedy",
    "hf-lookup": "transformers generate, prompt_lookup_num_tokens=10",
    "plain": "native, no drafter",
    "ngram": "native + n-gram prompt lookup",
    "suffix": "native + suffix automaton (cross-request corpus)",
    "draft": "native + layer-skip draft model",
    "vllm": "vLLM AsyncLLM in process, eager, no speculation",
    "vllm-spec": "vLLM AsyncLLM in process, eager, speculative_config",
    "openai": "OpenAIEngine (chat API)",
    "plain-int8": "native, no drafter, precision='int8' (int8 activations x GGUF blocks)",
    "suffix-int8": "native + suffix automaton, precision='int8'",
    "eagle": "native + learned draft head (agentrt draft train)",
    "hybrid": "native + suffix lookup or learned head per step (expected tokens per second)",
    "twin": "native + the target's own int8 twin drafting in its KV blocks",
    "hybrid-twin": "native + suffix lookup or the int8 twin per step (expected tokens per second)",
    "eagle-int8": "native + learned draft head, precision='int8'",
    "hybrid-int8": "native + suffix lookup or learned head per step, precision='int8'",
    "llamacpp": "llama-cpp-python on the GGUF the model was pulled from, greedy, no speculation",
}
IN_PROCESS_SYSTEMS = ("openai",)
"""Systems that run in the benchmark's own process: their work happens in a server's."""
ANCHOR = "llamacpp"
"""The system every other one is compared with, checked for steadiness (`AnchorCheck`)."""
DEFAULT_ANCHOR_TOLERANCE = 0.10
_NATIVE_FIXED_OPTIONS = ("dtype", "device", "drafter", "threads")
"""`NativeConfig` fields every native system sets itself."""


class BenchSetupError(Exception):
    """The benchmark cannot start as asked (missing vLLM, unreachable server, ...)."""


@dataclass
class Row:
    system: str
    prompt_set: str
    prompt_id: str
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    decode_s: float
    total_s: float
    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    pid: int = 0
    """The process that ran it."""
    run: int = 0
    """Its run's place in the invocation's schedule (`schedule`)."""


@dataclass
class Plan:
    """What to run, resolved and checked from the command line before anything loads."""

    engine: str
    systems: list[str]
    sets: list[str]
    native_options: dict[str, Any] = field(default_factory=dict)
    """Extra `NativeEngine` options for the native speculative systems."""
    vllm_spec_config: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_VLLM_SPEC))
    drafter_config: dict[str, Any] | None = None
    """``--drafter-config`` as given (after parsing), recorded in the results."""
    base_url: str | None = None
    served_model: str | None = None


# ------------------------------------------------------------------------------- systems

class HFSystem:
    """transformers ``generate`` (greedy, or with prompt lookup), timed with a streamer."""

    def __init__(self, path: Path, dtype: str, device: str, lookup: int | None):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=torch_dtype).to(device).eval()
        self.device = device
        self.lookup = lookup
        self.eos_ids = _eos_ids(self.tokenizer.eos_token_id, self.model.generation_config.eos_token_id)

    def run(self, messages: list[dict], max_tokens: int) -> Row:
        from transformers.generation.streamers import BaseStreamer

        class Clock(BaseStreamer):
            def __init__(self):
                self.calls, self.first = 0, None

            def put(self, value):
                self.calls += 1
                if self.calls == 2:
                    self.first = time.perf_counter()

            def end(self):
                pass

        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids.to(self.device)
        clock = Clock()
        extra = {"prompt_lookup_num_tokens": self.lookup} if self.lookup else {}
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                      do_sample=False, streamer=clock, **extra)
        _sync(self.device)
        end = time.perf_counter()
        new = out[0, ids.shape[1]:].tolist()
        cut = next((i for i, t in enumerate(new) if t in self.eos_ids), len(new))
        reply = self.tokenizer.decode(new[:cut], skip_special_tokens=True)
        first = clock.first or end
        return Row("", "", "", ids.shape[1], len(new), first - start, end - first, end - start,
                   text=reply)

    def close(self) -> None:
        """Nothing to release beyond the model's memory."""


class EngineSystem:
    """Any `Engine` (native, vLLM, OpenAI-compatible), timed on its own stream.

    Prefill is the time to the first output delta, decode the time from there to the last output
    delta; the token count is ``usage.completion_tokens``, the drafting counters come from the
    final delta's `DecodeMetrics` when the backend reports them. Every call runs on ``loop``, the
    benchmark's one event loop (vLLM's `AsyncLLM` and `OpenAIEngine` bind to their first loop).
    """

    def __init__(self, engine, loop: asyncio.AbstractEventLoop):
        self.engine = engine
        self.loop = loop

    def run(self, messages: list[dict], max_tokens: int) -> Row:
        return self.loop.run_until_complete(self._measure(messages, max_tokens))

    async def _measure(self, messages: list[dict], max_tokens: int) -> Row:
        from agentrt.engine import EngineError, SamplingParams

        parts: list[str] = []
        ids: list[int] = []
        first = last = None
        final = None
        start = time.perf_counter()
        stream = self.engine.stream(messages, SamplingParams(max_tokens=max_tokens))
        async with contextlib.aclosing(stream) as deltas:
            async for delta in deltas:
                now = time.perf_counter()
                if delta.text or delta.token_ids:
                    parts.append(delta.text)
                    ids.extend(delta.token_ids)
                    first = now if first is None else first
                    last = now
                if delta.finish_reason is not None:
                    final = delta
        end = time.perf_counter()
        if final is None or final.usage is None:
            raise EngineError(f"{self.engine.name}: the stream ended without a final delta with usage")
        first = first or end
        last = last or end
        m = final.metrics
        return Row("", "", "", final.usage.prompt_tokens, final.usage.completion_tokens,
                   first - start, last - first, end - start,
                   m.verify_steps if m else 0, m.draft_tokens if m else 0,
                   m.accepted_tokens if m else 0, text="".join(parts), token_ids=ids)

    def close(self) -> None:
        """Release the engine (its worker thread, engine process or HTTP connections)."""
        self.loop.run_until_complete(self.engine.aclose())


def _eos_ids(*values) -> set[int]:
    ids: set[int] = set()
    for value in values:
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return ids


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def build_system(system: str, plan: Plan, args, path: Path | None,
                 loop: asyncio.AbstractEventLoop, extra: dict[str, Any] | None = None):
    """Construct the runner for one system name (``extra``: more `NativeEngine` options)."""
    if system.startswith("hf"):
        return HFSystem(path, args.dtype, args.device, 10 if system == "hf-lookup" else None)
    if system in ("plain", "ngram", "suffix", "draft", *HEAD_SYSTEMS, *TWIN_SYSTEMS):
        from agentrt.engine import NativeEngine

        k = args.k if args.k == "auto" else int(args.k)
        options = {} if system == "plain" else {"draft_tokens": k, **plan.native_options}
        options.update(extra or {})
        engine = NativeEngine(model=str(path), dtype=args.dtype, device=args.device,
                              drafter=None if system == "plain" else system,
                              threads=args.threads, **{"max_seq_len": 4096, **options})
        return EngineSystem(engine, loop)
    if system in VLLM_SYSTEMS:
        from agentrt.engine.vllm_engine import VLLMEngine

        spec = plan.vllm_spec_config if system == "vllm-spec" else None
        engine = VLLMEngine(str(path), dtype=args.dtype, max_model_len=4096, speculative_config=spec)
        return EngineSystem(engine, loop)
    if system in INT8_SYSTEMS or system in LLAMACPP_SYSTEMS:
        return build_single_stream_system(system, plan, args, path, loop)
    if system == "openai":
        from agentrt.engine.openai_engine import OpenAIEngine

        return EngineSystem(OpenAIEngine(plan.base_url, plan.served_model, timeout=300), loop)
    raise ValueError(f"unknown system {system!r}")


# ---------------------------------------------------------- single-stream kernel systems

LLAMACPP_INSTALL_HINT = ("pip install llama-cpp-python (builds llama.cpp from source: a few "
                         "minutes, needs cmake and a C++ compiler)")


def llamacpp_missing() -> str | None:
    """Why the ``llamacpp`` system cannot run here (None when ``llama_cpp`` imports)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return f"llama_cpp is not importable ({exc}); {LLAMACPP_INSTALL_HINT}"
    return None


class LlamaCppSystem:
    """llama-cpp-python on a GGUF file, greedy, timed token by token like `EngineSystem`: the
    prompt is the native tokenizer's chat template ids (the same tokens every system sees);
    prefill is the time to the first token, decode the time from there to the last. Its own
    prompt-prefix reuse stays on, as the native engine's does."""

    def __init__(self, gguf: Path, tokenizer_path: Path, threads: int | None, n_ctx: int = 4096):
        from llama_cpp import Llama

        from agentrt.engine.tokenizer import ChatTokenizer

        self.tokenizer = ChatTokenizer(tokenizer_path)
        threads = threads or torch.get_num_threads()
        self.llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads,
                         n_threads_batch=threads, verbose=False)
        self.stop_ids = set(self.tokenizer.eos_token_ids) | {self.llm.token_eos()}

    def run(self, messages: list[dict], max_tokens: int) -> Row:
        ids = self.tokenizer.encode_chat(messages)
        out: list[int] = []
        start = time.perf_counter()
        first = last = None
        for token in self.llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                       repeat_penalty=1.0):
            last = time.perf_counter()
            first = first or last
            if token in self.stop_ids:
                break
            out.append(token)
            if len(out) >= max_tokens:
                break
        end = time.perf_counter()
        first, last = first or end, last or end
        return Row("", "", "", len(ids), len(out), first - start, last - first, end - start,
                   text=self.tokenizer.decode(out), token_ids=out)

    def close(self) -> None:
        self.llm.close()


def build_single_stream_system(system: str, plan: Plan, args, path: Path,
                               loop: asyncio.AbstractEventLoop):
    """``plain-int8`` / ``suffix-int8`` (native, ``precision="int8"``) or ``llamacpp`` (on
    ``--gguf``, else the GGUF `models.gguf_file` keeps for ``--model``)."""
    if system in INT8_SYSTEMS:
        from agentrt.engine import NativeEngine

        drafter = None if system == "plain-int8" else system.removesuffix("-int8")
        options = {} if drafter is None else plan.native_options
        engine = NativeEngine(model=str(path), dtype=args.dtype, device=args.device,
                              drafter=drafter, threads=args.threads, precision="int8",
                              **{"max_seq_len": 4096, **options})
        return EngineSystem(engine, loop)
    from agentrt.engine import models

    gguf = Path(args.gguf) if args.gguf else models.gguf_file(args.model)
    return LlamaCppSystem(gguf, path, args.threads)


def drop_missing_llamacpp(plan: Plan) -> str | None:
    """Remove ``llamacpp`` from the plan when llama_cpp is not importable; returns the note
    to print and record (None when nothing was dropped)."""
    if not any(s in LLAMACPP_SYSTEMS for s in plan.systems):
        return None
    reason = llamacpp_missing()
    if reason is None:
        return None
    plan.systems = [s for s in plan.systems if s not in LLAMACPP_SYSTEMS]
    return f"llamacpp skipped: {reason}"


# ------------------------------------------------------------------------------- options

def native_options(value: str) -> dict[str, Any]:
    """Parse ``--drafter-config`` for the native systems: extra `NativeConfig` options.

    ``value`` is a JSON object or a path to a JSON file. The drafter is the system's
    (``ngram``, ``suffix``, ``draft``), so ``method`` is refused, as is any name that is not a
    `NativeConfig` field (or one the systems set themselves).
    """
    from agentrt.engine import NativeConfig
    from agentrt.engine.drafter_config import read_json_object

    options = read_json_object(value)
    if "method" in options:
        raise ValueError("--drafter-config for --engine native takes NativeConfig options only; the "
                         "method is the system's (ngram, suffix, draft): pick it with --systems")
    known = {f.name for f in dataclasses.fields(NativeConfig)} - set(_NATIVE_FIXED_OPTIONS)
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"--drafter-config: NativeEngine has no option {unknown}; "
                         f"choose from {sorted(known)}")
    return options


def served_models(base_url: str, timeout: float = 10.0) -> list[str]:
    """Model ids an OpenAI-compatible server lists at ``GET /v1/models``."""
    import httpx

    url = f"{server_root(base_url)}/v1/models"
    try:
        response = httpx.get(url, timeout=timeout)
    except httpx.HTTPError as exc:
        raise BenchSetupError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise BenchSetupError(f"{url} answered HTTP {response.status_code}; "
                              "pass the model name with --served-model")
    try:
        return [str(item["id"]) for item in response.json().get("data", [])]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BenchSetupError(f"{url} did not return a model list ({exc}); "
                              "pass the model name with --served-model") from exc


def server_root(base_url: str) -> str:
    """``http://host:port`` for a server root or its ``/v1`` root."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


def make_plan(args, parser: argparse.ArgumentParser) -> Plan:
    """Check the options against each other; usage errors exit through ``parser.error``."""
    from agentrt.engine_options import parse_drafter_config

    systems = [s for s in (args.systems or ",".join(DEFAULT_SYSTEMS[args.engine])).split(",") if s]
    unknown = [s for s in systems if s not in ALL_SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(ALL_SYSTEMS)}")
    sets = [s for s in args.sets.split(",") if s]
    missing = [s for s in sets if not (PROMPT_DIR / f"{s}.jsonl").is_file()]
    if missing:
        parser.error(f"unknown prompt sets {missing}; choose from {', '.join(PROMPT_SETS)}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if not 0 <= args.anchor_tolerance < 1:
        parser.error(f"--anchor-tolerance is a fraction in [0, 1), got {args.anchor_tolerance}")
    plan = Plan(engine=args.engine, systems=systems, sets=sets)

    if "openai" in systems:
        if not args.base_url:
            parser.error("the openai system needs --base-url (e.g. http://127.0.0.1:8000/v1)")
        plan.base_url = args.base_url
        plan.served_model = args.served_model
    elif args.base_url or args.served_model:
        parser.error("--base-url and --served-model are for the openai system "
                     "(--engine openai, or --systems ...,openai)")

    if args.drafter_config is not None:
        if args.engine == "openai":
            parser.error("--drafter-config does not apply to --engine openai: the server decides "
                         "its drafter (e.g. vLLM's --speculative-config when it starts)")
        try:
            if args.engine == "native":
                plan.native_options = native_options(args.drafter_config)
                plan.drafter_config = plan.native_options
            else:
                config = parse_drafter_config(args.drafter_config)
                if config is None:
                    parser.error("--drafter-config for --engine vllm must describe a speculative "
                                 "config (e.g. {\"method\": \"ngram\", ...})")
                plan.vllm_spec_config = plan.drafter_config = config
        except ValueError as exc:
            parser.error(str(exc))
    elif args.engine == "vllm":
        plan.drafter_config = plan.vllm_spec_config
    return plan


def check_backends(plan: Plan) -> None:
    """Fail fast, before any model loads: vLLM importable, the server reachable."""
    if any(s in VLLM_SYSTEMS for s in plan.systems):
        from agentrt.engine.vllm_engine import INSTALL_HINT, VLLMNotInstalled

        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            raise BenchSetupError(str(VLLMNotInstalled(f"{INSTALL_HINT} ({exc})"))) from exc
    if "openai" in plan.systems and plan.served_model is None:
        models = served_models(plan.base_url)
        if not models:
            raise BenchSetupError(f"{server_root(plan.base_url)}/v1/models lists no model; "
                                  "pass --served-model")
        plan.served_model = models[0]


def describe(system: str, plan: Plan) -> str:
    """The Systems legend entry for ``system``."""
    text = DESCRIPTIONS[system]
    if system == "vllm-spec":
        text += f" {json.dumps(plan.vllm_spec_config)}"
    elif system == "openai":
        text += f" at {plan.base_url}, model `{plan.served_model}` (the server's own drafter)"
    elif (system in ("ngram", "suffix", "draft", *HEAD_SYSTEMS, *TWIN_SYSTEMS, *INT8_SYSTEMS[1:])
          and plan.native_options):
        text += f" {json.dumps(plan.native_options)}"
    return text


# ------------------------------------------------------------------ one process per system


@dataclass
class Run:
    """One system's pass over every prompt, in a process of its own (``pid``) unless it is in
    `IN_PROCESS_SYSTEMS`."""

    system: str
    index: int
    pid: int
    load_s: float
    rows: list[Row]
    ceiling: dict | None = None
    """What `ceiling_inputs` measured in this run's process, when it was asked to."""

    @property
    def decode_tok_s(self) -> float:
        """Decode tokens per second over the run's prompts (as `summarise` counts them)."""
        seconds = sum(r.decode_s for r in self.rows)
        return sum(max(r.new_tokens - 1, 0) for r in self.rows) / seconds if seconds > 0 else 0.0

    @property
    def prefill_s(self) -> float:
        """Mean prefill seconds over the run's prompts."""
        return statistics.mean(r.prefill_s for r in self.rows) if self.rows else 0.0


def schedule(systems: list[str], repeats: int) -> list[str]:
    """The runs of one invocation, in order: ``repeats`` passes over ``systems``, pass i
    rotated to start at system i. With the anchor (`ANCHOR`) and other systems, the anchor runs
    before the first pass, between passes and after the last instead of inside them."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    anchored = ANCHOR in systems and len(systems) > 1
    others = [s for s in systems if s != ANCHOR] if anchored else list(systems)
    order = [ANCHOR] if anchored else []
    for i in range(repeats):
        k = i % len(others)
        order += others[k:] + others[:k] + ([ANCHOR] if anchored else [])
    return order


def _per_system(runs: list[Run], value: Callable[[Run], float]) -> dict[str, list[float]]:
    """``value`` of each run, by system, the anchor's runs left out."""
    by_system: dict[str, list[float]] = {}
    for run in runs:
        if run.system != ANCHOR:
            by_system.setdefault(run.system, []).append(value(run))
    return by_system


@dataclass(frozen=True)
class AnchorCheck:
    """Whether llama.cpp's standalone decode speed held still over the invocation: its runs'
    speeds (tok/s, in run order) may differ by at most ``tolerance`` of the fastest."""

    speeds: tuple[float, ...]
    tolerance: float

    @property
    def spread(self) -> float:
        """(fastest - slowest) / fastest."""
        top = max(self.speeds)
        return (top - min(self.speeds)) / top if top > 0 else 1.0

    @property
    def ok(self) -> bool:
        return len(self.speeds) >= 2 and self.spread <= self.tolerance

    def describe(self) -> str:
        speeds = ", ".join(f"{v:.1f}" for v in self.speeds)
        if len(self.speeds) < 2:
            return f"llama.cpp ran once ({speeds} tok/s): no steadiness check, no ratio against it"
        verdict = ("steady" if self.ok else
                   "UNSTEADY: the machine's load changed during the run; ratios against it withheld")
        return (f"llama.cpp anchor runs {speeds} decode tok/s, spread {self.spread:.1%} "
                f"(tolerance {self.tolerance:.0%}): {verdict}")

    def bounds(self, runs: list[Run]) -> dict[str, tuple[float, float]]:
        """Per system, its decode speed against llama.cpp's whatever the drift: ``(slowest run
        / fastest anchor run, fastest run / slowest anchor run)``. Every run of the system was
        at least the low bound times every anchor run, however the load moved."""
        top, bottom = max(self.speeds), min(self.speeds)
        return {system: (min(v) / top, max(v) / bottom)
                for system, v in _per_system(runs, lambda r: r.decode_tok_s).items()
                if top > 0 and bottom > 0}

    @staticmethod
    def prefill_bounds(runs: list[Run]) -> dict[str, tuple[float, float]]:
        """Per system, how much faster its prefill was than llama.cpp's, run against run:
        ``(fastest anchor run / slowest run, slowest anchor run / fastest run)`` of the mean
        prefill seconds."""
        anchor = [run.prefill_s for run in runs if run.system == ANCHOR]
        return {system: (min(anchor) / max(v), max(anchor) / min(v))
                for system, v in _per_system(runs, lambda r: r.prefill_s).items()
                if anchor and min(v) > 0}

    @classmethod
    def of(cls, runs: list[Run], tolerance: float) -> "AnchorCheck | None":
        """The check over the anchor's runs (None when the anchor did not run)."""
        speeds = tuple(run.decode_tok_s for run in runs if run.system == ANCHOR)
        return cls(speeds, tolerance) if speeds else None


def run_isolated(argv: list[str], order: list[str], ceiling_from: str | None,
                 run_here) -> list[Run]:
    """Run each entry of ``order`` (see `schedule`) in a fresh ``python -m
    benchmarks.engine_bench`` process, given this invocation's ``argv`` with ``--systems`` set to
    the one system; `IN_PROCESS_SYSTEMS` go to ``run_here(system, index)`` instead. The first run
    of ``ceiling_from`` also measures the lookup ceiling's inputs (`ceiling_inputs`)."""
    runs: list[Run] = []
    ceiling_asked = False
    with tempfile.TemporaryDirectory(prefix="engine-bench-") as tmp:
        for index, system in enumerate(order):
            print(f"run {index + 1}/{len(order)}: {system}", file=sys.stderr)
            if system in IN_PROCESS_SYSTEMS:
                runs.append(run_here(system, index))
                continue
            out = Path(tmp) / f"run-{index}.json"
            command = [sys.executable, "-m", "benchmarks.engine_bench", *argv,
                       "--systems", system, "--worker-out", str(out)]
            if system == ceiling_from and not ceiling_asked:
                command.append("--worker-ceiling")
                ceiling_asked = True
            code = subprocess.run(command, env=child_env()).returncode
            if code != 0 or not out.is_file():
                raise BenchSetupError(f"{system}'s process exited with code {code} (its error is "
                                      "above)")
            payload = json.loads(out.read_text())
            rows = [Row(**row) for row in payload["rows"]]
            for row in rows:
                row.run = index
            runs.append(Run(system, index, payload["pid"], payload["load_s"], rows,
                            payload.get("ceiling")))
    return runs


def run_one(system: str, index: int, plan: Plan, args, path: Path | None,
            prompts: list[tuple[str, dict]], ceiling: bool = False) -> Run:
    """Load ``system`` in this process, warm it up and run every prompt (``ceiling``: also
    measure `ceiling_inputs` on it afterwards)."""
    loop = asyncio.new_event_loop()
    runners: dict = {}
    try:
        t = time.perf_counter()
        runners[system] = build_system(system, plan, args, path, loop)
        load_s = time.perf_counter() - t
        print(f"loaded {system} in {load_s:.1f}s (pid {os.getpid()})", file=sys.stderr)
        rows = run_all(runners, prompts, args.max_tokens)
        inputs = ceiling_inputs(runners[system].engine, prompts, plan.sets) if ceiling else None
    finally:
        close_all(runners, loop)
    for row in rows:
        row.pid, row.run = os.getpid(), index
    return Run(system, index, os.getpid(), load_s, rows, inputs)


def worker(args, plan: Plan, path: Path | None, prompts: list[tuple[str, dict]]) -> int:
    """The child side of `run_isolated`: run the one system of ``plan`` (`run_one`) and write
    ``{"pid", "load_s", "rows", "ceiling"}`` as JSON to ``--worker-out``."""
    (system,) = plan.systems
    run = run_one(system, 0, plan, args, path, prompts, args.worker_ceiling)
    payload = {"pid": run.pid, "load_s": run.load_s, "rows": [asdict(r) for r in run.rows],
               "ceiling": run.ceiling}
    Path(args.worker_out).write_text(json.dumps(payload))
    return 0


# ------------------------------------------------------------------------------- ceiling

LOOKUP_SYSTEMS = ("ngram", "suffix")


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


# ------------------------------------------------------------------------------- summary

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


def markdown(summary: dict, meta: dict) -> str:
    setup = (f"model `{meta['model']}` {meta['dtype']} on {meta['device']} ({meta['cpu']}, "
             f"torch threads {meta['threads']}), max_tokens {meta['max_tokens']}, greedy.")
    lines = [f"# Engine benchmark ({meta['time']})", "", setup, ""]
    if meta.get("vllm"):
        env = " ".join(f"{k}={v}" for k, v in meta.get("vllm_cpu_env", {}).items())
        lines += [f"vLLM {meta['vllm']}" + (f" ({env})." if env else "."), ""]
    if meta.get("base_url"):
        lines += [f"Endpoint {meta['base_url']}, served model `{meta['served_model']}`.", ""]
    reference = meta.get("reference") or "plain"
    bases = [("plain", "x plain"), ("hf", "x HF"), ("hf-lookup", "x HF lookup")]
    if "vllm" in meta["systems"]:
        bases.append(("vllm", "x vLLM"))
    if "llamacpp" in meta["systems"]:
        bases.append(("llamacpp", "x llama.cpp"))
    lines += [f"Note: {note}" for note in meta.get("notes", [])] + ([""] if meta.get("notes") else [])
    if meta.get("runs"):
        lines += ["Runs, each system alone in a process of its own: " + ", ".join(
            f"{r['system']} ({r['decode_tok_s']:.1f} tok/s)" for r in meta["runs"]) + ".", ""]
    if meta.get("anchor"):
        lines += [f"Anchor: {meta['anchor']}.", ""]
    prefill_vs = ["prefill x llama.cpp"] if "llamacpp" in meta["systems"] else []
    header = ["system", "decode tok/s", *(title for _, title in bases), "tau", "accept",
              "ceiling tau", "ceiling x plain", "prefill s", *prefill_vs, f"same as {reference}"]

    def fmt(v, spec="{:.2f}"):
        return "-" if v is None else spec.format(v)

    for prompt_set, per in summary.items():
        lines += [f"## {prompt_set}", "", "| " + " | ".join(header) + " |",
                  "|" + "---|" * len(header)]
        for system, e in per.items():
            if "decode_tok_s" not in e:
                continue
            cells = [system, f"{e['decode_tok_s']:.1f}",
                     *(fmt(e.get(f"speedup_vs_{base}")) for base, _ in bases),
                     fmt(e["tau"]), fmt(e["acceptance_rate"]), fmt(e.get("ceiling_tau")),
                     fmt(e.get("ceiling_speedup_vs_plain")), f"{e['mean_prefill_s']:.2f}",
                     *(fmt(e.get("prefill_speedup_vs_llamacpp")) for _ in prefill_vs),
                     e.get(f"same_output_as_{reference}", "-")
                     + (f" (plain-int8: {e['same_output_as_plain-int8']})"
                        if "same_output_as_plain-int8" in e else "")]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += against_anchor(summary.get("all", {}), meta)
    lines += ["Systems: " + "; ".join(f"`{s}` = {meta['descriptions'][s]}" for s in meta["systems"]),
              "", ("Ceiling: the same drafter on plain's outputs with perfect k (it drafts exactly "
                   "what will be accepted), at step costs measured on this machine; see "
                   "`benchmarks/ceiling.py`."), ""]
    return "\n".join(lines)


def against_anchor(per: dict, meta: dict) -> list[str]:
    """Markdown lines with every system's decode and prefill ratio against llama.cpp over all
    prompts, or why there are none (an unsteady anchor)."""
    if ANCHOR not in per or len(per) < 2:
        return []
    if not meta.get("anchor_ok"):
        lines = [f"No ratio against llama.cpp: {meta.get('anchor')}."]
        if meta.get("anchor_bounds"):
            lines.append("Bounds instead, each run against each llama.cpp run (slowest run / "
                         "fastest anchor .. fastest / slowest anchor): " + "; ".join(
                             f"`{system}` {low:.2f}x-{high:.2f}x"
                             for system, (low, high) in meta["anchor_bounds"].items()) + ".")
        if meta.get("anchor_prefill_bounds"):
            lines.append("Prefill, each run against each llama.cpp run (fastest anchor / slowest "
                         "run .. slowest anchor / fastest run): " + "; ".join(
                             f"`{system}` {low:.2f}x-{high:.2f}x faster"
                             for system, (low, high) in meta["anchor_prefill_bounds"].items()) + ".")
        return [*lines, ""]
    parts = [f"`{system}` decode {e['speedup_vs_llamacpp']:.2f}x, prefill "
             f"{e['prefill_speedup_vs_llamacpp']:.2f}x faster"
             for system, e in per.items() if system != ANCHOR and "speedup_vs_llamacpp" in e]
    return ["Against llama.cpp (all prompts, every system alone in its process): "
            + "; ".join(parts) + ".", ""]


# ----------------------------------------------------------------------------- synthetic

def synthetic(args) -> int:
    """Forward speed on random weights shaped like SmolLM2-135M (no model download needed)."""
    from agentrt.engine.draft_policy import StepCosts
    from agentrt.engine.llama import LlamaConfig, SequenceCache, Transformer

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                      tie_word_embeddings=True)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    model = Transformer(cfg, dtype, args.device, max_seq_len=2048).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    with torch.inference_mode():
        costs = StepCosts.measure(model, 17)
        cache = SequenceCache(model, max_len=64 + args.max_tokens)
        tokens = torch.zeros(1, 1, dtype=torch.long, device=args.device)
        cache(torch.zeros(1, 64, dtype=torch.long, device=args.device), 0, "last")
        _sync(args.device)
        start = time.perf_counter()
        for pos in range(64, 64 + args.max_tokens):
            tokens = cache(tokens, pos, "last").argmax(-1)
        _sync(args.device)
        plain = args.max_tokens / (time.perf_counter() - start)
    result = {"synthetic": True, "dtype": args.dtype, "device": args.device,
              "plain_decode_tok_s": plain,
              "forward_ms_by_tokens": {n: s * 1e3 for n, s in costs.points}}
    print(json.dumps(result, indent=2))
    write_results(result, f"# Synthetic forward speed\n\n```\n{json.dumps(result, indent=2)}\n```\n",
                  args.out)
    return 0


# ---------------------------------------------------------------------------------- main

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
                             "and priority scenarios (benchmarks/engine_concurrency.py)")
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
        from . import engine_concurrency

        def make_engine(system: str, loop: asyncio.AbstractEventLoop, **extra):
            return build_system(system, plan, args, path, loop, extra).engine

        return engine_concurrency.run(args, plan.systems, plan.sets, make_engine)
    prompts = load_prompts(plan.sets, args.limit)
    if args.worker_out:
        return worker(args, plan, path, prompts)

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
            "anchor_prefill_bounds": anchor.prefill_bounds(runs) if anchor else None}
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


def run_all(runners: dict, prompts: list[tuple[str, dict]], max_tokens: int) -> list[Row]:
    """One warm-up per system, then every prompt on every system, interleaved."""
    warm = [{"role": "user", "content": "Say hello."}]
    for runner in runners.values():
        runner.run(warm, 8)
    rows: list[Row] = []
    for i, (prompt_set, prompt) in enumerate(prompts):
        for system, runner in runners.items():
            row = runner.run(prompt["messages"], max_tokens)
            row.system, row.prompt_set, row.prompt_id = system, prompt_set, prompt["id"]
            rows.append(row)
            print(f"[{i + 1}/{len(prompts)}] {prompt['id']:10s} {system:10s} {row.new_tokens:4d} tok "
                  f"decode {max(row.new_tokens - 1, 0) / max(row.decode_s, 1e-9):6.1f} tok/s "
                  f"prefill {row.prefill_s:5.2f}s", file=sys.stderr)
    return rows


def close_all(runners: dict, loop: asyncio.AbstractEventLoop) -> None:
    """Close every runner (a failing one does not stop the others), then the event loop."""
    for system, runner in runners.items():
        try:
            runner.close()
        except Exception as exc:  # report, keep closing the rest
            print(f"closing {system} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    with contextlib.suppress(Exception):
        loop.run_until_complete(loop.shutdown_asyncgens())
    loop.close()


if __name__ == "__main__":
    sys.exit(main())
