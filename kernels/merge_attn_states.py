"""Merging attention over disjoint key sets by log-sum-exp (vLLM's ``merge_attn_states``).

Attention over a context splits into parts over disjoint sets of keys, each an output and the lse
of its scores; the whole is their lse-weighted mean::

    out = sum_i e^(lse_i - m) out_i / sum_i e^(lse_i - m),  lse = m + log sum_i e^(lse_i - m)

with ``m`` the largest ``lse_i``. A part with ``lse = -inf`` (no keys) has weight exactly 0 and
its output is never read; when every part is empty the result is zeros and ``lse = -inf``.

Merge kernel, grid ``(T, H)``: combines up to two sets of partials ``a`` and ``b`` per token
(``[R, H, S, D]`` outputs, ``[R, H, S]`` lse), each found through an optional row map (``-1``:
absent), in one pass: ``cascade_decode_attention`` merges the decode kernel's splits with the
shared kernel's, ``decode_attention`` and ``shared_prefix_attention`` one kernel's splits alone,
and ``merge_attn_states`` two finished parts.

lse convention: every lse taken or returned by a public function is the natural log of ``sum
exp(scale * q.k)`` in float32, ``-inf`` for an empty part (as torch's and FlashAttention's). The
kernels' split buffers are base 2 (their online softmax runs on ``exp2``): ``merge_parts`` takes
either (``lse_base2``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from prefixserve.kernels.attention_common import LN2, head_block, load_rows


@triton.jit
def _parts_lse(
    lse_ptr,
    rows_ptr,
    tok,
    head,
    num_parts,
    stride_r,
    stride_h,
    stride_s,
    HAS_ROWS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Row of token ``tok`` in one set of partials, and their lse (-inf: absent)."""
    row = tok
    if HAS_ROWS:
        row = tl.load(rows_ptr + tok)
    offs_s = tl.arange(0, BLOCK_S)
    lse = tl.load(
        lse_ptr + row.to(tl.int64) * stride_r + head * stride_h + offs_s * stride_s,
        mask=offs_s < tl.where(row >= 0, num_parts, 0),
        other=float("-inf"),
    )
    return row, lse


