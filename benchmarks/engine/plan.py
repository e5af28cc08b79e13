"""What one invocation runs (`Plan`), resolved from the command line and checked before any model
loads: systems and prompt sets, ``--drafter-config``, the served endpoint, vLLM and llama.cpp
being importable."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any

from .catalogue import (ALL_SYSTEMS, DEFAULT_SYSTEMS, DEFAULT_VLLM_SPEC, DESCRIPTIONS,
                        HEAD_SYSTEMS, INT8_SYSTEMS, LLAMACPP_SYSTEMS, TWIN_SYSTEMS)
from .common import PROMPT_DIR, PROMPT_SETS, VLLM_SYSTEMS

_NATIVE_FIXED_OPTIONS = ("dtype", "device", "drafter", "threads")
"""`NativeConfig` fields every native system sets itself."""


class BenchSetupError(Exception):
    """The benchmark cannot start as asked (missing vLLM, unreachable server, ...)."""


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


LLAMACPP_INSTALL_HINT = ("pip install llama-cpp-python (builds llama.cpp from source: a few "
                         "minutes, needs cmake and a C++ compiler)")


def llamacpp_missing() -> str | None:
    """Why the ``llamacpp`` system cannot run here (None when ``llama_cpp`` imports)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return f"llama_cpp is not importable ({exc}); {LLAMACPP_INSTALL_HINT}"
    return None


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
    known = set(NativeConfig.options()) - set(_NATIVE_FIXED_OPTIONS)
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
