"""The compiled CPU attention (``attend_paged``, a step of `CpuOps.decode_layers_paged`) against a
torch reference: grouped heads of several widths, single and multi-row calls, caches in one
block or scattered over a pool, and rows that never depend on the batch or on the blocks that
hold the keys. Caches hold float16 keys and values; the reference reads the same values."""

from __future__ import annotations

import math

import pytest
import torch

from agentrt.engine.cpu_ops import cpu_ops
from agentrt.engine.llama import SeqRows
from per_op_forward import attend_paged
from random_models import qwen_like


@pytest.fixture(scope="module")
def ops():
    found = cpu_ops()
    if found is None:
        pytest.skip("no AVX2 / C compiler here: the plain torch path is in use")
    return found


def attend(ops, qkv, k_cache, v_cache, start, heads, kv_heads, dim, block_size=None):
    """`CpuOps.attend_paged` for one sequence whose keys and values are ``k_cache`` /
    ``v_cache`` [KV, T, D]: in one block of T positions, or (``block_size``) spread over a pool
    in blocks taken in reverse order."""
    kv, length, _ = k_cache.shape
    if block_size is None:
        block_size, order = length, [0]
    else:
        order = list(range(-(-length // block_size)))[::-1]
    pools = []
    for cache in (k_cache, v_cache):
        pool = torch.zeros(len(order), kv, block_size, dim, dtype=cache.dtype)
        for j, block in enumerate(order):
            part = cache[:, j * block_size:(j + 1) * block_size]
            pool[block, :, :part.shape[1]] = part
        pools.append(pool)
    blocks = torch.tensor(order, dtype=torch.int32)
    table = ops.seq_table([(0, qkv.shape[0], start, blocks)])
    return attend_paged(ops, qkv, *pools, table, heads, kv_heads, dim)


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
@pytest.mark.parametrize("block_size", [None, 16])
def test_attend_matches_reference(ops, heads, kv_heads, dim, start, n, block_size):
    gen = torch.Generator().manual_seed(heads * 1000 + start + n)
    length = start + n
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen)
    k_cache = torch.randn(kv_heads, length + 3, dim, generator=gen).half()
    v_cache = torch.randn(kv_heads, length + 3, dim, generator=gen).half()
    got = attend(ops, qkv, k_cache, v_cache, start, heads, kv_heads, dim, block_size)
    want = reference(qkv, k_cache, v_cache, start, heads, kv_heads, dim)
    assert (got - want).abs().max() < 1e-5


def test_the_step_refuses_float32_caches(ops):
    model = qwen_like()
    cfg = model.cfg
    pool = model.new_pool(2, 16)
    wrong = type(pool)(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 2, 16, torch.float32)
    seqs = [SeqRows(0, 3, torch.tensor([0], dtype=torch.int32))]
    with torch.inference_mode():
        model(torch.tensor([1, 2, 3]), seqs, pool)
        with pytest.raises(ValueError, match="float16"):
            model(torch.tensor([1, 2, 3]), seqs, wrong)


def test_attend_rows_do_not_depend_on_the_batch(ops):
    heads, kv_heads, dim, start, n = 9, 3, 64, 301, 9
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim, generator=gen)
    k_cache = torch.randn(kv_heads, start + n, dim, generator=gen).half()
    v_cache = torch.randn(kv_heads, start + n, dim, generator=gen).half()
    together = attend(ops, qkv, k_cache, v_cache, start, heads, kv_heads, dim)
    assert torch.equal(attend(ops, qkv, k_cache, v_cache, start, heads, kv_heads, dim, 64), together)
    for r in range(n):
        alone = attend(ops, qkv[r:r + 1].clone(), k_cache, v_cache, start + r, heads, kv_heads, dim)
        assert torch.equal(alone[0], together[r])


def _one_row_and_batched(model, threads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of one decode row of sequence A stepped alone (the one-row path of the
    kernels: one parallel region for the whole step) and the same row stepped beside a row of
    sequence B (the batched path)."""
    torch.set_num_threads(threads)
    pool = model.new_pool(8, 16)
    a, b = (torch.arange(i * 4, i * 4 + 4, dtype=torch.int32) for i in range(2))
    prompt_a = torch.arange(3, 40) % model.vocab_size
    prompt_b = torch.arange(50, 71) % model.vocab_size
    with torch.inference_mode():
        model(prompt_a, [SeqRows(0, len(prompt_a), a)], pool)
        model(prompt_b, [SeqRows(0, len(prompt_b), b)], pool)
        alone = model(torch.tensor([7]), [SeqRows(len(prompt_a), 1, a)], pool)
        batched = model(torch.tensor([7, 9]), [SeqRows(len(prompt_a), 1, a),
                                               SeqRows(len(prompt_b), 1, b)], pool)
    return alone[0], batched[0]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_one_row_step_gives_the_bits_of_the_batched_step(ops, threads):
    before = torch.get_num_threads()
    try:
        alone, batched = _one_row_and_batched(qwen_like(), threads)  # with a qkv bias
        assert torch.equal(alone, batched)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("precision", ["exact", "int8"])
def test_a_one_row_step_of_the_pulled_model_gives_the_bits_of_the_batched_step(ops, precision):
    from agentrt.engine import models
    from agentrt.engine.llama import Transformer

    model = Transformer.from_pretrained(models.ensure("smollm2-135m", "bf16"), "bf16",
                                        max_seq_len=256, precision=precision)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            alone, batched = _one_row_and_batched(model, threads)
            assert torch.equal(alone, batched), f"{precision}, {threads} threads"
    finally:
        torch.set_num_threads(before)


def _step_logits(model, pool, table, prompt) -> torch.Tensor:
    """Logits of a prompt's prefill then one decode row (the batched path, then the one-row
    path of the kernels' worker team)."""
    with torch.inference_mode():
        model(prompt, [SeqRows(0, len(prompt), table)], pool)
        return model(torch.tensor([7]), [SeqRows(len(prompt), 1, table)], pool)[0]


def test_the_worker_team_serves_calls_from_several_threads_at_once(ops):
    """The kernels' worker team runs one job at a time: forwards called from four Python
    threads together (ctypes lets them overlap) give the bits each gives alone."""
    import threading

    model = qwen_like()
    prompts = [torch.arange(i, i + 20 + 3 * i) % model.vocab_size for i in range(4)]
    pools = [model.new_pool(4, 16) for _ in prompts]
    table = torch.arange(4, dtype=torch.int32)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        alone = [_step_logits(model, pool, table, p) for pool, p in zip(pools, prompts)]
        together: list[list[torch.Tensor]] = [[] for _ in prompts]

        def work(i: int) -> None:
            torch.set_num_threads(2)
            for _ in range(5):
                together[i].append(_step_logits(model, pools[i], table, prompts[i]))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a forward never returned"
        for i, runs in enumerate(together):
            assert len(runs) == 5 and all(torch.equal(r, alone[i]) for r in runs)
    finally:
        torch.set_num_threads(before)


def _child_step(queue) -> None:
    torch.set_num_threads(2)
    model = qwen_like()
    queue.put(_step_logits(model, model.new_pool(4, 16), torch.arange(4, dtype=torch.int32),
                           torch.arange(30) % model.vocab_size).tolist())


def test_the_kernels_work_in_a_child_forked_after_they_ran(ops):
    """A forked child has none of its parent's worker threads: its first parallel kernel must
    start its own instead of waiting for threads that do not exist."""
    import multiprocessing

    torch.set_num_threads(2)
    model = qwen_like()
    here = _step_logits(model, model.new_pool(4, 16), torch.arange(4, dtype=torch.int32),
                        torch.arange(30) % model.vocab_size)
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child_step, args=(queue,))
    child.start()
    try:
        there = queue.get(timeout=120)
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
    assert torch.equal(torch.tensor(there, dtype=here.dtype), here)
