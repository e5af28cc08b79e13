"""The ``agentrt`` command line: run a task, serve a model, manage models, run the demo and
benchmarks."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from agentrt.tools.errors import ToolError

from . import __version__
from .engine_options import ENGINE_KINDS, EngineOptions, make_engine, parse_drafter_config


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that pick a model and its decoding (``run`` and ``serve``)."""
    parser.add_argument("--model", default="smollm2-135m",
                        help="a pulled model name or a local Hugging Face model directory")
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    parser.add_argument("--drafter-config",
                        help="drafter settings as a JSON object: for native, {\"method\": drafter, "
                             "...NativeConfig fields}; for vllm, its speculative_config")
    parser.add_argument("--spec-config", dest="drafter_config", help=argparse.SUPPRESS)  # former name


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that select a backend (shared with the benchmark runner)."""
    parser.add_argument("--engine", choices=ENGINE_KINDS, default="native")
    add_model_arguments(parser)
    parser.add_argument("--base-url", help="for --engine openai: the server's /v1 URL")
    parser.add_argument("--replay-file", help="for --engine replay: JSON list of responses")
    parser.add_argument("--tokens-per-second", type=float, default=50.0,
                        help="for --engine replay: streaming rate")


def engine_options(args: argparse.Namespace) -> EngineOptions:
    return EngineOptions(
        kind=args.engine, model=args.model, dtype=args.dtype, base_url=args.base_url,
        drafter_config=parse_drafter_config(args.drafter_config), replay_file=args.replay_file,
        tokens_per_second=args.tokens_per_second,
    )


def _cmd_run(args: argparse.Namespace) -> int:
    import anyio

    context = None
    if args.context_file:
        text = Path(args.context_file).read_text()
        context = json.loads(text) if args.context_file.endswith(".json") else text
    tools = []
    if args.tools:
        from .tool_modules import load_tool_module

        for name in args.tools:
            tools.extend(load_tool_module(name))
    result = anyio.run(_run_agent, args, context, tools)
    for turn in result.turns:
        print(f"--- turn {turn.index + 1} ---\n{turn.response}")
        if turn.observation:
            print(f"--- observation ---\n{turn.observation}")
    print(f"status: {result.status}  wall: {result.wall_s:.2f}s")
    if result.error:
        print(f"error: {result.error}")
    print(f"answer: {result.answer!r}")
    if args.trace:
        result.trace.save(args.trace)
        print(f"trace written to {args.trace}")
    if args.trace_out:
        from .trace import save_chrome_trace

        save_chrome_trace(result.trace, args.trace_out, name=f"agentrt run: {args.task[:60]}")
        print(f"trace (open in ui.perfetto.dev or chrome://tracing) written to {args.trace_out}")
    return 0 if result.ok else 1


async def _run_agent(args: argparse.Namespace, context, tools: list):
    """Connect the MCP servers, run the agent, disconnect: one event loop for all of it."""
    import contextlib

    from .agent import Agent

    async with contextlib.AsyncExitStack() as stack:
        if args.mcp or args.mcp_url:
            from agentrt.tools.mcp import mcp_tools

            for command in args.mcp or ():
                tools.extend(await stack.enter_async_context(mcp_tools(command)))
            for url in args.mcp_url or ():
                tools.extend(await stack.enter_async_context(mcp_tools(url=url)))
        engine = make_engine(engine_options(args))
        sub_engine = None
        if args.sub_base_url:
            from agentrt.engine import OpenAIEngine

            sub_engine = OpenAIEngine(base_url=args.sub_base_url, model=args.sub_model)
        agent = Agent(engine, tools=tools, sub_engine=sub_engine,
                      speculation=not args.no_speculation, max_turns=args.max_turns)
        return await agent.run(args.task, context)


def _cmd_serve(args: argparse.Namespace) -> int:
    from agentrt.engine import NativeEngine

    from .serve import serve
    from .serve_auth import API_KEY_ENV
    from .serve_limits import ServeLimits

    limits = ServeLimits(
        max_body_bytes=args.max_body_bytes, max_messages=args.max_messages,
        max_requests=args.max_requests, max_connections=args.max_connections,
        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    spec = dict(parse_drafter_config(args.drafter_config) or {})
    method = spec.pop("method", "suffix")
    engine = NativeEngine(model=args.model, dtype=args.dtype, drafter=method,
                          precision=args.precision, max_seq_len=args.max_seq_len,
                          seed=args.seed, **spec)
    name = args.served_model_name or Path(str(args.model)).name
    print(f"serving {name} ({args.dtype}, precision {args.precision}, drafter {method}) "
          f"at http://{args.host}:{args.port}/v1"
          f"{' (API key required)' if api_key else ''}")
    serve(engine, model_name=name, host=args.host, port=args.port, limits=limits,
          api_key=api_key)
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from agentrt.engine import models

    if args.models_cmd == "pull":
        paths = models.pull(args.name, dtypes=tuple(args.dtype), progress=True)
        for dtype, path in paths.items():
            print(f"{args.name} [{dtype}]: {path}")
        return 0
    rows = models.list_models()
    if not rows:
        print("no models pulled yet; run `agentrt models pull smollm2-135m`")
    for info in rows:
        state = "ok" if info.ok else "CORRUPT"
        print(f"{info.name:20} {info.dtype:5} {info.size / 1e6:8.1f} MB  {state}  {info.path}")
    return 0


def _cmd_draft(args: argparse.Namespace) -> int:
    if args.draft_cmd == "train":
        from agentrt.engine.eagle.train import train

        path = train(args.model, args.recipe, args.out, threads=args.threads,
                     resume=not args.restart)
        print(f"draft head for {args.model}: {path}")
        return 0
    from agentrt.engine.eagle.evaluate import evaluate, format_report

    report = evaluate(args.model, args.head, prompts=args.prompts, draft_tokens=args.draft_tokens,
                      max_tokens=args.max_tokens, precision=args.precision, threads=args.threads)
    print(format_report(report))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import main as demo_main

    return demo_main(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    """``python -m benchmarks.run ...`` in the current directory (a clone of the repository)."""
    if not Path("benchmarks", "run.py").is_file():
        print("the benchmarks live in the source repository: run this from a clone of agentrt",
              file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, "-m", "benchmarks.run", *args.rest])


def add_serve_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """``serve``'s API key and request / connection limits (defaults: `ServeLimits`)."""
    from .serve_limits import ServeLimits

    limits = ServeLimits()
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint "
                                          "but /health (default: $AGENTRT_API_KEY)")
    parser.add_argument("--max-body-bytes", type=int, default=limits.max_body_bytes,
                        help="largest request body; larger is a 413 (default %(default)s)")
    parser.add_argument("--max-messages", type=int, default=limits.max_messages,
                        help="most messages in one request; more is a 400 (default %(default)s)")
    parser.add_argument("--max-requests", type=int, default=limits.max_requests,
                        help="chat requests in progress at once; one more is a 503 with "
                             "Retry-After (default %(default)s)")
    parser.add_argument("--max-connections", type=int, default=limits.max_connections,
                        help="open HTTP connections (default %(default)s)")
    parser.add_argument("--header-timeout", type=float, default=limits.header_timeout_s,
                        help="seconds a connection has to send a request's headers "
                             "(default %(default)s)")
    parser.add_argument("--body-timeout", type=float, default=limits.body_timeout_s,
                        help="seconds to receive a request's body; slower is a 408 "
                             "(default %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="agentrt", description=__doc__)
    parser.add_argument("--version", action="version", version=f"agentrt {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run an agent on a task")
    run.add_argument("task")
    run.add_argument("--context-file", help="file whose text (or JSON, for .json) is `context`")
    run.add_argument("--max-turns", type=int, default=10)
    run.add_argument("--no-speculation", action="store_true",
                     help="run tool calls only when their block is complete")
    run.add_argument("--trace", help="write the run's trace (agentrt's event JSON) here")
    run.add_argument("--trace-out", metavar="PATH",
                     help="write the run's trace as Chrome trace-event JSON (opens in Perfetto)")
    run.add_argument("--mcp", action="append", metavar="COMMAND",
                     help="start an MCP server with this command line (stdio) and register "
                          "its tools (repeatable)")
    run.add_argument("--mcp-url", action="append", metavar="URL",
                     help="register the tools of the MCP server at this streamable-HTTP URL "
                          "(repeatable)")
    run.add_argument("--tools", action="append", metavar="MODULE",
                     help="import MODULE and register its @tool functions (repeatable)")
    run.add_argument("--sub-base-url",
                     help="OpenAI-compatible /v1 URL that answers llm_query (default: --engine)")
    run.add_argument("--sub-model", default="default",
                     help="model name sent to --sub-base-url")
    add_engine_arguments(run)
    run.set_defaults(func=_cmd_run)

    models = sub.add_parser("models", help="pull and list local models")
    msub = models.add_subparsers(dest="models_cmd", required=True)
    pull = msub.add_parser("pull", help="fetch and convert a model into the local cache")
    pull.add_argument("name", nargs="?", default="smollm2-135m")
    pull.add_argument("--dtype", action="append", choices=("bf16", "fp32"),
                      help="repeatable; default both")
    msub.add_parser("list", help="list pulled models")
    models.set_defaults(func=_cmd_models)

    draft = sub.add_parser("draft", help="train and evaluate a learned draft head for a model")
    dsub = draft.add_subparsers(dest="draft_cmd", required=True)
    dtrain = dsub.add_parser("train", help="self-distil a draft head (resumes an interrupted run)")
    dtrain.add_argument("--model", default="smollm2-135m")
    dtrain.add_argument("--recipe", default="default", choices=("default", "tiny"),
                        help="default: the head the engine uses; tiny: seconds, for tests")
    dtrain.add_argument("--out", help="head directory (default: the model cache's "
                                      "models/<model>/drafters/eagle)")
    dtrain.add_argument("--restart", action="store_true", help="start over instead of resuming")
    dtrain.add_argument("--threads", type=int, help="torch CPU threads")
    deval = dsub.add_parser("eval", help="acceptance per draft position on held-out prompts")
    deval.add_argument("--model", default="smollm2-135m")
    deval.add_argument("--head", help="head directory (default: the model cache's)")
    deval.add_argument("--prompts", type=int, default=24)
    deval.add_argument("--draft-tokens", type=int, default=6)
    deval.add_argument("--max-tokens", type=int, default=96)
    deval.add_argument("--precision", default="exact", choices=("exact", "int8"))
    deval.add_argument("--threads", type=int, help="torch CPU threads")
    draft.set_defaults(func=_cmd_draft)

    demo = sub.add_parser("demo", help="end-to-end demo on the native engine and SmolLM2")
    demo.add_argument("--no-speculation", action="store_true")
    demo.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    demo.set_defaults(func=_cmd_demo)

    srv = sub.add_parser("serve", help="an OpenAI-compatible server over the native engine")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    add_model_arguments(srv)
    srv.add_argument("--served-model-name", help="the name clients ask for (default: --model)")
    srv.add_argument("--precision", default="exact", choices=("exact", "int8"),
                     help="int8: faster CPU decode, logits close to but not equal to exact")
    srv.add_argument("--max-seq-len", type=int, default=4096)
    srv.add_argument("--seed", type=int, help="seeds requests that send no seed")
    add_serve_limit_arguments(srv)
    srv.set_defaults(func=_cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks (same as python -m benchmarks.run)")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "models_cmd", None) == "pull" and not args.dtype:
        args.dtype = ["bf16", "fp32"]
    try:
        return args.func(args)
    except (ValueError, OSError, ToolError) as exc:
        print(f"agentrt: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _interrupted()
    except BaseExceptionGroup as group:  # a Ctrl-C that reached a task group
        if group.subgroup(KeyboardInterrupt) is None:
            raise
        return _interrupted()


def _interrupted() -> int:
    """Ctrl-C: one line instead of a traceback, and the shell's exit status for SIGINT."""
    print("agentrt: interrupted (Ctrl-C)", file=sys.stderr)
    return 130


if __name__ == "__main__":
    sys.exit(main())
