"""``TorchAttentionBackend`` against naive dense attention per sequence, and ``copy_blocks``."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from attn_utils import BlockAllocator, attend, build_attn_metadata

from prefixserve.attention.torch_backend import TorchAttentionBackend


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q (n, nh, hd) are the last n positions of context k/v (L, nkv, hd); causal, loops heads."""
    n, nh, _ = q.shape
    length, nkv, _ = k.shape
    out = torch.empty_like(q)
    for h in range(nh):
        kh, vh = k[:, h // (nh // nkv)], v[:, h // (nh // nkv)]
        scores = q[:, h] @ kh.T * scale  # (n, L)
        q_pos = torch.arange(length - n, length)[:, None]
        scores = scores.masked_fill(torch.arange(length)[None, :] > q_pos, -math.inf)
        out[:, h] = scores.softmax(-1) @ vh
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("gqa", [1, 2, 4])
def test_matches_dense_reference(seed, block_size, gqa):
    rng = random.Random(seed)
    nkv, hd = 2, 16
    nh = nkv * gqa
    num_decodes = rng.randint(0, 3)
    seqs = [(rng.randint(1, 40), 1) for _ in range(num_decodes)]
    seqs += [
        (rng.choice([0, rng.randint(0, 40)]), rng.randint(1, 30)) for _ in range(rng.randint(0, 3))
    ]
    if not seqs:
        seqs = [(0, 5)]
    num_blocks = 64
    alloc = BlockAllocator(num_blocks, seed)
    tables = [alloc.grow([], c + n, block_size) for c, n in seqs]
    gen = torch.Generator().manual_seed(seed)
    # Garbage (finite) everywhere: masked slots and partial last blocks must not leak in.
    kv_cache = torch.randn(2, num_blocks, block_size, nkv, hd, generator=gen)
    ctx_k = [torch.randn(c + n, nkv, hd, generator=gen) for c, n in seqs]
    ctx_v = [torch.randn(c + n, nkv, hd, generator=gen) for c, n in seqs]
    for (c, _), table, k, v in zip(seqs, tables, ctx_k, ctx_v):
        for p in range(c):
            kv_cache[0, table[p // block_size], p % block_size] = k[p]
            kv_cache[1, table[p // block_size], p % block_size] = v[p]
    _, md = build_attn_metadata(seqs, tables, block_size)
    query = torch.randn(sum(n for _, n in seqs), nh, hd, generator=gen)
    key = torch.cat([k[c:] for (c, _), k in zip(seqs, ctx_k)])
    value = torch.cat([v[c:] for (c, _), v in zip(seqs, ctx_v)])
    scale = hd**-0.5
    out = attend(TorchAttentionBackend(), query, key, value, kv_cache, md, scale)
    starts = md.query_start_loc.tolist()
    for i, (c, n) in enumerate(seqs):
        ref = _dense(query[starts[i] : starts[i + 1]], ctx_k[i], ctx_v[i], scale)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], ref, atol=1e-5, rtol=1e-5)
        for p in range(c + n):  # the cache now holds the whole context
            slot = (tables[i][p // block_size], p % block_size)
            assert torch.equal(kv_cache[0][slot], ctx_k[i][p])
            assert torch.equal(kv_cache[1][slot], ctx_v[i][p])


def test_slot_minus_one_is_not_written():
    block_size, nkv, hd = 8, 2, 4
    kv_cache = torch.randn(2, 4, block_size, nkv, hd)
    before = kv_cache.clone()
    _, md = build_attn_metadata([(0, 3), (0, 2)], [[1], [2]], block_size)
    md.slot_mapping[3:] = -1  # the second sequence's tokens are padding
    key, value = torch.randn(5, nkv, hd), torch.randn(5, nkv, hd)
    out = attend(TorchAttentionBackend(), torch.randn(5, nkv, hd), key, value, kv_cache, md, 0.5)
    assert out.shape == (5, nkv, hd)
    assert torch.equal(kv_cache[0, 1, :3], key[:3]) and torch.equal(kv_cache[1, 1, :3], value[:3])
    written = torch.zeros(4, block_size, dtype=torch.bool)
    written[1, :3] = True
    assert torch.equal(kv_cache[:, ~written], before[:, ~written])


def test_empty_chunk_is_a_clear_error():
    """A sequence with no query token is refused before any kernel sees it."""
    kv_cache = torch.zeros(2, 4, 8, 2, 4)
    _, md = build_attn_metadata([(0, 3), (3, 0)], [[1], [1]], 8)
    with pytest.raises(ValueError, match="at least one query token"):
        attend(
            TorchAttentionBackend(),
            torch.randn(3, 2, 4),
            torch.randn(3, 2, 4),
            torch.randn(3, 2, 4),
            kv_cache,
            md,
            0.5,
        )


def test_copy_blocks_copies_every_layer_and_kv():
    kv_caches = torch.randn(3, 2, 6, 4, 2, 8)
    before = kv_caches.clone()
    src, dst = torch.tensor([0, 2, 2]), torch.tensor([1, 3, 5])
    TorchAttentionBackend().copy_blocks(kv_caches, src, dst)
    for s, d in zip(src.tolist(), dst.tolist()):
        assert torch.equal(kv_caches[:, :, d], before[:, :, s])
    untouched = [0, 2, 4]
    assert torch.equal(kv_caches[:, :, untouched], before[:, :, untouched])


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("consecutive", [True, False])
def test_prefix_groups_match_dense_reference(seed, gqa, consecutive):
    """Cascade attention: members share leading blocks (one physical copy); results equal the
    dense reference, and equal the same batch run without groups. Shared blocks that follow one
    another in the pool are read as a view, others gathered; both are checked."""
    from prefixserve.attention.prefix_groups import plan_prefix_groups

    rng = random.Random(seed)
    bs, nkv, hd = 8, 2, 16
    nh = nkv * gqa
    shared_len = bs * rng.randint(8, 12)  # >= MIN_SHARED_PREFIX_TOKENS
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 128
    kv_cache = torch.randn(2, num_blocks, bs, nkv, hd, generator=gen)
    shared_k = torch.randn(shared_len, nkv, hd, generator=gen)
    shared_v = torch.randn(shared_len, nkv, hd, generator=gen)
    shared_blocks = list(range(shared_len // bs))
    if not consecutive:
        random.Random(seed).shuffle(shared_blocks)
    for p in range(shared_len):
        kv_cache[0, shared_blocks[p // bs], p % bs] = shared_k[p]
        kv_cache[1, shared_blocks[p // bs], p % bs] = shared_v[p]
    # decodes and prefill chunks hanging off the shared prefix, plus one unrelated sequence
    seqs = [(shared_len + rng.randint(0, 20), 1) for _ in range(3)]
    seqs += [(shared_len + rng.randint(0, 9), rng.randint(2, 12)) for _ in range(2)]
    seqs.append((rng.randint(0, 20), rng.randint(1, 9)))
    next_block = len(shared_blocks)
    tables, ctx_k, ctx_v = [], [], []
    for i, (c, n) in enumerate(seqs):
        own = c + n - (shared_len if i < 5 else 0)
        nb = -(-own // bs)
        table = (shared_blocks if i < 5 else []) + list(range(next_block, next_block + nb))
        next_block += nb
        k = torch.randn(c + n, nkv, hd, generator=gen)
        v = torch.randn(c + n, nkv, hd, generator=gen)
        if i < 5:
            k[:shared_len], v[:shared_len] = shared_k, shared_v
        for p in range(shared_len if i < 5 else 0, c):
            kv_cache[0, table[p // bs], p % bs] = k[p]
            kv_cache[1, table[p // bs], p % bs] = v[p]
        tables.append(table)
        ctx_k.append(k)
        ctx_v.append(v)
    _, md = build_attn_metadata(seqs, tables, bs)
    md.prefix_groups = plan_prefix_groups(tables, [c for c, _ in seqs], bs)
    assert md.prefix_groups == [([0, 1, 2, 3, 4], shared_len // bs)]
    query = torch.randn(sum(n for _, n in seqs), nh, hd, generator=gen)
    key = torch.cat([k[c:] for (c, _), k in zip(seqs, ctx_k)])
    value = torch.cat([v[c:] for (c, _), v in zip(seqs, ctx_v)])
    scale = hd**-0.5
    out = attend(TorchAttentionBackend(), query, key, value, kv_cache.clone(), md, scale)
    assert (md.backend_plan.shared[0][1].run is not None) == consecutive  # view, or gather
    plain_md = dataclasses.replace(md, prefix_groups=[], backend_plan=None)
    plain = attend(TorchAttentionBackend(), query, key, value, kv_cache.clone(), plain_md, scale)
    start = 0
    for (_, n), k, v in zip(seqs, ctx_k, ctx_v):
        ref = _dense(query[start : start + n], k, v, scale)
        torch.testing.assert_close(out[start : start + n], ref, rtol=1e-4, atol=1e-5)
        start += n
    torch.testing.assert_close(out, plain, rtol=1e-4, atol=1e-5)


def test_prefix_groups_split_where_sharing_nests():
    """A preamble shared by all, documents shared within two sets: two groups, one per set."""
    from prefixserve.attention.prefix_groups import plan_prefix_groups

    preamble = [0, 1, 2, 3]
    set_a, set_b = list(range(10, 30)), list(range(40, 60))
    tables = [preamble + set_a + [100 + i] for i in range(3)]
    tables += [preamble + set_b + [200 + i] for i in range(2)]
    tables.append(preamble + [300, 301, 302, 303, 304])  # shares only the preamble
    starts = [len(t) * 8 - 3 for t in tables]
    groups = plan_prefix_groups(tables, starts, block_size=8)
    assert sorted(groups) == [([0, 1, 2], 24), ([3, 4], 24)]
    # shallow sharing only: one group over the preamble
    groups = plan_prefix_groups(
        [preamble + [50 + i] * 20 for i in range(4)], [300] * 4, block_size=16
    )
    assert groups == [([0, 1, 2, 3], 4)]
