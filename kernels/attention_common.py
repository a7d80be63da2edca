"""What the attention kernels share: query rows packed by KV head, the walk over a paged context
with an online softmax, and the result of a split; with the host-side launch that goes with them.

A kernel here is its own grid, rows and range of positions around the same steps::

    tok, heads, mask_r = group_rows(first, num_tokens, tile, kv_head, ...)  # decode: one token
    q = load_query(paged, tok[:, None], heads, mask_r)
    acc, m_i, l_i = attend_paged(q, q_pos, paged, block_table_ptr, kv_head, start, end, ...)
    store_output(out_ptr + ..., acc, l_i, mask_r, ...)           # extend: the output
    store_split(parts, row, heads, split, acc, m_i, l_i, ...)    # decode, shared prefix: a split's
                                                                 # partial result

Triton inlines a ``@triton.jit`` function called from a kernel, so the helpers cost nothing at
run time. They keep the order of operations the kernels were tuned with: sm_90 register
allocation (and spills) depends on it, e.g. on store addresses being computed after
``split_lse`` and in ``[rows, 1]`` form.

Conventions: a context is read through one row of the block table (position ``p`` lives in block
``block_table[p // BLOCK_SIZE]``, slot ``p % BLOCK_SIZE``); scores are base 2 (``q.k * scale *
log2(e)``, the softmax runs on ``exp2``); accumulation is float32. A split's partial result is
``acc / l`` and ``lse = m + log2(l)`` (base 2); an empty split stores zeros and ``lse = -inf``, so
a merge by log-sum-exp gives it weight exactly 0.

Every attention kernel's first argument is ``paged`` (``PagedArgs``: the query, the cache and the
constexprs of their shapes, from ``PagedLaunch.kernel_args``); a split kernel's partial results
are ``parts`` (``SplitParts``). Triton passes a named tuple as its fields, each specialized as a
separate argument would be, so grouping them changes nothing in the compiled kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # read inside kernels, so a constexpr


@triton.jit
def split_range(ctx_start, ctx_end, split, num_splits, BLOCK_N: tl.constexpr):
    """Positions ``start .. end - 1`` of split ``split`` of ``ctx_start .. ctx_end - 1``: equal
    slices rounded up to whole tiles, so the last splits may be short or empty."""
    split_len = tl.cdiv(tl.cdiv(ctx_end - ctx_start, num_splits), BLOCK_N) * BLOCK_N
    start = ctx_start + split * split_len
    return start, tl.minimum(start + split_len, ctx_end)


@triton.jit
def group_rows(
    first,
    num_tokens,
    tile,
    kv_head,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Tile rows for ``BLOCK_M`` tokens x the ``GROUP`` query heads of one KV head (GQA), so each
    K/V tile is loaded once for the whole group: row ``r`` is token ``first + tile * BLOCK_M + r //
    BLOCK_G`` of tokens ``first .. first + num_tokens - 1``, head ``kv_head * GROUP + r %
    BLOCK_G``. Returns each row's token, head and mask (padded heads, tokens past the last)."""
    offs_r = tl.arange(0, BLOCK_M * BLOCK_G)
    tok = first + tile * BLOCK_M + offs_r // BLOCK_G
    group_idx = offs_r % BLOCK_G
    heads = kv_head * GROUP + group_idx
    return tok, heads, (tok < first + num_tokens) & (group_idx < GROUP)


