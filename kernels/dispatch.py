"""Dispatch of the verification hot path: greedy and stochastic verify, sampling.

CUDA tensors run Triton kernels (`triton_kernels`, imported on first CUDA use, and only when
triton is importable); everything else runs the vectorised torch reference (`reference`). Both
make the same decisions for the same pre-drawn uniforms. `probs_from_logits` is plain torch on
every device, so top-k / top-p follow one rule everywhere.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import warnings
from types import ModuleType

import torch

from . import reference
from .reference import probs_from_logits

__all__ = [
    "probs_from_logits",
    "greedy_verify",
    "stochastic_verify",
    "sample",
    "triton_available",
    "backend_for",
]

_triton_module: ModuleType | None = None


@functools.cache
def triton_available() -> bool:
    """True when triton is installed and CUDA is available (the Triton path can run)."""
    return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None


def backend_for(tensor: torch.Tensor) -> str:
    """``"triton"`` or ``"torch"``: which implementation a call with ``tensor`` dispatches to."""
    usable = triton_available() and _triton_module is not reference
    return "triton" if tensor.is_cuda and usable else "torch"


def _backend(tensor: torch.Tensor) -> ModuleType:
    global _triton_module
    if backend_for(tensor) == "torch":
        return reference
    if _triton_module is None:
        try:
            _triton_module = importlib.import_module(".triton_kernels", __package__)
        except Exception as exc:  # a broken triton install must not stop decoding
            warnings.warn(f"Triton kernels unavailable ({exc!r}); using the torch reference on CUDA")
            _triton_module = reference
    return _triton_module


def greedy_verify(
    draft_ids: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: ``(num_accepted [B], next_token [B])``.

    ``draft_ids [B, k]`` (int64) is accepted up to the first position where it differs from
    ``argmax(target_logits [B, k+1, V])``; ``next_token`` is the target argmax there, or the bonus
    token at position ``k`` when all ``k`` were accepted. With ``k = 0`` it is just the argmax.
    """
    return _backend(target_logits).greedy_verify(draft_ids, target_logits)


def stochastic_verify(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    residual_uniforms: torch.Tensor,
    threshold: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless rejection-sampling verification: ``(num_accepted [B], next_token [B])``.

    Draft token ``x_i`` is accepted while ``(threshold * uniforms[:, i]) * q_i(x_i) < p_i(x_i)``
    (``q = draft_probs``, one-hot on the draft when ``None``; ``p = target_probs [B, k+1, V]``).
    The first rejected position emits a token drawn with ``residual_uniforms [B]`` from the
    normalised ``max(0, p - q)``; a fully accepted draft emits the bonus token from
    ``target_probs[:, k]``. ``threshold = 1.0`` is exact; ``threshold < 1.0`` accepts more and
    is lossy (see docs/speculative.md).
    """
    return _backend(target_probs).stochastic_verify(
        draft_ids, draft_probs, target_probs, uniforms, residual_uniforms, threshold
    )


def sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token id per row of ``probs [B, V]`` from ``uniforms [B]``."""
    return _backend(probs).sample(probs, uniforms)
