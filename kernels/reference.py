"""Torch reference implementations of the verification hot path (any device, vectorised over V).

These define the semantics; the Triton kernels in `triton_kernels` reproduce them decision for
decision. Randomness always comes in as pre-drawn uniforms in ``[0, 1)``.

Conventions shared with the kernels:

* **Acceptance.** Draft token ``x`` at position ``i`` is accepted iff
  ``(threshold * u[i]) * q(x) < p(x)``, computed in float32 (``q(x) = 1`` for deterministic
  drafts). With ``threshold = 1`` this is exact rejection sampling (accept with probability
  ``min(1, p(x) / q(x))``); ``threshold < 1`` accepts more often and is lossy.
* **Inverse CDF.** Weights ``w`` (float32, unnormalised, non-negative) are accumulated in float64;
  the sampled index is the number of CDF entries ``<= u * total``, clamped to the last index with
  positive weight (so a zero-weight token is never chosen, even at rounding edges).
* **Residual.** After a rejection at position ``i`` the token is drawn from ``max(0, p - q)``
  (``p`` without the drafted token for deterministic drafts); if that has no mass, from ``p``.
"""

from __future__ import annotations

import torch

__all__ = [
    "probs_from_logits",
    "greedy_verify",
    "stochastic_verify",
    "sample",
    "sample_from_weights",
    "check_verify_args",
]


