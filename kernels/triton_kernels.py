"""Triton kernels for the verification hot path, matching `reference` decision for decision.

Three kernels, one program per batch row (or per (row, position) for the argmax):

* ``_argmax_rows_kernel`` + ``_greedy_accept_kernel``: greedy verification;
* ``_stochastic_accept_kernel``: the accept/reject scan over the k draft positions;
* ``_residual_sample_kernel``: the token after the accepted prefix, drawn by inverse CDF from the
  residual ``max(0, p - q)`` (or ``p`` minus the drafted token, or ``p`` itself for the bonus
  token and for plain sampling).

The vocabulary is processed in blocks of ``BLOCK_V`` so any V fits. CDFs are accumulated in
float64, like the reference, which makes the sampled index independent of summation order in
all but vanishingly rare rounding ties. On CPU these kernels only run under ``TRITON_INTERPRET=1``
(set before this module is imported); the public dispatch in `agentrt.kernels` uses them for CUDA
tensors only.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from . import reference

__all__ = ["greedy_verify", "stochastic_verify", "sample"]

MAX_BLOCK_V = 2048

_MODE_SAMPLE = 0  # draw from p (bonus token, plain sampling)
_MODE_RESIDUAL = 1  # draw from max(0, p - q) at the rejected position
_MODE_DROP_DRAFTED = 2  # deterministic draft: draw from p without the rejected token


@triton.jit
def _argmax_rows_kernel(x_ptr, out_ptr, V, row_stride, BLOCK_V: tl.constexpr):
    """out[row] = first index of the maximum of x[row, :V]."""
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * row_stride
    offs = tl.arange(0, BLOCK_V)
    block = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    best_val = tl.max(block, axis=0)
    best_idx = tl.argmax(block, axis=0).to(tl.int64)
    for start in range(BLOCK_V, V, BLOCK_V):
        cols = start + offs
        block = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        block_max = tl.max(block, axis=0)
        block_idx = start + tl.argmax(block, axis=0).to(tl.int64)
        better = block_max > best_val  # strict: earlier blocks win ties
        best_idx = tl.where(better, block_idx, best_idx)
        best_val = tl.where(better, block_max, best_val)
    tl.store(out_ptr + row, best_idx)


@triton.jit
def _greedy_accept_kernel(
    draft_ptr, argmax_ptr, num_accepted_ptr, next_ptr, K, BLOCK_K: tl.constexpr
):
    """Longest prefix where draft == argmax; next token = argmax at that position."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    in_draft = offs < K
    drafted = tl.load(draft_ptr + row * K + offs, mask=in_draft, other=-1)
    target = tl.load(argmax_ptr + row * (K + 1) + offs, mask=in_draft, other=-2)
    keep = (drafted == target) & in_draft
    num_accepted = tl.min(tl.where(keep, BLOCK_K, offs), axis=0).to(tl.int64)
    tl.store(num_accepted_ptr + row, num_accepted)
    tl.store(next_ptr + row, tl.load(argmax_ptr + row * (K + 1) + num_accepted))


