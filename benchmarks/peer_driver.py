"""Run the program-shape suite on the peer system, spec-ptc, inside its own virtualenv.

``.venv-peer/bin/python -m benchmarks.peer_driver`` (started by `benchmarks.peer`) reads one job
per line on stdin and writes one result per line on stdout, both JSON. A job is one pattern:
the replay pieces of each scripted response, the token rate, the base tool latency, the tool
names and the context. The driver plays the pieces at the job's rate (token ``i`` of a response
at ``i / tokens_per_second`` after the response starts, as agentrt's `ReplayEngine` releases
them) into spec-ptc's `Speculator` the way spec-ptc's README wires a harness::

    ns.update(spec.hooks())
    with spec.turn(repl_locals=ns) as t:
        for delta in stream: t.feed(delta)
    exec(code, ns)

then runs the response's ```` ```repl ```` blocks in order (an exception ends its block, ``FINAL``
ends the run), as agentrt's agent does. A job's tools are either the suite's own
(`benchmarks.patterns`, called synchronously; a speculatable agentrt tool is registered
``speculatable=True, pure=True``, any other tool unmarked: never run early), or, for a job with
``sub_url`` (an OOLONG task), ``llm_query`` / ``llm_query_batched`` asking that OpenAI-compatible
sub-model, as agentrt's built-in tools do (a batch's prompts all at once).

``--own-harness`` runs each job through spec-ptc's own turn loop instead (``spec_ptc.Harness``
with an engine that plays the same pieces), to check that this driver costs the peer nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import io
import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from spec_ptc import Harness, Speculator

from .patterns import make_tools

_BLOCK = re.compile(r"```repl[ \t]*\n(.*?)\n```", re.S)


def sync_tool(func: Callable[..., Any]) -> Callable[..., Any]:
    """The suite's async tool as a plain function (its own event loop per call)."""

    @functools.wraps(func)
    def call(*args: Any, **kwargs: Any) -> Any:
        return asyncio.run(func(*args, **kwargs))

    return call


def paced(pieces: list[str], tokens_per_second: float) -> Iterator[str]:
    """Yield ``pieces[i]`` at ``i / tokens_per_second`` after the first is asked for."""
    start = time.perf_counter()
    for i, piece in enumerate(pieces):
        delay = start + i / tokens_per_second - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        yield piece


_ANSWER = "_final_answer"
_ANSWER_HELPERS = f"""
def FINAL(value):
    global {_ANSWER}
    {_ANSWER} = [value]

def FINAL_VAR(name):
    global {_ANSWER}
    {_ANSWER} = [globals()[name]]
"""
"""Defined in the namespace itself: a shadow's copy of them records into the shadow's copy of the
namespace, never into the real one."""


def _first_line(error: str | None) -> str | None:
    return error.splitlines()[0] if error else None


def job_tools(job: dict[str, Any]) -> list[tuple[str, Callable[..., Any], bool]]:
    """``(name, function, speculatable)`` of each tool of ``job``."""
    if job.get("sub_url"):
        return llm_tools(job["sub_url"], job["sub_model"], job.get("sub_max_tokens"))
    tools = make_tools(job["latency"])
    return [(name, sync_tool(tools[name].func), tools[name].speculate) for name in job["tools"]]