@triton.jit
def load_rows(row_ptrs, mask_r, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The ``[rows, BLOCK_D]`` tile of head vectors that start at ``row_ptrs`` (``[rows, 1]``);
    masked rows and padded dims read 0."""
    offs_d = tl.arange(0, BLOCK_D)
    return tl.load(
        row_ptrs + offs_d[None, :], mask=mask_r[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0
    )


class PagedArgs(NamedTuple):
    """What every attention kernel takes first (``PagedLaunch.kernel_args``): the query and the
    paged K/V cache as pointers and strides, the softmax scale in base 2 (``scale * log2(e)``),
    and the constexprs their shapes and dtype give (upper case: ``GROUP`` query heads per KV head,
    ``BLOCK_D`` from ``head_block``, the ``tl.dot`` operands from ``dot_operands``)."""

    q_ptr: torch.Tensor
    k_cache_ptr: torch.Tensor
    v_cache_ptr: torch.Tensor
    sm_scale_log2: float
    stride_qt: int
    stride_qh: int
    stride_cb: int
    stride_cs: int
    stride_ch: int
    GROUP: tl.constexpr
    HEAD_DIM: tl.constexpr
    BLOCK_D: tl.constexpr
    BLOCK_SIZE: tl.constexpr
    DOT_DTYPE: tl.constexpr
    PRECISION: tl.constexpr


class SplitParts(NamedTuple):
    """A split kernel's partial results as it writes them (``SplitParts.of``): ``out`` ``[rows,
    heads, splits, head_dim]`` and ``lse`` ``[rows, heads, splits]``, float32, lse base 2, the
    splits of a row and head contiguous in ``lse``."""

    out_ptr: torch.Tensor
    lse_ptr: torch.Tensor
    stride_or: int
    stride_oh: int
    stride_os: int
    stride_lr: int
    stride_lh: int

    @classmethod
    def of(cls, out: torch.Tensor, lse: torch.Tensor) -> SplitParts:
        return cls(out, lse, *out.stride()[:3], *lse.stride()[:2])


@triton.jit
def load_query(paged, tok, heads, mask_r):
    """The query rows of tokens ``tok`` (a scalar, or ``[rows, 1]``), heads ``heads`` (``[rows]``)
    as ``load_rows`` gives them."""
    return load_rows(
        paged.q_ptr + tok * paged.stride_qt + heads[:, None] * paged.stride_qh,
        mask_r,
        paged.HEAD_DIM,
        paged.BLOCK_D,
    )


@triton.jit
def attend_paged(
    q,
    q_pos,
    paged,
    block_table_ptr,
    kv_head,
    start,
    end,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
):
    """Online softmax of ``q`` (``[ROWS, BLOCK_D]``, from ``load_query``; cast to ``DOT_DTYPE``)
    over positions ``start .. end - 1`` of the context behind ``block_table_ptr`` (its row of
    the block table), one KV head, in tiles of ``BLOCK_N`` tokens; with ``CAUSAL`` row ``r`` sees
    positions ``<= q_pos[r]`` only (``q_pos`` is not read otherwise). Returns the float32
    accumulator ``[ROWS, BLOCK_D]``, running max ``m`` and sum ``l`` (``[ROWS]``, base 2; ``l =
    0`` for a row that saw nothing). Every token finds its slot through the block table, so a
    tile may span several cache blocks and one block several tiles."""
    ROWS: tl.constexpr = q.shape[0]
    BLOCK_D: tl.constexpr = q.shape[1]
    DOT_DTYPE: tl.constexpr = paged.DOT_DTYPE
    BLOCK_SIZE: tl.constexpr = paged.BLOCK_SIZE
    q = q.to(DOT_DTYPE)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    mask_d = offs_d < paged.HEAD_DIM
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + offs_n
        mask_n = pos < end
        block = tl.load(block_table_ptr + pos // BLOCK_SIZE, mask=mask_n, other=0)
        slot_off = (
            block.to(tl.int64) * paged.stride_cb
            + (pos % BLOCK_SIZE) * paged.stride_cs
            + kv_head * paged.stride_ch
        )
        kv_offs = slot_off[:, None] + offs_d[None, :]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(paged.k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        s = (
            tl.dot(q, tl.trans(k), input_precision=paged.PRECISION) * paged.sm_scale_log2
        )  # [ROWS, BLOCK_N]
        if CAUSAL:
            s = tl.where(mask_n[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        else:
            s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(paged.v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=paged.PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def split_lse(m_i, l_i):
    """``l`` made safe to divide by (1 for a row that saw nothing) and the base-2 lse ``m +
    log2(l)`` (``-inf`` for such a row) of ``attend_paged``'s running max and sum."""
    nonempty = l_i > 0.0
    l_safe = tl.where(nonempty, l_i, 1.0)
    return l_safe, tl.where(nonempty, m_i + tl.log2(l_safe), float("-inf"))


