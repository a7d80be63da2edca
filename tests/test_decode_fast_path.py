"""The decode fast paths give the same bits as the formulas they replace: rope written as
``x * cos + roll(x) * sin``, ``torch.rms_norm`` in float32, one rotation for q and k together,
and the torch backend's pure-decode attention against its general path."""

from __future__ import annotations

import pytest
import torch
from attn_utils import BlockAllocator, attend, build_attn_metadata

from prefixserve.attention.torch_backend import TorchAttentionBackend
from prefixserve.models.llama import RMSNorm, apply_rope


def _rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' neox rope: ``x * cos + rotate_half(x) * sin`` with cos/sin of half width."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "heads", "hd"), [(1, 12, 64), (7, 4, 128), (33, 3, 32)])
def test_apply_rope_equals_the_reference_bitwise(dtype, t, heads, hd):
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, heads, hd, generator=gen).to(dtype)
    cos = torch.randn(t, 1, hd // 2, generator=gen).to(dtype)
    sin = torch.randn(t, 1, hd // 2, generator=gen).to(dtype)
    rope = (torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1))
    assert torch.equal(apply_rope(x, rope), _rope_reference(x, cos, sin))


def test_apply_rope_on_q_and_k_together_equals_each_alone():
    """The fused qkv output's q|k columns rotated as one tensor (a strided view) give the same
    bits as q and k rotated apart."""
    gen = torch.Generator().manual_seed(0)
    nh, nkv, hd, t = 9, 3, 64, 5
    qkv = torch.randn(t, (nh + 2 * nkv) * hd, generator=gen)
    rope = (torch.randn(t, 1, hd, generator=gen), torch.randn(t, 1, hd, generator=gen))
    q, k = apply_rope(qkv[:, : (nh + nkv) * hd].view(t, -1, hd), rope).split([nh, nkv], dim=1)
    q_alone = apply_rope(qkv[:, : nh * hd].reshape(t, nh, hd), rope)
    k_alone = apply_rope(qkv[:, nh * hd : (nh + nkv) * hd].reshape(t, nkv, hd), rope)
    assert torch.equal(q, q_alone) and torch.equal(k, k_alone)


@pytest.mark.parametrize("dim", [64, 576, 2048])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_rms_norm_float32_equals_the_transformers_formula_bitwise(dim, rows):
    gen = torch.Generator().manual_seed(dim + rows)
    norm = RMSNorm(dim, 1e-5)
    norm.weight.copy_(torch.randn(dim, generator=gen))
    x = torch.randn(rows, dim, generator=gen) * torch.rand(rows, 1, generator=gen) * 10
    reference = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps))
    assert torch.equal(norm(x), reference)


def test_rms_norm_bfloat16_still_computes_in_float32():
    norm = RMSNorm(32, 1e-6).to(torch.bfloat16)
    x = torch.randn(4, 32).to(torch.bfloat16)
    h = x.float()
    reference = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert torch.equal(norm(x), reference)


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("gqa", [1, 3])
def test_pure_decode_step_equals_the_general_path_bitwise(block_size, gqa):
    """Decodes alone take the fast path; with a prefill chunk in the batch they take the general
    one (lse kept for merging). Both must give each decode the same bits and write the same K/V.
    (The C++ backend's decode kernel is ``test_cpu_attention``'s.)"""
    nkv, hd = 2, 16
    nh = nkv * gqa
    decodes = [(5, 1), (17, 1), (40, 1)]
    alloc = BlockAllocator(64, seed=block_size)
    tables = [alloc.grow([], c + n, block_size) for c, n in [*decodes, (0, 6)]]
    gen = torch.Generator().manual_seed(gqa)
    kv_cache = torch.randn(2, 64, block_size, nkv, hd, generator=gen)
    query = torch.randn(len(decodes) + 6, nh, hd, generator=gen)
    key = torch.randn(len(decodes) + 6, nkv, hd, generator=gen)
    value = torch.randn(len(decodes) + 6, nkv, hd, generator=gen)
    n = len(decodes)

    def run(seqs, seq_tables, t):
        cache = kv_cache.clone()
        _, md = build_attn_metadata(seqs, seq_tables, block_size)
        out = attend(TorchAttentionBackend(), query[:t], key[:t], value[:t], cache, md, 0.25)
        return out, cache, md

    fast, fast_cache, fast_md = run(decodes, tables[:n], n)
    general, general_cache, general_md = run([*decodes, (0, 6)], tables, n + 6)
    assert fast_md.num_decodes == n and not fast_md.backend_plan.chunks  # the fast path ran
    assert general_md.backend_plan.chunks  # the general path ran
    assert torch.equal(fast, general[:n])
    written = fast_md.slot_mapping
    assert torch.equal(fast_cache[0].view(-1, nkv, hd)[written], key[:n])
    assert torch.equal(fast_cache[1].view(-1, nkv, hd)[written], value[:n])
    assert torch.equal(general_cache[0].view(-1, nkv, hd)[written], key[:n])
