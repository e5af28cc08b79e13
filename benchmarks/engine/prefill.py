"""``--prefill 512,2048,8190``: prefill speed at given prompt lengths, next to the matmul peak.

Every system runs alone in a process of its own (as the main benchmark does, llama.cpp before
the first pass, between passes and after the last): one warm-up, then for each length
``--prefill-repeats`` prompts (one above `LONG` tokens) of exactly that many chat-template
tokens (the repository's own text, a different stretch each time), each on a system that forgot the earlier ones (no prefix
cache, no reused KV), with ``max_tokens=1``: prefill = time to the first token. A system's
speed at a length is its best prompt in a run; across runs the table shows the median and the
range. Before the systems, ``benchmarks.matmul_peak`` (a process of its own, 512 rows: the
engine's prefill chunk) measures each GEMM path on the model's matrices; per length the table
then gives the FLOPs a prompt token costs (the layers' matmuls, and attention over the context
before it) and what share of the path's GEMM peak the system reached. Ratios against llama.cpp
come only when its own prefill speed held within ``--anchor-tolerance`` at every length over
its runs; otherwise each system's range against llama.cpp's range is printed.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from .catalogue import ANCHOR, AVX2_SYSTEMS, BF16_SYSTEMS, INT8_SYSTEMS
from .common import BENCHMARKS, child_env
from .report import system_info_lines

CORPUS = ("docs/engine.md", "engine/llama.py", "engine/native.py", "engine/scheduler.py",
          "docs/architecture.md", "README.md")
"""Text the prompts are cut from (relative to the repository root)."""
LONG = 4096
"""Prompts longer than this run once per length and run (each takes seconds)."""
PEAK_PATHS = {"exact": ("kernel-bf16-avx512", "kernel-bf16-avx2"), "avx2": ("kernel-bf16-avx2",),
              "bf16": ("kernel-bf16dot",),
              "int8": ("kernel-int8-vnni", "kernel-int8-avx2")}
"""The GEMM path a native precision runs, best first (`benchmarks.matmul_peak`'s names)."""


def lengths(value: str) -> list[int]:
    out = [int(v) for v in value.split(",") if v.strip()]
    if not out or min(out) < 16:
        raise ValueError(f"--prefill takes prompt lengths of at least 16 tokens, got {value!r}")
    return out


def prompts(tokenizer, sizes: list[int], repeats: int) -> list[tuple[str, dict]]:
    """``(set "prefill-<n>", prompt row)`` pairs: ``repeats`` prompts (one above `LONG`) of ``n``
    chat-template tokens for each ``n``, each from its own stretch of `CORPUS` (no two share a prefix beyond
    the chat template's)."""
    root = BENCHMARKS.parent
    text = "\n\n".join((root / name).read_text() for name in CORPUS)
    ids = tokenizer.encode(text)
    overhead = len(tokenizer.encode_chat([{"role": "user", "content": ""}]))
    out, start = [], 0
    for n in sizes:
        for r in range(repeats if n <= LONG else 1):
            take = n - overhead
            for _ in range(8):  # decoding then encoding again may merge tokens: adjust
                if start + take > len(ids):
                    start = (start * 7 + 101) % max(1, len(ids) - take)
                messages = [{"role": "user", "content": tokenizer.decode(ids[start:start + take])}]
                got = len(tokenizer.encode_chat(messages))
                if got == n:
                    break
                take += n - got
            out.append((f"prefill-{n}", {"id": f"{n}-{r}", "messages": messages}))
            start += take
    return out


def flops_per_token(cfg, context: float) -> tuple[float, float]:
    """(layer matmuls, attention) FLOPs of one prompt token that attends to ``context``
    positions (scores and value mix over every head)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    e, i = cfg.hidden_size, cfg.intermediate_size
    weights = e * (q + 2 * kv) + q * e + 2 * e * i + i * e
    return 2.0 * weights * cfg.num_layers, 4.0 * q * context * cfg.num_layers


def matmul_peak(threads: int | None) -> dict:
    """`benchmarks.matmul_peak` at 512 rows in a process of its own: its JSON record."""
    with tempfile.TemporaryDirectory(prefix="matmul-peak-") as tmp:
        out = Path(tmp) / "peak.json"
        command = [sys.executable, "-m", "benchmarks.matmul_peak", "--rows", "512",
                   "--json", str(out), *(["--threads", str(threads)] if threads else [])]
        subprocess.run(command, env=child_env(), check=True)
        return json.loads(out.read_text())


def layer_gflops(peak: dict) -> dict[str, float]:
    """Per GEMM path, its GFLOP/s over one layer's four matrices (FLOP-weighted: total FLOPs
    over total time); ``"machine"`` takes the best path of each matrix."""
    by_path: dict[str, list[tuple[float, float]]] = {}
    for record in peak["records"]:
        n, k = (int(v) for v in record["matrix"].split()[-1].split("x"))
        flops = 2.0 * record["rows"] * n * k
        for name, g in [*record["gflops"].items(), ("machine", max(record["gflops"].values()))]:
            by_path.setdefault(name, []).append((flops, flops / (g * 1e9)))
    return {name: sum(f for f, _ in v) / sum(t for _, t in v) / 1e9 for name, v in by_path.items()}


def system_peak(system: str, gflops: dict[str, float]) -> tuple[str, float] | None:
    """The GEMM path ``system`` runs and its peak, for the native systems."""
    kind = ("int8" if system in INT8_SYSTEMS else "bf16" if system in BF16_SYSTEMS
            else "avx2" if system in AVX2_SYSTEMS else None if system == ANCHOR else "exact")
    for name in PEAK_PATHS.get(kind, ()):
        if name in gflops:
            return name, gflops[name]
    return None


def summarise(runs, sizes: list[int], cfg, gflops: dict[str, float], tolerance: float) -> dict:
    """Per length and system: prompt tokens, tok/s per run (each run's best prompt), the median
    and range, GFLOP/s reached and its share of the GEMM peaks, and the ratio against
    llama.cpp (or, with an unsteady anchor, the bounds)."""
    out: dict = {"lengths": {}, "anchor": {}}
    steady = True
    for n in sizes:
        per: dict = {}
        for run in runs:
            mine = [r for r in run.rows if r.prompt_set == f"prefill-{n}"]
            if not mine:
                continue
            best = min(mine, key=lambda r: r.prefill_s)
            entry = per.setdefault(run.system, {"tokens": best.prompt_tokens, "runs": []})
            entry["runs"].append(best.prompt_tokens / best.prefill_s)
        gemm, attention = flops_per_token(cfg, (n - 1) / 2)
        for system, entry in per.items():
            speeds = entry["runs"]
            entry["median"], entry["range"] = statistics.median(speeds), (min(speeds), max(speeds))
            entry["gflops"] = entry["median"] * (gemm + attention) / 1e9
            entry["gemm_gflops"] = entry["median"] * gemm / 1e9
            path = system_peak(system, gflops)
            if path:
                entry["path"], entry["of_path_peak"] = path[0], entry["gemm_gflops"] / path[1]
            if "machine" in gflops:
                entry["of_machine_peak"] = entry["gemm_gflops"] / gflops["machine"]
        anchor = per.get(ANCHOR)
        if anchor and len(anchor["runs"]) >= 2:
            spread = (max(anchor["runs"]) - min(anchor["runs"])) / max(anchor["runs"])
            out["anchor"][n] = spread
            steady &= spread <= tolerance
        out["lengths"][n] = {"flops_per_token": {"gemm": gemm, "attention": attention}, "systems": per}
    out["anchor_ok"] = bool(out["anchor"]) and steady
    for n, entry in out["lengths"].items():
        anchor = entry["systems"].get(ANCHOR)
        for system, e in entry["systems"].items():
            if anchor is None or system == ANCHOR:
                continue
            if out["anchor_ok"]:
                e["x_llamacpp"] = e["median"] / anchor["median"]
            else:
                e["x_llamacpp_bounds"] = (e["range"][0] / anchor["range"][1],
                                          e["range"][1] / anchor["range"][0])
    return out


def markdown(summary: dict, meta: dict) -> str:
    """The tables: one line per length and system."""
    g = meta.get("gemm_gflops", {})
    order = ", ".join(r["system"] for r in meta["runs"])
    lines = [f"# Prefill ({meta['time']})", "",
             (f"model `{meta['model']}` {meta['dtype']}, {meta['threads']} threads, load average "
              f"{meta['load_before']} -> {meta['load_after']}; every run alone in its process "
              f"({order})."), ""]
    if g:
        lines += ["GEMM peak at 512 rows (`benchmarks.matmul_peak`, one layer's matrices, "
                  "GFLOP/s): " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(g.items())) + ".",
                  f"MKL: {meta['isas'].get('mkl')}; oneDNN: {meta['isas'].get('onednn')}.", ""]
    lines += system_info_lines(meta)
    lines += ["", ("| tokens | system | tok/s (median) | runs | x llama.cpp | GFLOP/s "
                   "(matmul + attention) | matmul share of its path's peak | of the machine's peak |"),
              "|---|---|---|---|---|---|---|---|"]
    for entry in summary["lengths"].values():
        for system, e in entry["systems"].items():
            ratio = (f"{e['x_llamacpp']:.2f}" if "x_llamacpp" in e else
                     "{:.2f}-{:.2f}".format(*e["x_llamacpp_bounds"]) if "x_llamacpp_bounds" in e
                     else "-")
            path = (f"{e['of_path_peak']:.0%} ({e['path']})" if "path" in e else "-")
            machine = f"{e['of_machine_peak']:.0%}" if "of_machine_peak" in e else "-"
            runs = ", ".join(f"{v:.0f}" for v in e["runs"])
            lines.append(f"| {e['tokens']} | {system} | {e['median']:.0f} | {runs} | {ratio} | "
                         f"{e['gflops']:.1f} | {path} | {machine} |")
    spreads = ", ".join(f"{n}: {v:.1%}" for n, v in summary["anchor"].items())
    lines += ["", (f"llama.cpp's prefill speed over its runs spread {spreads} (tolerance "
                   f"{meta['anchor_tolerance']:.0%}): "
                   + ("steady, ratios are medians over medians." if summary["anchor_ok"] else
                      "ratios withheld; bounds are each system's slowest run over llama.cpp's "
                      "fastest .. its fastest over llama.cpp's slowest.")) if spreads else "", ""]
    return "\n".join(lines)
