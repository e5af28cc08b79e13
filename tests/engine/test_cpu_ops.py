"""The compiled CPU attention (`CpuOps.attend`) against a torch reference: grouped heads of
several widths, single and multi-row calls, and rows that never depend on the batch. Caches
hold float16 keys and values; the reference reads the same values."""

from __future__ import annotations

import math

import pytest
import torch

from agentrt.engine.cpu_ops import cpu_ops


@pytest.fixture(scope="module")
def ops():
    found = cpu_ops()
    if found is None:
        pytest.skip("no AVX2 / C compiler here: the plain torch path is in use")
    return found


def reference(qkv, k_cache, v_cache, start, heads, kv_heads, dim):
    """Causal grouped-query attention in float64 for the n rows of ``qkv`` (positions start..)."""
    n = qkv.shape[0]
    q = qkv[:, :heads * dim].view(n, heads, dim).double()
    out = torch.empty(n, heads, dim, dtype=torch.float64)
    groups = heads // kv_heads
    for r in range(n):
        length = start + r + 1
        for h in range(heads):
            keys = k_cache[h // groups, :length].double()
            values = v_cache[h // groups, :length].double()
            weights = torch.softmax(keys @ q[r, h] / math.sqrt(dim), dim=0)
            out[r, h] = weights @ values
    return out.view(n, heads * dim).float()


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (8, 4, 64), (8, 2, 128),
                                                (10, 2, 32), (7, 1, 64)])
@pytest.mark.parametrize("start,n", [(0, 1), (0, 6), (37, 1), (62, 3), (130, 5)])
def test_attend_matches_reference(ops, heads, kv_heads, dim, start, n):
    gen = torch.Generator().manual_seed(heads * 1000 + start + n)
    length = start + n
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen)
    k_cache = torch.randn(kv_heads, length + 3, dim, generator=gen).half()
    v_cache = torch.randn(kv_heads, length + 3, dim, generator=gen).half()
    got = ops.attend(qkv, k_cache, v_cache, start, heads, kv_heads, dim)
    want = reference(qkv, k_cache, v_cache, start, heads, kv_heads, dim)
    assert (got - want).abs().max() < 1e-5


def test_attend_refuses_float32_caches(ops):
    qkv = torch.randn(1, 5 * 32)
    cache = torch.zeros(1, 4, 32)
    with pytest.raises(ValueError, match="float16"):
        ops.attend(qkv, cache, cache, 0, 3, 1, 32)


def test_attend_rows_do_not_depend_on_the_batch(ops):
    heads, kv_heads, dim, start, n = 9, 3, 64, 301, 9
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen)
    k_cache = torch.randn(kv_heads, start + n, dim, generator=gen).half()
    v_cache = torch.randn(kv_heads, start + n, dim, generator=gen).half()
    together = ops.attend(qkv, k_cache, v_cache, start, heads, kv_heads, dim)
    for r in range(n):
        alone = ops.attend(qkv[r:r + 1].clone(), k_cache, v_cache, start + r, heads, kv_heads, dim)
        assert torch.equal(alone[0], together[r])
