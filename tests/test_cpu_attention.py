"""The C++ paged attention (``kernels/cpu_attention.cpp``) against dense attention of each query
token over its context, the K/V it writes first, and its invariance to the batch and the
chunking."""

from __future__ import annotations

import pytest
import torch
from attn_utils import BlockAllocator, build_attn_metadata

from prefixserve.attention.cpu_backend import CpuAttentionBackend, PagedStep
from prefixserve.attention.metadata import AttentionMetadata, token_contexts
from prefixserve.attention.selector import get_attention_backend
from prefixserve.attention.torch_backend import TorchAttentionBackend
from prefixserve.core.errors import InvalidArgumentError
from prefixserve.kernels import cpu_ops
from prefixserve.kernels.cpu_attention import paged_attention

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ toolchain")


def _batch(lens: list[int], block_size: int, nh: int, nkv: int, hd: int, seed: int, new=None):
    """Sequences of the given context lengths (this step's tokens included: ``new[i]`` of them,
    one each by default) over a cache of noise."""
    new = new or [1] * len(lens)
    gen = torch.Generator().manual_seed(seed)
    alloc = BlockAllocator(128, seed=seed)
    tables = [alloc.grow([], n, block_size) for n in lens]
    _, md = build_attn_metadata([(n - m, m) for n, m in zip(lens, new)], tables, block_size)
    cache = torch.randn(2, 128, block_size, nkv, hd, generator=gen)
    t = sum(new)
    q = torch.randn(t, nh, hd, generator=gen)
    k, v = torch.randn(t, nkv, hd, generator=gen), torch.randn(t, nkv, hd, generator=gen)
    return q, k, v, cache, md, tables


def _run(q, k, v, cache, md):
    seqs, lens = token_contexts(md)
    return paged_attention(q, k, v, cache, md.slot_mapping, md.block_tables, seqs, lens, 0.125)


