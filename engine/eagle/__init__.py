"""A learned draft head for the native engine (EAGLE-3's design): the head itself
(`DraftHead`, its directory format shared with vLLM's ``eagle3``), its self-distillation data
and training (`train`, ``agentrt draft train``) and its evaluation (`evaluate`)."""

from .head import DraftHead, HeadConfig, TargetMismatchError, check_target, head_dir

__all__ = ["DraftHead", "HeadConfig", "TargetMismatchError", "check_target", "head_dir"]
