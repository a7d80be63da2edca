"""The C++ paged decode attention (``kernels/cpu_attention.cpp``) against dense attention of each
sequence over its context, the K/V it writes, and its batch invariance."""

from __future__ import annotations

import pytest
import torch
from attn_utils import BlockAllocator, build_attn_metadata

from prefixserve.attention.torch_backend import TorchAttentionBackend
from prefixserve.kernels import cpu_ops
from prefixserve.kernels.cpu_attention import decode_attention

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ toolchain")


def _batch(lens: list[int], block_size: int, nh: int, nkv: int, hd: int, seed: int):
    """Decodes of the given context lengths (the new token included) over a cache of noise."""
    gen = torch.Generator().manual_seed(seed)
    alloc = BlockAllocator(128, seed=seed)
    tables = [alloc.grow([], n, block_size) for n in lens]
    _, md = build_attn_metadata([(n - 1, 1) for n in lens], tables, block_size)
    cache = torch.randn(2, 128, block_size, nkv, hd, generator=gen)
    q = torch.randn(len(lens), nh, hd, generator=gen)
    k, v = (
        torch.randn(len(lens), nkv, hd, generator=gen),
        torch.randn(len(lens), nkv, hd, generator=gen),
    )
    return q, k, v, cache, md, tables


def _dense(q, cache, tables, lens, block_size):
    """Each sequence's attention over its positions, read back through its block table."""
    nh, nkv = q.shape[1], cache.shape[3]
    outs = []
    for i, (table, n) in enumerate(zip(tables, lens)):
        slots = torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in range(n)]
        )
        k = cache[0].flatten(0, 1)[slots].repeat_interleave(nh // nkv, dim=1)  # (n, nh, hd)
        v = cache[1].flatten(0, 1)[slots].repeat_interleave(nh // nkv, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), k.double()) * 0.125, -1)
        outs.append(torch.einsum("hn,nhd->hd", w, v.double()).float())
    return torch.stack(outs)


@pytest.mark.parametrize(
    ("block_size", "nh", "nkv", "hd"), [(16, 9, 3, 64), (8, 4, 4, 32), (16, 8, 2, 20)]
)
def test_decode_attention_equals_dense_attention(block_size, nh, nkv, hd):
    lens = [1, 5, 16, 17, 70]
    q, k, v, cache, md, tables = _batch(lens, block_size, nh, nkv, hd, seed=hd)
    out = decode_attention(q, k, v, cache, md.slot_mapping, md.block_tables, md.seq_lens, 0.125)
    slots = md.slot_mapping
    assert torch.equal(cache[0].flatten(0, 1)[slots], k)  # the new K/V were written first
    assert torch.equal(cache[1].flatten(0, 1)[slots], v)
    torch.testing.assert_close(
        out, _dense(q, cache, tables, lens, block_size), atol=1e-5, rtol=1e-5
    )


def test_a_sequence_is_bit_identical_alone_and_in_any_batch():
    lens = [3, 40, 9, 33]
    q, k, v, cache, md, _ = _batch(lens, 16, 9, 3, 64, seed=1)
    batch = decode_attention(
        q, k, v, cache.clone(), md.slot_mapping, md.block_tables, md.seq_lens, 0.125
    )
    for i in range(len(lens)):
        one = (md.slot_mapping[i : i + 1], md.block_tables[i : i + 1], md.seq_lens[i : i + 1])
        alone = decode_attention(
            q[i : i + 1], k[i : i + 1], v[i : i + 1], cache.clone(), *one, 0.125
        )
        assert torch.equal(alone[0], batch[i])


def test_slot_minus_one_writes_nothing_and_bad_lengths_raise():
    q, k, v, cache, md, _ = _batch([4, 6], 16, 4, 2, 32, seed=2)
    before = cache.clone()
    slots = torch.full_like(md.slot_mapping, -1)
    decode_attention(q, k, v, cache, slots, md.block_tables, md.seq_lens, 0.125)
    assert torch.equal(cache, before)
    too_long = md.seq_lens.clone()
    too_long[0] = md.block_tables.shape[1] * 16 + 1
    with pytest.raises(RuntimeError, match="seq_lens"):
        decode_attention(q, k, v, cache, slots, md.block_tables, too_long, 0.125)


def test_the_torch_backend_takes_the_kernel_for_pure_decode_steps():
    lens = [7, 20]
    q, k, v, cache, md, tables = _batch(lens, 16, 9, 3, 64, seed=3)
    out = TorchAttentionBackend().forward(q, k, v, cache, md, 0.125)
    assert md.backend_plan is None  # no torch plan was built: the kernel ran
    torch.testing.assert_close(out, _dense(q, cache, tables, lens, 16), atol=1e-5, rtol=1e-5)
