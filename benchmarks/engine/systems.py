"""The systems the benchmark times, one runner each: transformers ``generate`` (`HFSystem`), any
`Engine` on its stream (`EngineSystem`: native, vLLM, OpenAI-compatible) and llama-cpp-python
(`LlamaCppSystem`); `build_system` makes the runner for a system's name. Every run of one
prompt gives a `Row`."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .catalogue import (AVX2_SYSTEMS, BF16_SYSTEMS, HEAD_SYSTEMS, INT8_SYSTEMS, LLAMACPP_SYSTEMS,
                        TWIN_SYSTEMS)
from .common import VLLM_SYSTEMS
from .plan import Plan


@dataclass
class Row:
    """One prompt on one system: its timings, drafting counters and output."""

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
        sync_device(self.device)
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

    def forget(self) -> None:
        """Drop what earlier prompts left (the native engine's prefix cache and drafter state)."""
        reset = getattr(self.engine, "reset", None)
        if reset is not None:
            reset()

    def info(self) -> dict | None:
        """The native engine's precision and matmul paths (None for other engines)."""
        model = getattr(self.engine, "model", None)
        precision = getattr(model, "precision", None)  # other engines' .model is a name
        if precision is None:
            return None
        ops = getattr(model, "ops", None)
        return {"precision": precision,
                "gemm_paths": ops.paths.describe() if ops is not None else "torch ops"}

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


def sync_device(device: str) -> None:
    """Wait for the device's queued work (CUDA), so that a clock read after it is honest."""
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
                              threads=args.threads, **{"max_seq_len": max_seq_len(args), **options})
        return EngineSystem(engine, loop)
    if system in VLLM_SYSTEMS:
        from agentrt.engine.vllm_engine import VLLMEngine

        spec = plan.vllm_spec_config if system == "vllm-spec" else None
        engine = VLLMEngine(str(path), dtype=args.dtype, max_model_len=4096, speculative_config=spec)
        return EngineSystem(engine, loop)
    if system in (*INT8_SYSTEMS, *BF16_SYSTEMS, *AVX2_SYSTEMS, *LLAMACPP_SYSTEMS):
        return build_single_stream_system(system, plan, args, path, loop)
    if system == "openai":
        from agentrt.engine.openai_engine import OpenAIEngine

        return EngineSystem(OpenAIEngine(plan.base_url, plan.served_model, timeout=300), loop)
    raise ValueError(f"unknown system {system!r}")


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

    def forget(self) -> None:
        """Drop the evaluated tokens, so that the next prompt reuses none of them."""
        self.llm.reset()

    @staticmethod
    def info() -> dict:
        """Which llama.cpp build runs: the llama-cpp-python version and the CPU features
        llama.cpp was built with and uses (`llama_print_system_info`)."""
        import llama_cpp

        return {"llama_cpp_python": llama_cpp.__version__,
                "system_info": llama_cpp.llama_print_system_info().decode().strip()}

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
    """``plain-int8`` / ``suffix-int8`` / ... (native, ``precision="int8"``), ``plain-bf16``
    (``precision="bf16"``), ``plain-avx2`` (exact, matmuls capped at AVX2) or ``llamacpp`` (on
    ``--gguf``, else the GGUF `models.gguf_file` keeps for ``--model``)."""
    if system in (*INT8_SYSTEMS, *BF16_SYSTEMS, *AVX2_SYSTEMS):
        from agentrt.engine import NativeEngine
        from agentrt.engine.gemm_paths import CpuFeatures, GemmPaths

        suffix = system.rpartition("-")[2]
        drafter = None if system.startswith("plain-") else system.removesuffix(f"-{suffix}")
        options = {} if drafter is None else plan.native_options
        engine = NativeEngine(model=str(path), dtype=args.dtype, device=args.device,
                              drafter=drafter, threads=args.threads,
                              precision="exact" if system in AVX2_SYSTEMS else suffix,
                              **{"max_seq_len": max_seq_len(args), **options})
        if system in AVX2_SYSTEMS and engine.model.ops is not None:
            cap = {"AGENTRT_GEMM_ISA": "avx2"}
            engine.model.ops.use_paths(GemmPaths.choose(CpuFeatures.detect(), cap))
        return EngineSystem(engine, loop)
    from agentrt.engine import models

    gguf = Path(args.gguf) if args.gguf else models.gguf_file(args.model)
    return LlamaCppSystem(gguf, path, args.threads, n_ctx=max_seq_len(args))


def max_seq_len(args) -> int:
    """The context the native systems and llama.cpp are given (``--max-seq-len``, 4096)."""
    return getattr(args, "max_seq_len", None) or 4096


def engine_factory(plan: Plan, args, path: Path | None):
    """``make_engine(system, loop, **options)`` for the concurrency suite: the `Engine` that
    `build_system` wraps for ``system`` (``options``: more `NativeEngine` options)."""
    def make_engine(system: str, loop: asyncio.AbstractEventLoop, **extra):
        return build_system(system, plan, args, path, loop, extra).engine

    return make_engine
