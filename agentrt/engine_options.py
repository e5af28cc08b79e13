"""Build an engine from command-line style options (used by the CLI and the benchmark runner)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentrt.engine.base import Engine
from agentrt.engine.drafter_config import parse_drafter_config

__all__ = ["ENGINE_KINDS", "EngineOptions", "make_engine", "parse_drafter_config"]

ENGINE_KINDS = ("native", "vllm", "openai", "replay")


@dataclass
class EngineOptions:
    """What selects and configures a backend."""

    kind: str = "native"
    model: str = "smollm2-135m"
    dtype: str = "bf16"
    base_url: str | None = None
    drafter_config: dict[str, Any] | None = None
    """Backend drafter settings: for native ``{"method": "suffix"|"ngram"|"draft"|null,
    "draft_tokens": "auto"|int, ...}`` (``method`` names the drafter, the rest are `NativeConfig`
    fields); for vllm, vLLM's ``speculative_config``."""
    replay_file: str | None = None
    """For ``replay``: a JSON file holding a list of response strings."""
    tokens_per_second: float = 50.0


def make_engine(opts: EngineOptions) -> Engine:
    """Construct the backend ``opts.kind`` describes."""
    if opts.kind == "native":
        from agentrt.engine import NativeEngine

        spec = dict(opts.drafter_config or {})
        method = spec.pop("method", "suffix")
        return NativeEngine(model=opts.model, dtype=opts.dtype, drafter=method, **spec)
    if opts.kind == "vllm":
        from agentrt.engine import VLLMEngine

        return VLLMEngine(model=opts.model, dtype=opts.dtype, speculative_config=opts.drafter_config)
    if opts.kind == "openai":
        from agentrt.engine import OpenAIEngine

        if not opts.base_url:
            raise ValueError("--engine openai needs --base-url (e.g. http://127.0.0.1:8000/v1)")
        return OpenAIEngine(base_url=opts.base_url, model=opts.model)
    if opts.kind == "replay":
        from agentrt.engine import ReplayEngine

        if not opts.replay_file:
            raise ValueError("--engine replay needs --replay-file (a JSON list of responses)")
        responses = json.loads(Path(opts.replay_file).read_text())
        return ReplayEngine(responses, tokens_per_second=opts.tokens_per_second)
    raise ValueError(f"unknown engine {opts.kind!r}; choose one of {', '.join(ENGINE_KINDS)}")
