"""Fused MoE: the experts of a sparse layer as two grouped GEMMs over tokens sorted by expert.

``T`` tokens each routed to ``top_k`` experts make ``n = T * top_k`` (token, slot) pairs; pair
``p`` is token ``p // top_k``'s slot ``p % top_k``. ``align_pairs`` sorts the pairs by expert into
runs padded to ``BLOCK_M`` rows, so that every row tile of ``BLOCK_M`` pairs belongs to one
expert::

    sorted_pairs  [ e0 e0 e0 -- | e1 -- -- -- | e3 e3 e3 e3 | e3 -- -- -- | -- -- ... ]
    tile_expert   [ 0           | 1           | 3           | 3           | E (idle)  ]

(``--``: padding, pair id ``n``, read as zeros and never written). Two launches then run over the
tiles, each tile one expert's weights times its rows:

1. ``inter[p] = silu(x[t] @ W_gate[e]^T) * (x[t] @ W_up[e]^T)``, both halves in one program;
2. ``out[p] = topk_weights[p] * (inter[p] @ W_down[e]^T)``,

and the ``top_k`` rows of each token are summed. Every shape and grid depends on ``T`` alone (the
padded length is its bound ``n + min(n, E) * (BLOCK_M - 1)``; tiles past the used ones are idle),
and nothing is read back to the host, so CUDA graphs capture the whole layer. Accumulation is
float32; operands are upcast to float32 on CPU (Triton's interpreter), as the attention kernels do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from prefixserve.kernels.attention_common import dot_operands


@triton.jit
def _gate_up_kernel(
    x_ptr,  # [T, H]
    w_ptr,  # [E, 2I, H]: gate rows, then up rows
    inter_ptr,  # [n, I] out
    sorted_pairs_ptr,  # [P]
    tile_expert_ptr,  # [P // BLOCK_M]
    num_pairs,
    num_experts,
    hidden,
    inter,
    stride_xt,
    stride_we,
    stride_wn,
    stride_wk,
    stride_it,
    TOP_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if expert >= num_experts:
        return
    pairs = tl.load(sorted_pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    real = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < inter
    w_gate = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn
    w_up = w_gate + inter * stride_wn
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < hidden
        a = tl.load(
            x_ptr + tokens[:, None] * stride_xt + offs_k[None, :],
            mask=real[:, None] & mask_k[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        w_mask = mask_k[:, None] & mask_n[None, :]
        b_gate = tl.load(w_gate + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0)
        b_up = tl.load(w_up + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0)
        gate += tl.dot(a, b_gate.to(DOT_DTYPE), input_precision=PRECISION)
        up += tl.dot(a, b_up.to(DOT_DTYPE), input_precision=PRECISION)
    act = gate * tl.sigmoid(gate) * up
    tl.store(
        inter_ptr + pairs[:, None].to(tl.int64) * stride_it + offs_n[None, :],
        act.to(inter_ptr.dtype.element_ty),
        mask=real[:, None] & mask_n[None, :],
    )


@triton.jit
def _down_kernel(
    inter_ptr,  # [n, I]
    w_ptr,  # [E, H, I]
    out_ptr,  # [n, H] out
    topk_weights_ptr,  # [n]
    sorted_pairs_ptr,
    tile_expert_ptr,
    num_pairs,
    num_experts,
    hidden,
    inter,
    stride_it,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ot,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if expert >= num_experts:
        return
    pairs = tl.load(sorted_pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    real = pairs < num_pairs
    rows = pairs.to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < hidden
    w = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < inter
        a = tl.load(
            inter_ptr + rows[:, None] * stride_it + offs_k[None, :],
            mask=real[:, None] & mask_k[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        b = tl.load(
            w + offs_k[:, None] * stride_wk, mask=mask_k[:, None] & mask_n[None, :], other=0.0
        )
        acc += tl.dot(a, b.to(DOT_DTYPE), input_precision=PRECISION)
    weight = tl.load(topk_weights_ptr + rows, mask=real, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + rows[:, None] * stride_ot + offs_n[None, :],
        (acc * weight[:, None]).to(out_ptr.dtype.element_ty),
        mask=real[:, None] & mask_n[None, :],
    )


def align_pairs(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_pairs [P], tile_expert [P // block_m])`` for ``topk_ids [T, top_k]``.

    ``sorted_pairs`` lists the pair ids ``0..n-1`` grouped by expert (ascending; by pair id within
    one), each expert's run starting at a multiple of ``block_m``, the gaps and the tail holding
    ``n``; ``tile_expert[i]`` is the expert of tile ``i``, ``num_experts`` for an unused tile.
    ``P = n + min(n, E) * (block_m - 1)`` rounded up to ``block_m``: every run of ``c`` pairs takes
    ``ceil(c / block_m)`` tiles, at most ``c + block_m - 1`` rows, and at most ``min(n, E)`` runs
    are non-empty. Device ops of fixed shapes only (no host sync).
    """
    device = topk_ids.device
    flat = topk_ids.flatten()
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    order = flat.argsort(stable=True)  # pair ids by expert
    expert_of = flat[order]
    rank = torch.arange(n, device=device) - (counts.cumsum(0) - counts)[expert_of]
    size = triton.cdiv(n + min(n, num_experts) * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((size,), n, dtype=torch.int32, device=device)
    sorted_pairs[(padded_end - padded)[expert_of] + rank] = order.to(torch.int32)
    tile_start = torch.arange(0, size, block_m, device=device)
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True).to(torch.int32)
    return sorted_pairs, tile_expert


def fused_moe(
    x: torch.Tensor,  # [T, H]
    gate_up_proj: torch.Tensor,  # [E, 2I, H]
    down_proj: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, top_k]
    topk_ids: torch.Tensor,  # [T, top_k]
    block_m: int = 16,
) -> torch.Tensor:  # [T, H] in x's dtype
    """``sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t))``, ``e = topk_ids[t, j]``:
    the torch path ``prefixserve.models.moe.grouped_experts`` computes the same. ``block_m`` (at
    least 16, ``tl.dot``'s minimum) is the row tile; small steps waste less padding with small
    tiles. Weight matrices need a unit last stride; ``x`` may be any 2-D view with one."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = gate_up_proj.shape
    inter = two_inter // 2
    n = num_tokens * top_k
    if n == 0:
        return torch.zeros_like(x)
    assert x.stride(1) == 1 and gate_up_proj.stride(2) == 1 and down_proj.stride(2) == 1
    sorted_pairs, tile_expert = align_pairs(topk_ids, num_experts, block_m)
    num_tiles = tile_expert.shape[0]
    dot_dtype, precision = dot_operands(x.dtype, x.device)
    block_n, block_k = 32, 32
    inter_out = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_tiles, triton.cdiv(inter, block_n))](
        x,
        gate_up_proj,
        inter_out,
        sorted_pairs,
        tile_expert,
        n,
        num_experts,
        hidden,
        inter,
        x.stride(0),
        *gate_up_proj.stride(),
        inter_out.stride(0),
        TOP_K=top_k,
        DOT_DTYPE=dot_dtype,
        PRECISION=precision,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    out = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(num_tiles, triton.cdiv(hidden, block_n))](
        inter_out,
        down_proj,
        out,
        topk_weights.flatten(),
        sorted_pairs,
        tile_expert,
        n,
        num_experts,
        hidden,
        inter,
        inter_out.stride(0),
        *down_proj.stride(),
        out.stride(0),
        DOT_DTYPE=dot_dtype,
        PRECISION=precision,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
