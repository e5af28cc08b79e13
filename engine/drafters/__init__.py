"""Drafters for speculative decoding, one file each: n-gram prompt lookup, suffix automaton,
and a small draft model (imported lazily; it needs the model code)."""

from .base import Draft, Drafter, DrafterDefaults, DrafterState, DraftSampling, DraftSlots
from .ngram import NgramDrafter
from .suffix import SuffixDrafter

__all__ = ["Draft", "DraftSampling", "DraftSlots", "Drafter", "DrafterDefaults", "DrafterState",
           "NgramDrafter", "SuffixDrafter", "ModelDrafter"]


def __getattr__(name: str):
    if name == "ModelDrafter":
        from .model import ModelDrafter

        return ModelDrafter
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