@triton.jit
def _stochastic_accept_kernel(
    draft_ptr, target_ptr, draft_probs_ptr, uniforms_ptr, num_accepted_ptr,
    K, threshold, t_row, t_pos, q_row, q_pos,
    HAS_DRAFT_PROBS: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """num_accepted[row] = first i with not ((threshold * u_i) * q_i(x_i) < p_i(x_i)), else K."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    in_draft = offs < K
    tokens = tl.load(draft_ptr + row * K + offs, mask=in_draft, other=0)
    p = tl.load(target_ptr + row * t_row + offs * t_pos + tokens, mask=in_draft, other=0.0)
    if HAS_DRAFT_PROBS:
        q = tl.load(draft_probs_ptr + row * q_row + offs * q_pos + tokens, mask=in_draft, other=1.0)
    else:
        q = tl.full([BLOCK_K], 1.0, tl.float32)
    u = tl.load(uniforms_ptr + row * K + offs, mask=in_draft, other=1.0)
    accepted = (threshold * u) * q < p
    keep = accepted & in_draft
    num_accepted = tl.min(tl.where(keep, BLOCK_K, offs), axis=0).to(tl.int64)
    tl.store(num_accepted_ptr + row, num_accepted)


@triton.jit
def _load_block(p_base, q_base, cols, V, drafted, rejected_token, MODE: tl.constexpr):
    """(p, residual weights) for one block of the vocabulary, both float32, zero past V."""
    in_vocab = cols < V
    p = tl.load(p_base + cols, mask=in_vocab, other=0.0).to(tl.float32)
    if MODE == 1:
        q_limit = tl.where(drafted, V, 0)  # no q row at the bonus position
        q = tl.load(q_base + cols, mask=cols < q_limit, other=0.0).to(tl.float32)
        residual = tl.where(drafted, tl.maximum(p - q, 0.0), p)
    elif MODE == 2:
        residual = tl.where(drafted & (cols == rejected_token), 0.0, p)
    else:
        residual = p
    return p, residual


@triton.jit
def _cdf_block(p, residual, cols, V, use_residual, carry, target):
    """Count CDF entries <= target in this block; last positive column; block mass (float64)."""
    weights = tl.where(use_residual, residual, p).to(tl.float64)
    cdf = tl.cumsum(weights, axis=0) + carry
    count = tl.sum(((cdf <= target) & (cols < V)).to(tl.int64), axis=0)
    last_positive = tl.max(tl.where(weights > 0, cols, -1), axis=0)
    return count, last_positive, tl.sum(weights, axis=0)


@triton.jit
def _residual_sample_kernel(
    target_ptr, draft_probs_ptr, draft_ptr, num_accepted_ptr, uniforms_ptr, out_ptr,
    K, V, t_row, t_pos, q_row, q_pos,
    MODE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """Inverse-CDF draw at position num_accepted[row] from the residual (see module doc)."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.load(num_accepted_ptr + row).to(tl.int64)
    drafted = n < K
    at = tl.maximum(tl.minimum(n, K - 1), 0)
    p_base = target_ptr + row * t_row + n * t_pos
    q_base = draft_probs_ptr + row * q_row + at * q_pos
    rejected_token = n * 0 - 1
    if MODE == 2:
        rejected_token = tl.load(draft_ptr + row * K + at, mask=drafted, other=-1).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)

    # Pass 1: masses of the residual and of p (the fallback when the residual is empty).
    p, residual = _load_block(p_base, q_base, offs, V, drafted, rejected_token, MODE)
    residual_mass = tl.sum(residual.to(tl.float64), axis=0)
    p_mass = tl.sum(p.to(tl.float64), axis=0)
    for start in range(BLOCK_V, V, BLOCK_V):
        p, residual = _load_block(p_base, q_base, start + offs, V, drafted, rejected_token, MODE)
        residual_mass += tl.sum(residual.to(tl.float64), axis=0)
        p_mass += tl.sum(p.to(tl.float64), axis=0)
    use_residual = residual_mass > 0
    total = tl.where(use_residual, residual_mass, p_mass)
    target = tl.load(uniforms_ptr + row).to(tl.float64) * total

    # Pass 2: index = #(cdf <= target), clamped to the last column with positive weight.
    p, residual = _load_block(p_base, q_base, offs, V, drafted, rejected_token, MODE)
    count, last_positive, carry = _cdf_block(p, residual, offs, V, use_residual, total * 0.0, target)
    for start in range(BLOCK_V, V, BLOCK_V):
        cols = start + offs
        p, residual = _load_block(p_base, q_base, cols, V, drafted, rejected_token, MODE)
        block_count, block_last, block_mass = _cdf_block(
            p, residual, cols, V, use_residual, carry, target
        )
        count += block_count
        last_positive = tl.maximum(last_positive, block_last)
        carry += block_mass
    token = tl.maximum(tl.minimum(count, last_positive.to(tl.int64)), 0)
    tl.store(out_ptr + row, token)