def llm_tools(url: str, model: str, max_tokens: int | None) -> list[tuple[str, Callable, bool]]:
    """``llm_query`` / ``llm_query_batched`` on an OpenAI-compatible server (``/v1`` URL)."""
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key="EMPTY", max_retries=0)

    def llm_query(prompt: str) -> str:
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": str(prompt)}],
            max_tokens=max_tokens, temperature=0.0)
        return reply.choices[0].message.content or ""

    def llm_query_batched(prompts: list[str]) -> list[str]:
        with ThreadPoolExecutor(max_workers=max(1, len(prompts))) as pool:
            return list(pool.map(llm_query, prompts))

    return [("llm_query", llm_query, True), ("llm_query_batched", llm_query_batched, True)]


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """One job through spec-ptc's Speculator as its README wires a harness."""
    spec = Speculator()
    for name, function, speculatable in job_tools(job):
        spec.tool(speculatable=speculatable, pure=speculatable, name=name,
                  batched=name.endswith("_batched"))(function)
    ns: dict[str, Any] = {"context": job["context"]}
    exec(_ANSWER_HELPERS, ns)
    ns.update(spec.hooks())
    turns: list[list[str | None]] = []
    started = time.perf_counter()
    try:
        for pieces in job["turns"]:
            text: list[str] = []
            with spec.turn(repl_locals=ns) as turn:
                for delta in paced(pieces, job["tokens_per_second"]):
                    text.append(delta)
                    turn.feed(delta)
            out, error = _run_blocks("".join(text), ns)
            spec.end_turn()
            turns.append([out, _first_line(error)])
            if _ANSWER in ns:
                break
        wall = time.perf_counter() - started
        stats = spec.stats()
        history = spec.bus.history
    finally:
        spec.close()
    answer = ns[_ANSWER][0] if _ANSWER in ns else None
    return {
        "pattern": job["pattern"], "wall_s": wall,
        "status": "final" if _ANSWER in ns else "max_turns",
        "answer": repr(answer), "turns": turns,
        "answer_text": None if _ANSWER not in ns else str(answer),
        "launched": stats["speculated"], "hits": stats["claimed"],
        "misses": sum(1 for e in history if e.kind == "claim_miss"),
        "wasted": stats["speculated"] - stats["claimed"],
    }


def _run_blocks(response: str, ns: dict[str, Any]) -> tuple[str, str | None]:
    """Execute the response's blocks in order, up to ``FINAL``: (printed output, last error)."""
    out, error = io.StringIO(), None
    for code in _BLOCK.findall(response):
        try:
            with contextlib.redirect_stdout(out):
                exec(code, ns)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        if _ANSWER in ns:
            break
    return out.getvalue(), error


class _ReplayEngine:
    """An engine for spec-ptc's `Harness`: plays the job's pieces, registers the suite's tools."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job

    def stream_main(self, pieces: list[str]) -> Iterator[str]:
        return paced(pieces, self.job["tokens_per_second"])

    def make_tools(self, registry: Any, bus: Any) -> None:
        for name, function, speculatable in job_tools(self.job):
            registry.register(name, function, speculatable=speculatable, pure=speculatable,
                              batched=name.endswith("_batched"))


def run_job_own_harness(job: dict[str, Any]) -> dict[str, Any]:
    """One pattern through spec-ptc's own turn loop (`Harness`, mode "spec")."""
    engine = _ReplayEngine(job)
    harness = Harness(engine, "spec", context=job["context"])
    exec(_ANSWER_HELPERS, harness.repl.locals)
    started = time.perf_counter()
    try:
        for pieces in job["turns"]:
            harness.run_turn(engine.stream_main(pieces))
            if _ANSWER in harness.repl.locals:
                break
        wall = time.perf_counter() - started
    finally:
        harness.launcher.shutdown()
    answer = harness.repl.locals.get(_ANSWER, [None])[0]
    return {"pattern": job["pattern"], "wall_s": wall, "answer": repr(answer)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peer_driver",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--own-harness", action="store_true",
                        help="run the jobs through spec_ptc.Harness instead")
    args = parser.parse_args(argv)
    run = run_job_own_harness if args.own_harness else run_job
    channel, sys.stdout = sys.stdout, sys.stderr  # stray prints must not reach the channel
    channel.write(json.dumps({"ready": True}) + "\n")
    channel.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        try:
            result = run(job)
        except Exception as exc:
            result = {"pattern": job.get("pattern"), "error": f"{type(exc).__name__}: {exc}"}
        channel.write(json.dumps(result) + "\n")
        channel.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