def _dense(q, cache, tables, lens, block_size, new=None):
    """Each query token's attention over its positions, read back through its block table."""
    new = new or [1] * len(lens)
    nh, nkv = q.shape[1], cache.shape[3]
    outs, t = [], 0
    for table, n, m in zip(tables, lens, new):
        for pos in range(n - m, n):
            slots = [table[p // block_size] * block_size + p % block_size for p in range(pos + 1)]
            k = cache[0].flatten(0, 1)[slots].repeat_interleave(nh // nkv, dim=1)  # (ctx, nh, hd)
            v = cache[1].flatten(0, 1)[slots].repeat_interleave(nh // nkv, dim=1)
            w = torch.softmax(torch.einsum("hd,nhd->hn", q[t].double(), k.double()) * 0.125, -1)
            outs.append(torch.einsum("hn,nhd->hd", w, v.double()).float())
            t += 1
    return torch.stack(outs)


@pytest.mark.parametrize(
    ("block_size", "nh", "nkv", "hd"), [(16, 9, 3, 64), (8, 4, 4, 32), (16, 8, 2, 20)]
)
def test_decodes_equal_dense_attention(block_size, nh, nkv, hd):
    lens = [1, 5, 16, 17, 70]
    q, k, v, cache, md, tables = _batch(lens, block_size, nh, nkv, hd, seed=hd)
    out = _run(q, k, v, cache, md)
    slots = md.slot_mapping
    assert torch.equal(cache[0].flatten(0, 1)[slots], k)  # the new K/V were written first
    assert torch.equal(cache[1].flatten(0, 1)[slots], v)
    torch.testing.assert_close(
        out, _dense(q, cache, tables, lens, block_size), atol=1e-5, rtol=1e-5
    )


def test_prefill_chunks_equal_dense_causal_attention():
    lens, new = [9, 40, 17], [4, 23, 1]  # chunks after cached context, and a decode
    q, k, v, cache, md, tables = _batch(lens, 16, 9, 3, 64, seed=4, new=new)
    out = _run(q, k, v, cache, md)
    torch.testing.assert_close(out, _dense(q, cache, tables, lens, 16, new), atol=1e-5, rtol=1e-5)


def test_a_token_is_bit_identical_alone_in_any_batch_and_any_chunking():
    lens, new = [3, 40, 9, 33], [1, 12, 1, 5]
    q, k, v, cache, md, tables = _batch(lens, 16, 9, 3, 64, seed=1, new=new)
    batch = _run(q, k, v, cache.clone(), md)
    first = 0
    for i, (n, m) in enumerate(zip(lens, new)):  # each sequence alone, token by token
        for j in range(m):
            t = first + j
            _, one = build_attn_metadata([(n - m + j, 1)], [tables[i]], 16)
            ctx = cache.clone()
            ctx.flatten(1, 2)[:, md.slot_mapping[first:t]] = torch.stack([k[first:t], v[first:t]])
            alone = _run(q[t : t + 1], k[t : t + 1], v[t : t + 1], ctx, one)
            assert torch.equal(alone[0], batch[t])
        first += m


def test_the_work_split_by_thread_count_leaves_the_bits_unchanged():
    """Three tokens: one thread takes each token's KV heads together, two threads one KV head
    each (the kernel splits by tokens only with two tokens or more per thread)."""
    q, k, v, cache, md, _ = _batch([5, 40, 17], 16, 9, 3, 64, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        whole = _run(q, k, v, cache.clone(), md)
        torch.set_num_threads(2)
        per_head = _run(q, k, v, cache.clone(), md)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(whole, per_head)


def test_slot_minus_one_writes_nothing_and_bad_lengths_raise():
    q, k, v, cache, md, _ = _batch([4, 6], 16, 4, 2, 32, seed=2)
    before = cache.clone()
    slots = torch.full_like(md.slot_mapping, -1)
    seqs, lens = token_contexts(md)
    paged_attention(q, k, v, cache, slots, md.block_tables, seqs, lens, 0.125)
    assert torch.equal(cache, before)
    too_long = lens.clone()
    too_long[0] = md.block_tables.shape[1] * 16 + 1
    with pytest.raises(RuntimeError, match="token_len"):
        paged_attention(q, k, v, cache, slots, md.block_tables, seqs, too_long, 0.125)


def test_the_cpu_backend_plans_decode_steps_as_kernel_tensors():
    lens = [7, 20]
    q, k, v, cache, md, tables = _batch(lens, 16, 9, 3, 64, seed=3)
    backend = CpuAttentionBackend()
    step = backend.plan(md, cache)
    assert isinstance(step, PagedStep) and md.backend_plan is None  # tensors alone
    assert all(isinstance(t, torch.Tensor) for t in step)
    out = backend.forward(q, k, v, cache, step, 0.125)
    torch.testing.assert_close(out, _dense(q, cache, tables, lens, 16), atol=1e-5, rtol=1e-5)


def test_the_cpu_backend_leaves_long_chunks_to_the_torch_reference():
    """A prefill chunk longer than ``TOKEN_BY_TOKEN_MAX_QUERY`` takes the torch reference's plan,
    unless ``batch_invariant``; both attend alike."""
    lens, new = [12, 30], [1, 20]  # the decode first, as the model runner lays a step out
    q, k, v, cache, md, tables = _batch(lens, 16, 4, 2, 32, seed=4, new=new)
    for backend, kind in ((CpuAttentionBackend(), AttentionMetadata),
                          (CpuAttentionBackend(batch_invariant=True), PagedStep)):  # fmt: skip
        step = backend.plan(md, cache)
        assert isinstance(step, kind)
        written = cache.clone()
        out = backend.forward(q, k, v, written, step, 0.125)
        reference = _dense(q, written, tables, lens, 16, new)
        torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_auto_picks_the_cpu_backend_on_cpu_and_torch_is_the_reference():
    cpu = torch.device("cpu")
    assert type(get_attention_backend("auto", cpu)) is CpuAttentionBackend
    assert type(get_attention_backend("cpu", cpu, batch_invariant=True)) is CpuAttentionBackend
    assert type(get_attention_backend("torch", cpu)) is TorchAttentionBackend
    with pytest.raises(InvalidArgumentError, match="batch_invariant"):
        get_attention_backend("torch", cpu, batch_invariant=True)