@triton.jit
def _parts_sum(
    out_ptr,
    row,
    head,
    weight,
    stride_r,
    stride_h,
    stride_s,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Weighted sum of one set of partial outputs; parts of weight 0 are never read (they may be
    uninitialised memory, and 0 * nan is nan)."""
    offs_s = tl.arange(0, BLOCK_S)
    parts = load_rows(
        out_ptr + row.to(tl.int64) * stride_r + head * stride_h + offs_s[:, None] * stride_s,
        weight > 0.0,
        HEAD_DIM,
        BLOCK_D,
    ).to(tl.float32)
    return tl.sum(weight[:, None] * parts, axis=0)


@triton.jit
def _merge_kernel(
    a_out_ptr,
    a_lse_ptr,
    a_rows_ptr,
    b_out_ptr,
    b_lse_ptr,
    b_rows_ptr,
    out_ptr,
    out_lse_ptr,
    num_a,
    num_b,
    stride_ar,
    stride_ah,
    stride_as,
    stride_alr,
    stride_alh,
    stride_als,
    stride_br,
    stride_bh,
    stride_bs,
    stride_blr,
    stride_blh,
    stride_bls,
    stride_ot,
    stride_oh,
    stride_olt,
    stride_olh,
    A_ROWS: tl.constexpr,
    B_ROWS: tl.constexpr,
    HAS_B: tl.constexpr,
    STORE_LSE: tl.constexpr,
    LSE_BASE2: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SA: tl.constexpr,
    BLOCK_SB: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    row_a, lse_a = _parts_lse(
        a_lse_ptr,
        a_rows_ptr,
        tok,
        head,
        num_a,
        stride_alr,
        stride_alh,
        stride_als,
        A_ROWS,
        BLOCK_SA,
    )
    m = tl.max(lse_a, axis=0)
    if HAS_B:
        row_b, lse_b = _parts_lse(
            b_lse_ptr,
            b_rows_ptr,
            tok,
            head,
            num_b,
            stride_blr,
            stride_blh,
            stride_bls,
            B_ROWS,
            BLOCK_SB,
        )
        m = tl.maximum(m, tl.max(lse_b, axis=0))
    m = tl.where(m == float("-inf"), 0.0, m)  # nothing to merge: every weight is 0
    # A part alone (the others' lse -inf) gets weight exactly 1: out and lse come back unchanged.
    w_a = tl.exp2(lse_a - m) if LSE_BASE2 else tl.exp(lse_a - m)
    acc = _parts_sum(
        a_out_ptr, row_a, head, w_a, stride_ar, stride_ah, stride_as, HEAD_DIM, BLOCK_D, BLOCK_SA
    )
    total = tl.sum(w_a, axis=0)
    if HAS_B:
        w_b = tl.exp2(lse_b - m) if LSE_BASE2 else tl.exp(lse_b - m)
        acc += _parts_sum(
            b_out_ptr,
            row_b,
            head,
            w_b,
            stride_br,
            stride_bh,
            stride_bs,
            HEAD_DIM,
            BLOCK_D,
            BLOCK_SB,
        )
        total += tl.sum(w_b, axis=0)
    nonempty = total > 0.0
    total_safe = tl.where(nonempty, total, 1.0)
    offs_d = tl.arange(0, BLOCK_D)
    tl.store(
        out_ptr + tok.to(tl.int64) * stride_ot + head * stride_oh + offs_d,
        (acc / total_safe).to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )
    if STORE_LSE:  # natural log
        lse = m * LN2 + tl.log(total_safe) if LSE_BASE2 else m + tl.log(total_safe)
        lse = tl.where(nonempty, lse, float("-inf"))
        tl.store(out_lse_ptr + tok.to(tl.int64) * stride_olt + head * stride_olh, lse)


@dataclass(frozen=True, slots=True)
class Parts:
    """Partial results ``out [R, H, S, D]`` and ``lse [R, H, S]``; token t's are at row t, or at
    ``rows[t]`` when given (``-1``: token t has none)."""

    out: torch.Tensor
    lse: torch.Tensor
    rows: torch.Tensor | None = None


def merge_parts(
    a: Parts,
    b: Parts | None,
    out: torch.Tensor,
    out_lse: torch.Tensor | None,
    lse_base2: bool,
    num_warps: int = 2,
) -> None:
    """``out[t]`` (and ``out_lse[t]``, natural log) from token t's partials in ``a`` and ``b``,
    whose lse are base 2 (the kernels' split buffers) or natural (``lse_base2=False``).
    ``num_warps``: on GPUs (one on CPU)."""
    num_tokens, num_heads, head_dim = out.shape
    if num_tokens == 0:
        return
    b_ = b if b is not None else a
    _merge_kernel[(num_tokens, num_heads)](
        a.out,
        a.lse,
        a.rows if a.rows is not None else a.lse,
        b_.out,
        b_.lse,
        b_.rows if b_.rows is not None else b_.lse,
        out,
        out_lse if out_lse is not None else out,
        a.out.shape[2],
        b_.out.shape[2],
        *a.out.stride()[:3],
        *a.lse.stride(),
        *b_.out.stride()[:3],
        *b_.lse.stride(),
        *out.stride()[:2],
        *(out_lse.stride() if out_lse is not None else (0, 0)),
        A_ROWS=a.rows is not None,
        B_ROWS=b_.rows is not None,
        HAS_B=b is not None,
        STORE_LSE=out_lse is not None,
        LSE_BASE2=lse_base2,
        HEAD_DIM=head_dim,
        BLOCK_D=head_block(head_dim),
        BLOCK_SA=triton.next_power_of_2(a.out.shape[2]),
        BLOCK_SB=triton.next_power_of_2(b_.out.shape[2]),
        num_warps=1 if out.device.type == "cpu" else num_warps,
    )


def merge_attn_states(
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    out: torch.Tensor,
    out_lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Combine attention over two disjoint key sets: ``out = (e^lse_a out_a + e^lse_b out_b) /
    (e^lse_a + e^lse_b)``; returns ``out`` and writes ``out_lse = log(e^lse_a + e^lse_b)``.

    ``out_*``: ``[T, H, D]`` (last dim contiguous, any float dtype; ``out`` may alias either
    input); ``lse_*``: ``[T, H]`` float32, natural log. A part with ``lse = -inf`` is empty: the
    other is returned exactly (its output is not even read); both empty gives zeros and -inf.
    """
    merge_parts(
        Parts(out_a.unsqueeze(2), lse_a.unsqueeze(2)),
        Parts(out_b.unsqueeze(2), lse_b.unsqueeze(2)),
        out,
        out_lse,
        lse_base2=False,
    )
    return out
