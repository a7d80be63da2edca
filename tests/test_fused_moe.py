"""The Triton fused-MoE kernel (interpreted on CPU) against the torch grouped-experts path, and
its pair alignment checked exactly."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from prefixserve.kernels.fused_moe import align_pairs, fused_moe
from prefixserve.models.moe import grouped_experts, select_experts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _routed(num_tokens: int, num_experts: int, top_k: int, seed: int, skew: bool = False):
    """Random router output; ``skew`` biases the logits so a few experts take most pairs (long
    runs, several tiles per expert) and some take none."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    if skew:
        logits += torch.linspace(4, -4, num_experts)
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return weights.to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "block_m", "skew"),
    [
        (1, 8, 2, 16, False),  # one decode token: two one-row runs
        (5, 128, 8, 16, False),  # a Qwen3-30B-A3B router: most experts idle
        (40, 8, 2, 16, True),  # long runs over several tiles, empty experts
        (40, 8, 3, 32, False),
        (0, 8, 2, 16, False),
    ],
)
def test_align_pairs_groups_every_pair_once_by_expert(
    num_tokens, num_experts, top_k, block_m, skew
):
    _, ids = _routed(num_tokens, num_experts, top_k, seed=num_tokens, skew=skew)
    sorted_pairs, tile_expert = align_pairs(ids, num_experts, block_m)
    n = num_tokens * top_k
    flat = ids.flatten().tolist()
    bound = -(-(n + min(n, num_experts) * (block_m - 1)) // block_m) * block_m
    assert sorted_pairs.shape == (bound,) and tile_expert.shape == (bound // block_m,)
    tiles = sorted_pairs.view(-1, block_m).tolist()
    seen = []
    for tile, expert in zip(tiles, tile_expert.tolist()):
        real = [p for p in tile if p < n]
        if expert == num_experts:  # idle tile: padding only
            assert real == []
            continue
        assert real and all(flat[p] == expert for p in real)
        assert real == tile[: len(real)]  # padding only after a run's last pair
        seen += real
    assert sorted(seen) == list(range(n))  # every pair exactly once
    experts_in_order = [flat[p] for p in seen]
    assert experts_in_order == sorted(experts_in_order)  # runs in ascending expert order


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "hidden", "inter", "skew"),
    [
        (1, 8, 2, 64, 32, False),
        (37, 8, 2, 64, 32, True),
        (23, 16, 4, 48, 40, False),  # sizes that are not multiples of the tiles: masked
        (6, 128, 8, 32, 16, False),
    ],
)
def test_fused_moe_matches_grouped_experts(num_tokens, num_experts, top_k, hidden, inter, skew):
    gen = torch.Generator().manual_seed(hidden + inter)
    w13 = (0.1 * torch.randn(num_experts, 2 * inter, hidden, generator=gen)).to(DEVICE)
    w2 = (0.1 * torch.randn(num_experts, hidden, inter, generator=gen)).to(DEVICE)
    wide = torch.randn(num_tokens, hidden + 8, generator=gen).to(DEVICE)
    x = wide[:, 4 : 4 + hidden]  # a strided view, as a slice of a larger activation
    weights, ids = _routed(num_tokens, num_experts, top_k, seed=num_tokens, skew=skew)
    expected = grouped_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), expected, atol=1e-5, rtol=1e-5)


def test_fused_moe_applies_the_router_weights():
    """Doubling every router weight doubles the output; a zero weight removes that expert."""
    gen = torch.Generator().manual_seed(0)
    w13 = (0.1 * torch.randn(4, 32, 16, generator=gen)).to(DEVICE)
    w2 = (0.1 * torch.randn(4, 16, 16, generator=gen)).to(DEVICE)
    x = torch.randn(3, 16, generator=gen).to(DEVICE)
    weights, ids = _routed(3, 4, 2, seed=1)
    once = fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_moe(x, w13, w2, 2 * weights, ids), 2 * once)
    first_only = weights.clone()
    first_only[:, 1] = 0
    alone = fused_moe(x, w13, w2, first_only, ids)
    torch.testing.assert_close(alone, grouped_experts(x, w13, w2, first_only, ids))
    assert not torch.allclose(alone, once)


def test_empty_batch_returns_empty():
    x = torch.zeros(0, 16, device=DEVICE)
    w13, w2 = torch.zeros(4, 32, 16, device=DEVICE), torch.zeros(4, 16, 16, device=DEVICE)
    weights, ids = _routed(0, 4, 2, seed=0)
    assert fused_moe(x, w13, w2, weights, ids).shape == (0, 16)


@pytest.mark.gpu
def test_fused_moe_bf16_on_gpu_matches_float32_reference():
    """bf16 operands on tensor cores, float32 accumulation: within bf16 rounding of the float32
    torch path on the same (bf16-representable) values."""
    gen = torch.Generator().manual_seed(0)
    e, k, h, i, t = 64, 8, 256, 128, 300
    w13 = (0.05 * torch.randn(e, 2 * i, h, generator=gen)).bfloat16()
    w2 = (0.05 * torch.randn(e, h, i, generator=gen)).bfloat16()
    x = torch.randn(t, h, generator=gen).bfloat16()
    weights, ids = _routed(t, e, k, seed=0)
    ref = grouped_experts(x.float(), w13.float(), w2.float(), weights.cpu(), ids.cpu())
    out = fused_moe(x.cuda(), w13.cuda(), w2.cuda(), weights.bfloat16(), ids)
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)
