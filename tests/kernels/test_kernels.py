"""Verification kernels: torch reference semantics, dispatch, and Triton parity.

The Triton kernels run under ``TRITON_INTERPRET=1`` in a subprocess (the variable must be set
before the kernels are defined) on small shapes and must make exactly the reference's decisions.
A second subprocess compiles them for a CUDA target (no GPU needed) to catch code that only the
interpreter accepts.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from agentrt import kernels
from agentrt.kernels import greedy_verify, probs_from_logits, sample, stochastic_verify

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def logits_with_argmax(argmax_rows: list[list[int]], vocab: int = 10) -> torch.Tensor:
    """Logits ``[B, k+1, V]`` whose argmax at each position is the given token."""
    ids = torch.tensor(argmax_rows)
    logits = torch.randn(*ids.shape, vocab, generator=torch.Generator().manual_seed(0))
    logits.scatter_(-1, ids[..., None], 10.0)
    return logits


# --- probs_from_logits ---------------------------------------------------------------------


def test_probs_from_logits_is_tempered_softmax_without_filters():
    logits = torch.randn(3, 5, 40, generator=torch.Generator().manual_seed(1))
    for temperature in (0.3, 1.0, 2.5):
        probs = probs_from_logits(logits, temperature)
        assert probs.dtype == torch.float32 and probs.shape == logits.shape
        torch.testing.assert_close(probs, torch.softmax(logits / temperature, dim=-1))


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    probs = probs_from_logits(logits, 1.0, top_k=5)
    assert ((probs > 0).sum(-1) == 5).all()
    kept = probs > 0
    assert torch.equal(kept, torch.zeros_like(kept).scatter(-1, logits.topk(5).indices, True))
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))


def test_top_p_keeps_smallest_prefix_reaching_the_mass():
    logits = torch.log(torch.tensor([0.125, 0.5, 0.125, 0.25]))
    assert torch.allclose(probs_from_logits(logits, 1.0, top_p=0.7), torch.tensor([0, 2 / 3, 0, 1 / 3]))
    three = probs_from_logits(logits, 1.0, top_p=0.8)
    assert (three > 0).tolist() == [True, True, False, True]  # ties broken by index
    one = probs_from_logits(logits, 1.0, top_p=1e-6)
    assert one.tolist() == [0.0, 1.0, 0.0, 0.0]  # always at least one token


def test_top_k_applies_before_top_p():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    probs = probs_from_logits(logits, 1.0, top_k=2, top_p=0.5)
    # after top-k: [4/7, 3/7]; top-p 0.5 keeps just the first
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("kwargs", [dict(temperature=0.0), dict(temperature=-1.0),
                                    dict(temperature=1.0, top_k=-1), dict(temperature=1.0, top_p=0.0)])
def test_probs_from_logits_rejects_bad_settings(kwargs):
    with pytest.raises(ValueError):
        probs_from_logits(torch.zeros(4), **kwargs)


# --- greedy_verify -------------------------------------------------------------------------


def test_greedy_all_accepted_emits_bonus_token():
    num, nxt = greedy_verify(torch.tensor([[3, 1, 4]]), logits_with_argmax([[3, 1, 4, 7]]))
    assert num.tolist() == [3] and nxt.tolist() == [7]


def test_greedy_first_token_rejected():
    num, nxt = greedy_verify(torch.tensor([[2, 1, 4]]), logits_with_argmax([[3, 1, 4, 7]]))
    assert num.tolist() == [0] and nxt.tolist() == [3]


def test_greedy_middle_rejection():
    num, nxt = greedy_verify(torch.tensor([[3, 1, 5, 9]]), logits_with_argmax([[3, 1, 4, 9, 2]]))
    assert num.tolist() == [2] and nxt.tolist() == [4]  # a later match does not count


def test_greedy_k0_returns_argmax():
    num, nxt = greedy_verify(torch.zeros(2, 0, dtype=torch.long), logits_with_argmax([[6], [2]]))
    assert num.tolist() == [0, 0] and nxt.tolist() == [6, 2]


def test_greedy_rows_are_independent():
    draft = torch.tensor([[1, 2], [1, 2], [5, 2]])
    logits = logits_with_argmax([[1, 2, 8], [1, 3, 8], [1, 2, 8]])
    num, nxt = greedy_verify(draft, logits)
    assert num.tolist() == [2, 1, 0] and nxt.tolist() == [8, 3, 1]


def test_greedy_rejects_bad_shapes():
    with pytest.raises(ValueError, match="target_logits"):
        greedy_verify(torch.zeros(1, 3, dtype=torch.long), torch.zeros(1, 3, 10))
    with pytest.raises(ValueError, match="int64"):
        greedy_verify(torch.zeros(1, 2, dtype=torch.int32), torch.zeros(1, 3, 10))


# --- sample and stochastic_verify ----------------------------------------------------------


def test_sample_is_inverse_cdf_and_skips_zero_probability_tokens():
    probs = torch.tensor([[0.25, 0.0, 0.25, 0.5, 0.0]]).expand(6, 5)
    uniforms = torch.tensor([0.0, 0.2, 0.25, 0.4999, 0.5, 0.99999994])
    assert sample(probs, uniforms).tolist() == [0, 0, 2, 2, 3, 3]


def test_sample_accepts_unnormalised_rows():
    assert sample(torch.tensor([[0.0, 2.0, 6.0]]), torch.tensor([0.3])).tolist() == [2]


def test_stochastic_accepts_everything_when_draft_equals_target():
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(64, 4, 10, generator=gen), dim=-1)
    draft = torch.multinomial(p[:, :3].reshape(-1, 10), 1, generator=gen).view(64, 3)
    uniforms, residual = torch.rand(64, 3, generator=gen), torch.rand(64, generator=gen)
    num, _ = stochastic_verify(draft, p[:, :3], p, uniforms, residual)
    assert (num == 3).all()  # p/q = 1 > u always


def test_stochastic_rejects_zero_probability_draft_and_uses_residual():
    p = torch.tensor([[[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]]])
    q = torch.tensor([[[1.0, 0.0, 0.0]]])
    num, nxt = stochastic_verify(torch.tensor([[0]]), q, p, torch.tensor([[0.0]]), torch.tensor([0.9]))
    assert num.tolist() == [0] and nxt.tolist() == [2]  # residual max(0, p - q) = [0, .5, .5]


def test_stochastic_bonus_token_comes_from_last_position():
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]])
    uniforms = torch.tensor([[0.9, 0.9]])
    num, nxt = stochastic_verify(torch.tensor([[1, 2]]), None, p, uniforms, torch.tensor([0.5]))
    assert num.tolist() == [2] and nxt.tolist() == [0]


def test_deterministic_draft_rejection_never_re_emits_the_draft_token():
    n = 2000
    gen = torch.Generator().manual_seed(4)
    p = torch.tensor([0.6, 0.3, 0.1]).expand(n, 2, 3)
    num, nxt = stochastic_verify(torch.zeros(n, 1, dtype=torch.long), None, p,
                                 torch.rand(n, 1, generator=gen), torch.rand(n, generator=gen))
    assert (nxt[num == 0] != 0).all()
    assert 0.55 < (num == 1).float().mean() < 0.65  # accepted with probability p(x) = 0.6


def test_stochastic_k0_just_samples():
    p = torch.tensor([[[0.0, 0.0, 1.0]]])
    no_draft = torch.zeros(1, 0, dtype=torch.long)
    num, nxt = stochastic_verify(no_draft, None, p, torch.zeros(1, 0), torch.tensor([0.3]))
    assert num.tolist() == [0] and nxt.tolist() == [2]


def test_stochastic_rejects_bad_arguments():
    draft = torch.zeros(2, 3, dtype=torch.long)
    p, q = torch.full((2, 4, 5), 0.2), torch.full((2, 3, 5), 0.2)
    u, r = torch.rand(2, 3), torch.rand(2)
    with pytest.raises(ValueError, match="threshold"):
        stochastic_verify(draft, q, p, u, r, threshold=0.0)
    with pytest.raises(ValueError, match="threshold"):
        stochastic_verify(draft, q, p, u, r, threshold=1.5)
    with pytest.raises(ValueError, match="draft_probs"):
        stochastic_verify(draft, q[:, :2], p, u, r)
    with pytest.raises(ValueError, match="uniforms"):
        stochastic_verify(draft, q, p, u[:, :2], r)
    with pytest.raises(ValueError, match="residual_uniforms"):
        stochastic_verify(draft, q, p, u, r[:1])
    with pytest.raises(ValueError, match="on meta"):
        stochastic_verify(draft, q, p, u.to("meta"), r)


def test_cpu_tensors_use_the_torch_reference():
    assert kernels.backend_for(torch.zeros(1)) == "torch"


# --- Triton: interpreter parity and CUDA compilation ---------------------------------------

PARITY_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch
    from agentrt.kernels import reference as ref, triton_kernels as tri

    gen = torch.Generator().manual_seed(int(sys.argv[1]))
    checked = mismatches = 0
    failures = []

    def compare(name, a, b):
        global checked, mismatches
        checked += 1
        a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
        if not all(torch.equal(x, y) for x, y in zip(a, b)):
            mismatches += 1
            failures.append([name, [x.tolist() for x in a], [y.tolist() for y in b]])

    shapes = [(1, 0, 7), (2, 1, 33), (3, 3, 50), (4, 5, 64), (4, 4, 17), (2, 5, 40)]
    for index, (batch, k, vocab) in enumerate(shapes):
        block = 16 if index % 2 else None  # several V blocks with a masked tail, or one block
        logits = 2.0 * torch.randn(batch, k + 1, vocab, generator=gen)
        greedy_ids = logits.argmax(-1)[:, :k]
        noise = torch.randint(0, vocab, (batch, k), generator=gen)
        draft = torch.where(torch.rand(batch, k, generator=gen) < 0.75, greedy_ids, noise)
        p = torch.softmax(logits, -1)
        p[:, :, :3] = 0.0  # zero-probability tokens exercise the residual edge cases
        p = p / p.sum(-1, keepdim=True)
        q = torch.softmax(2.0 * torch.randn(batch, k, vocab, generator=gen), -1)
        u = torch.rand(batch, k, generator=gen)
        r = torch.rand(batch, generator=gen)
        compare(f"greedy {batch}x{k}x{vocab}", ref.greedy_verify(draft, logits),
                tri.greedy_verify(draft, logits, block_v=block))
        compare(f"sample {batch}x{vocab}", ref.sample(p[:, 0], r), tri.sample(p[:, 0], r, block_v=block))
        for draft_probs in (q, None):
            for threshold in (1.0, 0.7):
                name = f"stochastic {batch}x{k}x{vocab} q={draft_probs is not None} t={threshold}"
                compare(name, ref.stochastic_verify(draft, draft_probs, p, u, r, threshold),
                        tri.stochastic_verify(draft, draft_probs, p, u, r, threshold, block_v=block))
    print(json.dumps({"checked": checked, "mismatches": mismatches, "failures": failures[:5]}))
    """
)


