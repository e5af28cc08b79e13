"""Engines: the `Engine` protocol and its backends (native, vLLM, OpenAI-compatible, replay,
forced: scripted replies teacher-forced through the native engine).

Heavy backends are imported lazily, so ``import agentrt.engine`` stays cheap.
"""

from .base import (
    BaseEngine,
    Completion,
    Delta,
    Engine,
    EngineError,
    EngineStreamError,
    Message,
    SamplingParams,
    Usage,
    complete,
)
from .forced import ForcedEngine
from .metrics import DecodeMetrics
from .native_config import NativeConfig
from .replay import ReplayEngine

_LAZY = {
    "NativeEngine": ".native",
    "VLLMEngine": ".vllm_engine",
    "OpenAIEngine": ".openai_engine",
}

__all__ = [
    "BaseEngine", "Completion", "Delta", "Engine", "EngineError", "EngineStreamError", "Message",
    "SamplingParams", "Usage", "complete", "DecodeMetrics", "NativeConfig", "ReplayEngine",
    "ForcedEngine", *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
