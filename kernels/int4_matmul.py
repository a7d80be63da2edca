"""Weight-only int4 matmul: ``y = x W^T`` with ``W`` dequantized tile by tile, never in memory.

``W [N, K]`` is held as ``TritonInt4`` holds it (``prefixserve.models.linear``): ``codes [N, K/2]``
uint8, two codes a byte (low nibble: even ``k``, high nibble: odd ``k``), and per-group
``scales``, ``shifts`` ``[N, K/group]``: ``W[n, k] = code * scale[n, k // group] + shift[n, k //
group]`` (``Int4Weight``).

Grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))``: program ``(i, j)`` accumulates the output tile
``y[i*BM:(i+1)*BM, j*BN:(j+1)*BN]`` in float32 over ``K`` in steps of ``BLOCK_K`` (``K`` must be
a multiple of it; int4 layers have ``K % 32 == 0``). Each step loads a ``[BM, BK]`` tile of ``x``
and the code bytes of a ``[BN, BK]`` tile of ``W``, unpacks and scales them in registers (the
scale and shift of each element's own group) and runs one ``tl.dot``. The weight is read from
memory once per row tile of ``x``: a quarter of the bytes of a float16 weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 32


@triton.jit
def _int4_matmul_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    shifts_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_cn,
    stride_sn,
    stride_ym,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = rm[:, None] < M, rn[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=m_ok, other=0.0)
        byte = tl.load(codes_ptr + rn[:, None] * stride_cn + k[None, :] // 2, mask=n_ok, other=0)
        code = (byte.to(tl.int32) >> ((k[None, :] % 2) * 4)) & 0xF
        group = rn[:, None] * stride_sn + k[None, :] // GROUP
        scale = tl.load(scales_ptr + group, mask=n_ok, other=0.0).to(tl.float32)
        shift = tl.load(shifts_ptr + group, mask=n_ok, other=0.0).to(tl.float32)
        w = code.to(tl.float32) * scale + shift  # (BLOCK_N, BLOCK_K)
        acc += tl.dot(x.to(tl.float32), tl.trans(w))
    out = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_ok & (rn[None, :] < N))


def int4_matmul(
    x: torch.Tensor,  # [M, K]
    codes: torch.Tensor,  # [N, K/2] uint8
    scales: torch.Tensor,  # [N, K/group]
    shifts: torch.Tensor,  # [N, K/group]
    group_size: int,
) -> torch.Tensor:  # [M, N], x's dtype
    m, k = x.shape
    n = codes.shape[0]
    assert k % BLOCK_K == 0, k
    assert codes.shape[1] * 2 == k and scales.shape == shifts.shape == (n, k // group_size)
    x, codes = x.contiguous(), codes.contiguous()
    scales, shifts = scales.contiguous(), shifts.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    _int4_matmul_kernel[grid](
        x, codes, scales, shifts, y, m, n, k,
        x.stride(0), codes.stride(0), scales.stride(0), y.stride(0),
        GROUP=group_size, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=BLOCK_K,
    )  # fmt: skip
    return y
