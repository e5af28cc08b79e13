"""Engine benchmark: HF ``generate`` vs the native engine, plain and with each proposer.

One run, same prompts, model and dtype, side by side. Systems are interleaved prompt by prompt
(every system runs prompt 1, then every system runs prompt 2, ...), so a change in machine load
hits them all alike. Greedy decoding throughout.

    python -m benchmarks.run engine [--dtype bf16] [--max-tokens 128] [--limit 4]
                                    [--systems hf,hf-lookup,plain,ngram,suffix,draft]

Decode speed is ``(new tokens) / (time after the first token)``; prefill (time to first token)
is reported apart. Prompt sets live in ``benchmarks/prompts/*.jsonl``. Results go to
``benchmarks/results/engine-<time>.{json,md}``. ``--synthetic`` measures only the model's forward
speed on random weights of the same shape (for machines without the pulled model).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
PROMPT_DIR = HERE / "prompts"
RESULTS_DIR = HERE / "results"
PROMPT_SETS = ("agent_code", "chat", "copy_heavy")
ALL_SYSTEMS = ("hf", "hf-lookup", "plain", "ngram", "suffix", "draft")
DESCRIPTIONS = {
    "hf": "transformers generate, greedy",
    "hf-lookup": "transformers generate, prompt_lookup_num_tokens=10",
    "plain": "native, no speculation",
    "ngram": "native + n-gram prompt lookup",
    "suffix": "native + suffix automaton (cross-request corpus)",
    "draft": "native + layer-skip draft model",
}


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
    token_ids: list[int] | None = None


def load_prompts(sets: list[str], limit: int | None) -> list[tuple[str, dict]]:
    prompts = []
    for name in sets:
        with open(PROMPT_DIR / f"{name}.jsonl") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        prompts += [(name, row) for row in rows[:limit]]
    return prompts


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
        eos = self.tokenizer.eos_token_id
        tokens = new[:new.index(eos)] if eos in new else new
        first = clock.first or end
        return Row("", "", "", ids.shape[1], len(new), first - start, end - first, end - start,
                   token_ids=tokens)


class NativeSystem:
    """`NativeEngine` with one speculation setting."""

    def __init__(self, model: str, dtype: str, device: str, speculation: str | None, k, threads):
        from agentrt.engine import NativeEngine

        self.engine = NativeEngine(model=model, dtype=dtype, device=device, speculation=speculation,
                                   num_speculative_tokens=k, threads=threads, max_seq_len=4096)

    def run(self, messages: list[dict], max_tokens: int) -> Row:
        from agentrt.engine import SamplingParams, complete

        start = time.perf_counter()
        out = asyncio.run(complete(self.engine, messages, SamplingParams(max_tokens=max_tokens)))
        end = time.perf_counter()
        m = out.metrics
        return Row("", "", "", out.usage.prompt_tokens, m.generated_tokens, m.prefill_s,
                   m.wall_s - m.prefill_s, end - start, m.verify_steps, m.draft_tokens,
                   m.accepted_tokens, token_ids=list(out.token_ids))


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------- summary

def summarise(rows: list[Row], systems: list[str], sets: list[str]) -> dict:
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
        for system, entry in per.items():
            for base in ("plain", "hf", "hf-lookup"):
                if base in per and per[base]["decode_tok_s"] > 0:
                    entry[f"speedup_vs_{base}"] = entry["decode_tok_s"] / per[base]["decode_tok_s"]
        summary[prompt_set] = per
    plain = {(r.prompt_set, r.prompt_id): r.token_ids for r in rows if r.system == "plain"}
    if plain:
        for system in systems:
            mine = [r for r in rows if r.system == system and (r.prompt_set, r.prompt_id) in plain]
            if mine:
                same = sum(r.token_ids == plain[(r.prompt_set, r.prompt_id)] for r in mine)
                summary["all"].setdefault(system, {})["same_output_as_plain"] = f"{same}/{len(mine)}"
    return summary


def markdown(summary: dict, meta: dict) -> str:
    lines = [f"# Engine benchmark ({meta['time']})", "",
             f"model `{meta['model']}` {meta['dtype']} on {meta['device']} ({meta['cpu']}, "
             f"torch threads {meta['threads']}), max_tokens {meta['max_tokens']}, greedy.", ""]
    for prompt_set, per in summary.items():
        lines += [f"## {prompt_set}", "",
                  "| system | decode tok/s | x plain | x HF | x HF lookup | tau | accept "
                  "| prefill s | same as plain |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for system, e in per.items():
            if "decode_tok_s" not in e:
                continue

            def fmt(v, spec="{:.2f}"):
                return "-" if v is None else spec.format(v)
            lines.append(
                f"| {system} | {e['decode_tok_s']:.1f} | {fmt(e.get('speedup_vs_plain'))} | "
                f"{fmt(e.get('speedup_vs_hf'))} | {fmt(e.get('speedup_vs_hf-lookup'))} | "
                f"{fmt(e['tau'])} | {fmt(e['acceptance_rate'])} | {e['mean_prefill_s']:.2f} | "
                f"{e.get('same_output_as_plain', '-')} |")
        lines.append("")
    lines += ["Systems: " + "; ".join(f"`{s}` = {DESCRIPTIONS[s]}" for s in meta["systems"]), ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- synthetic

def synthetic(args) -> int:
    """Forward speed on random weights shaped like SmolLM2-135M (no model download needed)."""
    from agentrt.engine.llama import LlamaConfig, Transformer
    from agentrt.engine.native import StepCosts

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                      tie_word_embeddings=True)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    model = Transformer(cfg, dtype, args.device, max_seq_len=2048).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.refresh_weights()
    with torch.inference_mode():
        costs = StepCosts.measure(model, 17)
        tokens = torch.zeros(1, 1, dtype=torch.long, device=args.device)
        model(torch.zeros(1, 64, dtype=torch.long, device=args.device), 0, "last")
        _sync(args.device)
        start = time.perf_counter()
        for pos in range(64, 64 + args.max_tokens):
            tokens = model(tokens, pos, "last").argmax(-1)
        _sync(args.device)
        plain = args.max_tokens / (time.perf_counter() - start)
    result = {"synthetic": True, "dtype": args.dtype, "device": args.device,
              "plain_decode_tok_s": plain,
              "forward_ms_by_tokens": {n: s * 1e3 for n, s in costs.points}}
    print(json.dumps(result, indent=2))
    _write(result, f"# Synthetic forward speed\n\n```\n{json.dumps(result, indent=2)}\n```\n", args)
    return 0


def _write(payload: dict, md: str, args) -> None:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (out_dir / f"engine-{stamp}.json").write_text(json.dumps(payload, indent=2) + "\n")
    (out_dir / f"engine-{stamp}.md").write_text(md)
    print(f"\nwrote {out_dir / f'engine-{stamp}.json'} and .md")


# ---------------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns a process exit code."""
    parser = argparse.ArgumentParser(prog="benchmarks.run engine", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--limit", type=int, default=None, help="prompts per set")
    parser.add_argument("--sets", default=",".join(PROMPT_SETS))
    parser.add_argument("--systems", default=",".join(ALL_SYSTEMS))
    parser.add_argument("--k", default="auto", help="'auto' (adaptive) or a fixed draft length")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(RESULTS_DIR))
    parser.add_argument("--synthetic", action="store_true", help="forward speed on random weights only")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.synthetic:
        return synthetic(args)

    from agentrt.engine import models

    if args.model in models.REGISTRY:
        path = models.ensure(args.model, args.dtype)
    else:
        path = models.resolve(args.model)
    sets = [s for s in args.sets.split(",") if s]
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(ALL_SYSTEMS)
    if unknown:
        parser.error(f"unknown systems {sorted(unknown)}; choose from {ALL_SYSTEMS}")
    k = args.k if args.k == "auto" else int(args.k)
    prompts = load_prompts(sets, args.limit)

    runners = {}
    for system in systems:
        t = time.perf_counter()
        if system.startswith("hf"):
            runners[system] = HFSystem(path, args.dtype, args.device, 10 if system == "hf-lookup" else None)
        else:
            spec = None if system == "plain" else system
            runners[system] = NativeSystem(str(path), args.dtype, args.device, spec, k, args.threads)
        print(f"loaded {system} in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    warm = [{"role": "user", "content": "Say hello."}]
    for runner in runners.values():
        runner.run(warm, 8)

    rows: list[Row] = []
    for i, (prompt_set, prompt) in enumerate(prompts):
        for system, runner in runners.items():
            row = runner.run(prompt["messages"], args.max_tokens)
            row.system, row.prompt_set, row.prompt_id = system, prompt_set, prompt["id"]
            rows.append(row)
            print(f"[{i + 1}/{len(prompts)}] {prompt['id']:10s} {system:10s} {row.new_tokens:4d} tok "
                  f"decode {max(row.new_tokens - 1, 0) / max(row.decode_s, 1e-9):6.1f} tok/s "
                  f"prefill {row.prefill_s:5.2f}s", file=sys.stderr)

    meta = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "model": args.model, "dtype": args.dtype,
            "device": args.device, "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "max_tokens": args.max_tokens, "systems": systems,
            "k": args.k, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        meta["cpu"] = torch.cuda.get_device_name()
    summary = summarise(rows, systems, sets)
    md = markdown(summary, meta)
    print(md)
    rows_out = [{**asdict(r), "token_ids": None} for r in rows]
    _write({"meta": meta, "summary": summary, "rows": rows_out}, md, args)
    for runner in runners.values():
        if isinstance(runner, NativeSystem):
            runner.engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
