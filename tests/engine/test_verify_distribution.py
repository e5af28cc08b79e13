"""Statistical tests: stochastic verification reproduces the target distribution exactly.

Synthetic target (p) and draft (q) distributions, B = 50_000 rows verified in one call. The
empirical distribution of the emitted tokens must approach p as the sample count grows, and at
the large count sit far closer to p than to unrelated random distributions.
"""

from __future__ import annotations

import math

import pytest
import torch

from agentrt.kernels import probs_from_logits, sample, stochastic_verify

SMALL, LARGE = 2_000, 50_000


def dirichlet(gen: torch.Generator, *shape: int, alpha: float = 1.0) -> torch.Tensor:
    """Random distributions over the last dim of ``shape``, reproducible from ``gen``."""
    with torch.random.fork_rng():
        torch.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
        return torch.distributions.Dirichlet(torch.full((shape[-1],), alpha)).sample(shape[:-1])


def filtered(gen: torch.Generator, setting: dict, *shape: int) -> torch.Tensor:
    """Distributions for one test setting: Dirichlet, or logits through temperature/top-k/top-p."""
    if setting["temperature"] is None:
        return dirichlet(gen, *shape)
    logits = torch.randn(*shape, generator=gen)
    return probs_from_logits(logits, setting["temperature"], setting["top_k"], setting["top_p"])


def histogram(tokens: torch.Tensor, cells: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=cells).double() / tokens.numel()


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a.double() - b.double()).abs().sum().item()


def noise_level(cells: int, n: int) -> float:
    """About 2.5x the expected TV of an n-sample histogram of ``cells`` outcomes (<= 0.4 sqrt(c/n))."""
    return math.sqrt(cells / n)


def verify_rows(gen, draft, draft_probs, target_probs, threshold=1.0):
    n, k = draft.shape
    uniforms = torch.rand(n, k, generator=gen)
    residual_uniforms = torch.rand(n, generator=gen)
    return stochastic_verify(draft, draft_probs, target_probs, uniforms, residual_uniforms, threshold)


