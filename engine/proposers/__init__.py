"""Drafters for speculative decoding, one file each: n-gram prompt lookup, suffix automaton,
and a small draft model (imported lazily; it needs the model code)."""

from .base import Draft, DraftSampling, Proposer, ProposerState
from .ngram import NgramProposer
from .suffix import SuffixProposer

__all__ = ["Draft", "DraftSampling", "Proposer", "ProposerState", "NgramProposer", "SuffixProposer", "DraftModelProposer"]


def __getattr__(name: str):
    if name == "DraftModelProposer":
        from .draft import DraftModelProposer

        return DraftModelProposer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