def probs_from_logits(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """Float32 probabilities over the last dim after temperature, then top-k, then top-p.

    Top-k keeps the ``top_k`` largest logits (0 disables it; ties broken by index). Top-p then keeps
    the smallest prefix of the sorted distribution whose mass reaches ``top_p`` (at least one token).
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0 (use greedy_verify for greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    scaled = logits.float() / temperature
    vocab = scaled.shape[-1]
    if (top_k == 0 or top_k >= vocab) and top_p >= 1.0:
        return torch.softmax(scaled, dim=-1)
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    if 0 < top_k < vocab:
        sorted_logits[..., top_k:] = float("-inf")
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    if top_p < 1.0:
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        sorted_probs = torch.where(mass_before < top_p, sorted_probs, torch.zeros_like(sorted_probs))
        sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(sorted_probs).scatter_(-1, order, sorted_probs)


def greedy_verify(
    draft_ids: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the longest draft prefix equal to the target argmax.

    Returns ``(num_accepted [B], next_token [B])``: ``next_token`` is the target argmax at the
    first mismatch, or at position ``k`` (the bonus token) when the whole draft was accepted.
    """
    check_verify_args(draft_ids, target_logits, "target_logits")
    k = draft_ids.shape[1]
    target_ids = target_logits.argmax(dim=-1)  # [B, k+1]
    matches = (draft_ids == target_ids[:, :k]).long()
    num_accepted = torch.cumprod(matches, dim=1).sum(dim=1)
    next_token = target_ids.gather(1, num_accepted[:, None]).squeeze(1)
    return num_accepted, next_token


def stochastic_verify(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    residual_uniforms: torch.Tensor,
    threshold: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection-sample a draft against the target (Leviathan et al. / Chen et al.).

    Token ``i`` is accepted while ``(threshold * uniforms[:, i]) * q(x_i) < p(x_i)``. At the first
    rejection the next token comes from the normalised residual ``max(0, p - q)`` (``p`` without
    ``x_i`` when ``draft_probs is None``); if everything was accepted it is the bonus token from
    ``target_probs[:, k]``. Returns ``(num_accepted [B], next_token [B])``.
    """
    check_verify_args(draft_ids, target_probs, "target_probs", draft_probs, uniforms, residual_uniforms)
    check_threshold(threshold)
    batch, k = draft_ids.shape
    p = target_probs.float()
    rows = torch.arange(batch, device=p.device)
    if k == 0:
        num_accepted = torch.zeros(batch, dtype=torch.long, device=p.device)
        return num_accepted, sample(p[:, 0], residual_uniforms)

    p_x = p[:, :k].gather(-1, draft_ids[..., None]).squeeze(-1)  # [B, k]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        q_x = draft_probs.float().gather(-1, draft_ids[..., None]).squeeze(-1)
    scaled_u = torch.tensor(threshold, dtype=torch.float32, device=p.device) * uniforms.float()
    accepted = (scaled_u * q_x < p_x).long()
    num_accepted = torch.cumprod(accepted, dim=1).sum(dim=1)

    drafted = num_accepted < k  # rows that stopped at a rejection (not the bonus position)
    at = num_accepted.clamp(max=k - 1)
    p_next = p[rows, num_accepted]  # [B, V]
    if draft_probs is None:
        rejected_token = draft_ids[rows, at]
        is_rejected = torch.arange(p.shape[-1], device=p.device)[None, :] == rejected_token[:, None]
        residual = p_next.masked_fill(is_rejected & drafted[:, None], 0.0)
    else:
        q_next = draft_probs.float()[rows, at]
        residual = torch.where(drafted[:, None], (p_next - q_next).clamp(min=0.0), p_next)
    has_mass = (residual > 0).any(dim=-1, keepdim=True)
    weights = torch.where(has_mass, residual, p_next)
    return num_accepted, sample_from_weights(weights, residual_uniforms)


def sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: one token per row of ``probs [B, V]`` from ``uniforms [B]``."""
    if probs.dim() != 2:
        raise ValueError(f"probs must be [B, V], got shape {tuple(probs.shape)}")
    if uniforms.shape != probs.shape[:1]:
        raise ValueError(f"uniforms must be [B]={tuple(probs.shape[:1])}, got {tuple(uniforms.shape)}")
    return sample_from_weights(probs.float(), uniforms)


def sample_from_weights(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling from non-negative, unnormalised float32 weights ``[B, V]``."""
    cdf = torch.cumsum(weights.to(torch.float64), dim=-1)
    target = uniforms.to(torch.float64) * cdf[:, -1]
    count = (cdf <= target[:, None]).sum(dim=-1)
    positions = torch.arange(weights.shape[-1], device=weights.device)
    last_positive = torch.where(weights > 0, positions, -1).amax(dim=-1)
    return torch.minimum(count, last_positive).clamp(min=0)


def check_threshold(threshold: float) -> None:
    """Reject acceptance thresholds outside ``(0, 1]``."""
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0, 1] (1.0 = exact), got {threshold}")


def check_verify_args(
    draft_ids: torch.Tensor,
    target: torch.Tensor,
    target_name: str,
    draft_probs: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
    residual_uniforms: torch.Tensor | None = None,
) -> None:
    """Validate the shapes shared by the verifiers, with messages that name the bad argument."""
    if draft_ids.dim() != 2:
        raise ValueError(f"draft_ids must be [B, k], got shape {tuple(draft_ids.shape)}")
    if draft_ids.dtype != torch.long:
        raise ValueError(f"draft_ids must be int64, got {draft_ids.dtype}")
    batch, k = draft_ids.shape
    if target.dim() != 3 or target.shape[0] != batch or target.shape[1] != k + 1:
        raise ValueError(
            f"{target_name} must be [B, k+1, V] = [{batch}, {k + 1}, V], got {tuple(target.shape)}"
        )
    vocab = target.shape[2]
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, k, vocab):
        raise ValueError(
            f"draft_probs must be [B, k, V] = [{batch}, {k}, {vocab}], got {tuple(draft_probs.shape)}"
        )
    if uniforms is not None and tuple(uniforms.shape) != (batch, k):
        raise ValueError(f"uniforms must be [B, k] = [{batch}, {k}], got {tuple(uniforms.shape)}")
    if residual_uniforms is not None and tuple(residual_uniforms.shape) != (batch,):
        raise ValueError(
            f"residual_uniforms must be [B] = [{batch}], got {tuple(residual_uniforms.shape)}"
        )
    named = {"draft_ids": draft_ids, "draft_probs": draft_probs, "uniforms": uniforms,
             "residual_uniforms": residual_uniforms}
    for name, tensor in named.items():
        if tensor is not None and tensor.device != target.device:
            raise ValueError(f"{name} is on {tensor.device} but {target_name} is on {target.device}")