def draw(gen: torch.Generator, probs: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs [n, V]`` (torch.multinomial, independent of our sampler)."""
    return torch.multinomial(probs, 1, generator=gen).squeeze(1)


def first_tokens(p, q, k, n, seed, threshold=1.0):
    """First emitted token per row. ``p [k+1, V]``, ``q [k, V]`` or None (deterministic drafts)."""
    gen = torch.Generator().manual_seed(seed)
    vocab = p.shape[-1]
    if q is None:
        # Deterministic drafts: fixed per row, chosen without looking at the verifier's randomness.
        draft = torch.randint(0, vocab, (n, k), generator=gen)
        draft_probs = None
    else:
        draft = torch.stack([draw(gen, q[i].expand(n, vocab)) for i in range(k)], dim=1)
        draft_probs = q.expand(n, k, vocab)
    num_accepted, next_token = verify_rows(gen, draft, draft_probs, p.expand(n, k + 1, vocab), threshold)
    return torch.where(num_accepted > 0, draft[:, 0], next_token)


SETTINGS = {
    "dirichlet": dict(temperature=None, draft=True),
    "temp0.7-topk8": dict(temperature=0.7, top_k=8, top_p=1.0, draft=True),
    "temp1.3-topp0.8": dict(temperature=1.3, top_k=0, top_p=0.8, draft=True),
    "temp1.0-topk12-topp0.9": dict(temperature=1.0, top_k=12, top_p=0.9, draft=True),
    "deterministic": dict(temperature=None, draft=False),
}


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_first_token_converges_to_target(name, k):
    setting = SETTINGS[name]
    vocab = 24
    gen = torch.Generator().manual_seed(1000 * k + len(name))
    p = filtered(gen, setting, k + 1, vocab)
    q = filtered(gen, setting, k, vocab) if setting["draft"] else None

    tv_small = tv(histogram(first_tokens(p, q, k, SMALL, seed=1), vocab), p[0])
    hist = histogram(first_tokens(p, q, k, LARGE, seed=2), vocab)
    tv_large = tv(hist, p[0])
    references = dirichlet(gen, 20, vocab)
    tv_reference = min(tv(hist, r) for r in references)

    assert tv_large < tv_small, (tv_small, tv_large)
    assert tv_large < noise_level(vocab, LARGE), tv_large
    assert tv_large < 0.2 * tv_reference, (tv_large, tv_reference)


def joint_first_two(p0, p1, rest_p, q0, q1, rest_q, k, n, seed):
    """(y0, y1) per row: the first two emitted tokens, with p1/q1 conditioned on the first token.

    Rows whose first draft token was rejected emitted only one token; their second token comes
    from a second verify step (a fresh one-token draft from q1[y0]), as in a decode loop.
    """
    gen = torch.Generator().manual_seed(seed)
    vocab = p0.shape[-1]
    deterministic = q0 is None
    if deterministic:
        x0 = torch.randint(0, vocab, (n,), generator=gen)
        x1 = (7 * x0 + 3) % vocab  # any function of the context
    else:
        x0 = draw(gen, q0.expand(n, vocab))
        x1 = draw(gen, q1[x0])
    if deterministic:
        rest = [torch.randint(0, vocab, (n,), generator=gen) for _ in range(k - 2)]
    else:
        rest = [draw(gen, rq.expand(n, vocab)) for rq in rest_q]
    draft = torch.stack([x0, x1, *rest], dim=1)
    target = torch.stack([p0.expand(n, vocab), p1[x0], *(rp.expand(n, vocab) for rp in rest_p)], dim=1)
    draft_probs = None if deterministic else torch.stack(
        [q0.expand(n, vocab), q1[x0], *(rq.expand(n, vocab) for rq in rest_q)], dim=1
    )
    num_accepted, next_token = verify_rows(gen, draft, draft_probs, target)

    y0 = torch.where(num_accepted > 0, x0, next_token)
    y1 = torch.where(num_accepted > 1, x1, next_token)
    first_rejected = num_accepted == 0
    m = int(first_rejected.sum())
    if m:
        y0r = y0[first_rejected]
        x = (7 * y0r + 3) % vocab if deterministic else draw(gen, q1[y0r])
        step_target = torch.stack([p1[y0r], p0.expand(m, vocab)], dim=1)
        step_q = None if deterministic else q1[y0r][:, None, :]
        acc, nxt = verify_rows(gen, x[:, None], step_q, step_target)
        y1[first_rejected] = torch.where(acc > 0, x, nxt)
    return y0 * vocab + y1


@pytest.mark.parametrize("k", [2, 3, 5])
@pytest.mark.parametrize("name", ["dirichlet", "temp0.7-topk8", "deterministic"])
def test_joint_of_first_two_tokens_matches_target(name, k):
    setting = SETTINGS[name]
    vocab = 12
    gen = torch.Generator().manual_seed(77 + k)
    p0 = filtered(gen, setting, vocab)
    p1 = filtered(gen, setting, vocab, vocab)  # p1[y0] = target distribution after y0
    rest_p = [filtered(gen, setting, vocab) for _ in range(k - 1)]  # positions 2..k (k = bonus)
    if setting["draft"]:
        q0 = filtered(gen, setting, vocab)
        q1 = filtered(gen, setting, vocab, vocab)
        rest_q = [filtered(gen, setting, vocab) for _ in range(k - 2)]
    else:
        q0 = q1 = None
        rest_q = []
    truth = (p0[:, None] * p1).reshape(-1)
    cells = vocab * vocab

    tv_small = tv(histogram(joint_first_two(p0, p1, rest_p, q0, q1, rest_q, k, SMALL, 3), cells), truth)
    hist = histogram(joint_first_two(p0, p1, rest_p, q0, q1, rest_q, k, LARGE, 4), cells)
    tv_large = tv(hist, truth)
    tv_reference = min(tv(hist, r) for r in dirichlet(gen, 20, cells))

    assert tv_large < tv_small, (tv_small, tv_large)
    assert tv_large < noise_level(cells, LARGE), tv_large
    assert tv_large < 0.2 * tv_reference, (tv_large, tv_reference)


def relaxed_first_token(p: torch.Tensor, q: torch.Tensor, threshold: float) -> torch.Tensor:
    """Closed form of the documented relaxed rule for the first emitted token."""
    accept = torch.clamp(p / (threshold * q), max=1.0)
    kept = q * accept
    residual = torch.clamp(p - q, min=0.0)
    return kept + (1.0 - kept.sum()) * residual / residual.sum()


@pytest.mark.parametrize("k", [1, 3])
def test_relaxed_threshold_is_lossy_and_follows_its_rule(k):
    vocab = 24
    gen = torch.Generator().manual_seed(5)
    p = dirichlet(gen, k + 1, vocab)
    q = dirichlet(gen, k, vocab)
    noise = noise_level(vocab, LARGE)

    exact = histogram(first_tokens(p, q, k, LARGE, seed=6, threshold=1.0), vocab)
    relaxed = histogram(first_tokens(p, q, k, LARGE, seed=6, threshold=0.5), vocab)

    assert tv(exact, p[0]) < noise
    assert tv(relaxed, p[0]) > 3 * noise, tv(relaxed, p[0])  # lossy: visibly not p
    assert tv(relaxed, relaxed_first_token(p[0], q[0], 0.5)) < noise  # ... but exactly as documented


def test_relaxed_threshold_accepts_more():
    vocab, k, n = 24, 4, LARGE
    gen = torch.Generator().manual_seed(9)
    p = dirichlet(gen, k + 1, vocab).expand(n, k + 1, vocab)
    q = dirichlet(gen, k, vocab).expand(n, k, vocab)
    draft = torch.stack([draw(gen, q[:, i]) for i in range(k)], dim=1)
    uniforms, residual = torch.rand(n, k, generator=gen), torch.rand(n, generator=gen)
    exact, _ = stochastic_verify(draft, q, p, uniforms, residual, 1.0)
    relaxed, _ = stochastic_verify(draft, q, p, uniforms, residual, 0.6)
    assert bool((relaxed >= exact).all())  # same uniforms: a relaxed rule never accepts less
    assert relaxed.float().mean() > exact.float().mean()


def test_sample_converges_to_probs():
    vocab = 32
    gen = torch.Generator().manual_seed(11)
    probs = dirichlet(gen, vocab)
    errors = []
    for n in (SMALL, LARGE):
        tokens = sample(probs.expand(n, vocab), torch.rand(n, generator=gen))
        errors.append(tv(histogram(tokens, vocab), probs))
    assert errors[1] < errors[0]
    assert errors[1] < noise_level(vocab, LARGE)