def greedy_verify(
    draft_ids: torch.Tensor, target_logits: torch.Tensor, *, block_v: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `reference.greedy_verify`."""
    reference.check_verify_args(draft_ids, target_logits, "target_logits")
    batch, k = draft_ids.shape
    vocab = target_logits.shape[-1]
    device = target_logits.device
    if batch == 0:
        empty = torch.empty(0, dtype=torch.long, device=device)
        return empty, empty.clone()
    logits = _kernel_float(target_logits).contiguous().view(batch * (k + 1), vocab)
    target_ids = torch.empty(batch * (k + 1), dtype=torch.long, device=device)
    with _on_device(device):
        _argmax_rows_kernel[(batch * (k + 1),)](
            logits, target_ids, vocab, logits.stride(0), BLOCK_V=_block_v(vocab, block_v)
        )
        target_ids = target_ids.view(batch, k + 1)
        if k == 0:
            return torch.zeros(batch, dtype=torch.long, device=device), target_ids[:, 0].clone()
        num_accepted = torch.empty(batch, dtype=torch.long, device=device)
        next_token = torch.empty(batch, dtype=torch.long, device=device)
        _greedy_accept_kernel[(batch,)](
            draft_ids.contiguous(), target_ids, num_accepted, next_token, k,
            BLOCK_K=triton.next_power_of_2(k + 1),
        )
    return num_accepted, next_token


def stochastic_verify(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    residual_uniforms: torch.Tensor,
    threshold: float = 1.0,
    *,
    block_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `reference.stochastic_verify`."""
    reference.check_verify_args(
        draft_ids, target_probs, "target_probs", draft_probs, uniforms, residual_uniforms
    )
    reference.check_threshold(threshold)
    batch, k = draft_ids.shape
    vocab = target_probs.shape[-1]
    device = target_probs.device
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)
    next_token = torch.empty(batch, dtype=torch.long, device=device)
    if batch == 0:
        return num_accepted, next_token
    p = target_probs.float().contiguous()
    q = draft_probs.float().contiguous() if draft_probs is not None else None
    ids = draft_ids.contiguous()
    with _on_device(device):
        if k > 0:
            _stochastic_accept_kernel[(batch,)](
                ids, p, q if q is not None else p, uniforms.float().contiguous(), num_accepted,
                k, float(threshold), p.stride(0), p.stride(1),
                q.stride(0) if q is not None else 0, q.stride(1) if q is not None else 0,
                HAS_DRAFT_PROBS=q is not None, BLOCK_K=triton.next_power_of_2(k + 1),
            )
            mode = _MODE_RESIDUAL if q is not None else _MODE_DROP_DRAFTED
        else:
            mode = _MODE_SAMPLE
        _residual_sample_kernel[(batch,)](
            p, q if q is not None else p, ids if k > 0 else num_accepted, num_accepted,
            residual_uniforms.float().contiguous(), next_token,
            k, vocab, p.stride(0), p.stride(1),
            q.stride(0) if q is not None else 0, q.stride(1) if q is not None else 0,
            MODE=mode, BLOCK_V=_block_v(vocab, block_v),
        )
    return num_accepted, next_token


def sample(
    probs: torch.Tensor, uniforms: torch.Tensor, *, block_v: int | None = None
) -> torch.Tensor:
    """Triton version of `reference.sample`."""
    if probs.dim() != 2:
        raise ValueError(f"probs must be [B, V], got shape {tuple(probs.shape)}")
    if uniforms.shape != probs.shape[:1]:
        raise ValueError(f"uniforms must be [B]={tuple(probs.shape[:1])}, got {tuple(uniforms.shape)}")
    batch, vocab = probs.shape
    device = probs.device
    out = torch.empty(batch, dtype=torch.long, device=device)
    if batch == 0:
        return out
    p = probs.float().contiguous()
    zeros = torch.zeros(batch, dtype=torch.long, device=device)
    with _on_device(device):
        _residual_sample_kernel[(batch,)](
            p, p, zeros, zeros, uniforms.float().contiguous(), out,
            0, vocab, p.stride(0), 0, 0, 0,
            MODE=_MODE_SAMPLE, BLOCK_V=_block_v(vocab, block_v),
        )
    return out


def _block_v(vocab: int, block_v: int | None) -> int:
    if block_v is not None:
        if block_v < 16 or block_v & (block_v - 1):
            raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
        return block_v
    return max(16, min(triton.next_power_of_2(vocab), MAX_BLOCK_V))


def _kernel_float(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float16, torch.bfloat16) else x.float()


def _on_device(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
