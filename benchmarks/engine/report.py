"""The markdown report of a run: one table per prompt set, the runs, the anchor's verdict and
the ratios (or bounds) against llama.cpp."""

from __future__ import annotations

from .catalogue import ANCHOR


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
    lines += system_info_lines(meta)
    lines += [""] if meta.get("system_info") else []
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


def system_info_lines(meta: dict) -> list[str]:
    """One line per system that said what it runs on (`Run.info`): its build and paths."""
    return [f"- `{system}`: " + "; ".join(f"{k}: {v}" for k, v in info.items())
            for system, info in meta.get("system_info", {}).items() if info]