@triton.jit
def store_output(row_ptrs, acc, l_i, mask_r, HEAD_DIM: tl.constexpr):
    """Store the attention output ``acc / l_i`` (``[rows, BLOCK_D]`` / ``[rows]``, from
    ``attend_paged``) in the pointees' dtype, as head vectors at ``row_ptrs`` (``[rows, 1]``);
    masked rows and padded dims are left alone."""
    offs_d = tl.arange(0, acc.shape[1])
    ptrs = row_ptrs + offs_d[None, :]
    tl.store(
        ptrs,
        (acc / l_i[:, None]).to(ptrs.dtype.element_ty),
        mask=mask_r[:, None] & (offs_d < HEAD_DIM)[None, :],
    )


@triton.jit
def store_split(parts, row, heads, split, acc, m_i, l_i, mask_r, HEAD_DIM: tl.constexpr):
    """Store split ``split``'s partial result (``acc / l`` and its lse, from ``attend_paged``) in
    ``parts`` at row ``row`` of heads ``heads``: ``row`` is a scalar (one row for every tile row,
    decode) or ``[rows]`` (one each, addressed in int64). The addresses are computed after
    ``split_lse`` (see the module docstring)."""
    l_safe, lse = split_lse(m_i, l_i)
    if len(row.shape) == 0:
        out_row = row
    else:
        row = row.to(tl.int64)
        out_row = row[:, None]
    store_output(
        parts.out_ptr
        + out_row * parts.stride_or
        + heads[:, None] * parts.stride_oh
        + split * parts.stride_os,
        acc,
        l_safe,
        mask_r,
        HEAD_DIM,
    )
    tl.store(
        parts.lse_ptr + row * parts.stride_lr + heads * parts.stride_lh + split, lse, mask=mask_r
    )


def head_block(head_dim: int) -> int:
    """``BLOCK_D``: the head dim padded to a power of two, at least 16 (``tl.dot``'s minimum)."""
    return max(16, triton.next_power_of_2(head_dim))


def dot_operands(dtype: torch.dtype, device: torch.device) -> tuple[tl.dtype, str]:
    """Operand dtype and ``input_precision`` of the kernels' ``tl.dot`` calls.

    On GPUs the cache dtype feeds the tensor cores directly, fp32 in exact ("ieee") mode. Triton's
    interpreter computes a bf16 ``tl.dot`` on the raw 16-bit patterns (wrong results), so on CPU
    the operands are upcast to fp32.
    """
    if device.type == "cpu" or dtype == torch.float32:
        return tl.float32, "ieee"
    return (tl.bfloat16 if dtype == torch.bfloat16 else tl.float16), "tf32"


@dataclass(frozen=True, slots=True)
class PagedLaunch:
    """One attention launch over the paged cache: ``query`` ``[tokens, num_heads, head_dim]`` and
    ``k_cache``/``v_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]`` (last dims
    contiguous, V laid out as K), and the softmax ``scale``. What every attention kernel takes
    from them: its first argument (``kernel_args``) and the buffers of its splits' partial results
    (``empty_partials``)."""

    query: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    scale: float

    @property
    def num_kv_heads(self) -> int:
        return self.k_cache.shape[2]

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.query.shape[1] // self.num_kv_heads

    def kernel_args(self) -> PagedArgs:
        """The kernels' ``paged`` argument; its constexprs are wrapped as ``tl.constexpr`` (what
        makes Triton compile them in)."""
        head_dim = self.query.shape[2]
        dot_dtype, precision = dot_operands(self.k_cache.dtype, self.query.device)
        constexprs = (
            self.group,
            head_dim,
            head_block(head_dim),
            self.k_cache.shape[1],
            dot_dtype,
            precision,
        )
        return PagedArgs(
            self.query,
            self.k_cache,
            self.v_cache,
            self.scale * LOG2E,
            *self.query.stride()[:2],
            *self.k_cache.stride()[:3],
            *map(tl.constexpr, constexprs),
        )

    def empty_partials(self, num_rows: int, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers for the splits' partial results: output ``[num_rows, num_heads, num_splits,
        head_dim]`` and lse ``[num_rows, num_heads, num_splits]``, float32."""
        _, num_heads, head_dim = self.query.shape
        device = self.query.device
        out = torch.empty(
            (num_rows, num_heads, num_splits, head_dim), dtype=torch.float32, device=device
        )
        lse = torch.empty((num_rows, num_heads, num_splits), dtype=torch.float32, device=device)
        return out, lse
