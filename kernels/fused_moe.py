"""Fused MoE: the experts of a sparse layer as two grouped GEMMs over tokens sorted by expert.

``T`` tokens each routed to ``top_k`` experts make ``n = T * top_k`` (token, slot) pairs; pair
``p`` is token ``p // top_k``'s slot ``p % top_k``. ``align_pairs`` sorts the pairs by expert into
runs padded to ``BLOCK_M`` rows, so that every row tile of ``BLOCK_M`` pairs belongs to one
expert::

    sorted_pairs  [ e0 e0 e0 -- | e1 -- -- -- | e3 e3 e3 e3 | e3 -- -- -- | -- -- ... ]
    tile_expert   [ 0           | 1           | 3           | 3           | E (idle)  ]

(``--``: padding, pair id ``n``, read as zeros and never written). Two launches of one kernel (as
vLLM's ``fused_moe_kernel`` serves both GEMMs) then run over the tiles, each tile one expert's
weights times its rows:

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
def _expert_gemm_kernel(
    a_ptr,  # [rows, K]: one row per token (TOP_K > 1) or per pair (TOP_K = 1)
    w_ptr,  # [E, N, K], or [E, 2N, K] with GATED: gate rows, then up rows
    out_ptr,  # [n, N] out, one row per pair
    topk_weights_ptr,  # [n], read with MUL_ROUTED_WEIGHT
    sorted_pairs_ptr,  # [P]
    tile_expert_ptr,  # [P // BLOCK_M]
    num_pairs,
    num_experts,
    N,
    K,
    stride_at,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ot,
    TOP_K: tl.constexpr,
    GATED: tl.constexpr,
    MUL_ROUTED_WEIGHT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One tile's rows times its expert's weights: ``out[p] = a[p // TOP_K] @ W[e]^T``, with
    ``GATED`` ``silu(a @ W_gate^T) * (a @ W_up^T)`` (both halves in one program, ``a`` loaded
    once), with ``MUL_ROUTED_WEIGHT`` times ``topk_weights[p]``."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if expert >= num_experts:
        return
    pairs = tl.load(sorted_pairs_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    real = pairs < num_pairs
    a_rows = (pairs // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED:
        w_up = w + N * stride_wn
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_at + offs_k[None, :],
            mask=real[:, None] & mask_k[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        w_mask = mask_k[:, None] & mask_n[None, :]
        b = tl.load(w + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0)
        if GATED:
            b_up = tl.load(w_up + offs_k[:, None] * stride_wk, mask=w_mask, other=0.0)
        acc += tl.dot(a, b.to(DOT_DTYPE), input_precision=PRECISION)
        if GATED:
            up += tl.dot(a, b_up.to(DOT_DTYPE), input_precision=PRECISION)
    if GATED:
        acc = acc * tl.sigmoid(acc) * up
    rows = pairs.to(tl.int64)
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(topk_weights_ptr + rows, mask=real, other=0.0).to(tl.float32)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
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
    tiles = dict(DOT_DTYPE=dot_dtype, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=32, BLOCK_K=32)
    inter_out = torch.empty(n, inter, dtype=x.dtype, device=x.device)
    _expert_gemm_kernel[(num_tiles, triton.cdiv(inter, tiles["BLOCK_N"]))](
        x,
        gate_up_proj,
        inter_out,
        topk_weights,
        sorted_pairs,
        tile_expert,
        n,
        num_experts,
        inter,
        hidden,
        x.stride(0),
        *gate_up_proj.stride(),
        inter_out.stride(0),
        TOP_K=top_k,
        GATED=True,
        MUL_ROUTED_WEIGHT=False,
        **tiles,
    )
    out = torch.empty(n, hidden, dtype=x.dtype, device=x.device)
    _expert_gemm_kernel[(num_tiles, triton.cdiv(hidden, tiles["BLOCK_N"]))](
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
        TOP_K=1,
        GATED=False,
        MUL_ROUTED_WEIGHT=True,
        **tiles,
    )
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