@needs_triton
@pytest.mark.timeout(600)
def test_triton_kernels_match_reference_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ""}
    proc = subprocess.run(
        [sys.executable, "-c", PARITY_SCRIPT, "7"], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["checked"] == 36
    assert result["mismatches"] == 0, result["failures"]


COMPILE_SCRIPT = textwrap.dedent(
    """
    import json
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from agentrt.kernels import triton_kernels as tri

    PROBS = {"target_ptr": "*fp32", "draft_probs_ptr": "*fp32", "draft_ptr": "*i64",
             "num_accepted_ptr": "*i64", "uniforms_ptr": "*fp32", "out_ptr": "*i64", "K": "i32",
             "V": "i32", "t_row": "i32", "t_pos": "i32", "q_row": "i32", "q_pos": "i32"}
    ACCEPT = {"draft_ptr": "*i64", "target_ptr": "*fp32", "draft_probs_ptr": "*fp32",
              "uniforms_ptr": "*fp32", "num_accepted_ptr": "*i64", "K": "i32", "threshold": "fp32",
              "t_row": "i32", "t_pos": "i32", "q_row": "i32", "q_pos": "i32"}
    cases = [
        (tri._argmax_rows_kernel, {"x_ptr": "*bf16", "out_ptr": "*i64", "V": "i32", "row_stride": "i32"},
         {"BLOCK_V": 256}),
        (tri._greedy_accept_kernel, {"draft_ptr": "*i64", "argmax_ptr": "*i64", "num_accepted_ptr": "*i64",
                                     "next_ptr": "*i64", "K": "i32"}, {"BLOCK_K": 8}),
        (tri._stochastic_accept_kernel, ACCEPT, {"HAS_DRAFT_PROBS": True, "BLOCK_K": 8}),
        (tri._stochastic_accept_kernel, ACCEPT, {"HAS_DRAFT_PROBS": False, "BLOCK_K": 8}),
    ] + [(tri._residual_sample_kernel, PROBS, {"MODE": mode, "BLOCK_V": 256}) for mode in (0, 1, 2)]
    compiled = []
    for fn, signature, constants in cases:
        signature = {**signature, **{name: "constexpr" for name in constants}}
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                                target=GPUTarget("cuda", 90, 32))
        compiled.append([fn.__name__, len(kernel.asm["cubin"])])
    print(json.dumps(compiled))
    """
)


@needs_triton
@pytest.mark.timeout(600)
def test_triton_kernels_compile_for_cuda(tmp_path):
    env = {**os.environ, "PYTHONPATH": "", "TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0 and "ptxas" in proc.stderr and "not found" in proc.stderr.lower():
        pytest.skip("no ptxas available to finish the CUDA build")
    assert proc.returncode == 0, proc.stderr[-3000:]
    compiled = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(compiled) == 7 and all(size > 0 for _, size in compiled)


@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs a CUDA GPU and triton")
def test_triton_matches_reference_on_cuda():
    gen = torch.Generator().manual_seed(8)
    batch, k, vocab = 8, 5, 49_152
    logits = torch.randn(batch, k + 1, vocab, generator=gen)
    draft = torch.where(torch.rand(batch, k, generator=gen) < 0.8, logits.argmax(-1)[:, :k],
                        torch.randint(0, vocab, (batch, k), generator=gen))
    p = torch.softmax(logits * 3, -1)
    q = torch.softmax(torch.randn(batch, k, vocab, generator=gen) * 3, -1)
    u, r = torch.rand(batch, k, generator=gen), torch.rand(batch, generator=gen)
    cuda = [t.cuda() for t in (draft, logits, p, q, u, r)]
    assert kernels.backend_for(cuda[1]) == "triton"
    for a, b in zip(greedy_verify(draft, logits), greedy_verify(cuda[0], cuda[1])):
        assert torch.equal(a, b.cpu())
    for draft_probs in (True, False):
        expected = stochastic_verify(draft, q if draft_probs else None, p, u, r)
        got = stochastic_verify(cuda[0], cuda[3] if draft_probs else None, cuda[2], cuda[4], cuda[5])
        assert all(torch.equal(a, b.cpu()) for a, b in zip(expected, got))
    assert torch.equal(sample(p[:, 0], r), sample(cuda[2][:, 0], cuda[5]).cpu())
