"""Prefix-extend attention: new tokens of each sequence attend to their cached prefix and causally
to each other, all read through the block table (serves chunked prefill and prefix-cache hits).

The KV store runs first, so prefix and new K/V both already live in the paged cache::

    sequence i:   positions 0 .......... ctx_len-1 | ctx_len ........... seq_len-1
                  cached prefix (earlier steps)     | new tokens (query rows, this step)
    query row j sits at position ctx_len + j and sees every position <= ctx_len + j

Grid ``(cdiv(max_query_len, BLOCK_M), num_seqs, num_kv_heads)``. A program owns ``BLOCK_M``
consecutive query tokens of one sequence and all ``GROUP`` query heads sharing one KV head,
packed into ``BLOCK_M * BLOCK_G`` rows (row ``r`` is token ``r // BLOCK_G``, head ``r % BLOCK_G``;
heads past ``GROUP`` are masked), so each K/V tile is loaded once for the whole group. It walks
the context in tiles of ``BLOCK_N`` tokens up to its last query position, gathering each token's
slot through the block table, with an online softmax (base 2) and a causal mask at positions.
Every real row sees position 0 in the first tile, so no row's running max stays ``-inf``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from prefixserve.kernels.decode_attention import dot_operands

_LOG2E = 1.4426950408889634


@triton.jit
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    sm_scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - query_len

    offs_r = tl.arange(0, BLOCK_M * BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    tok = tile * BLOCK_M + offs_r // BLOCK_G
    group_idx = offs_r % BLOCK_G
    heads = kv_head * GROUP + group_idx
    mask_r = (tok < query_len) & (group_idx < GROUP)
    mask_d = offs_d < HEAD_DIM
    q_pos = ctx_len + tok
    q = tl.load(
        q_ptr
        + (q_start + tok)[:, None].to(tl.int64) * stride_qt
        + heads[:, None] * stride_qh
        + offs_d[None, :],
        mask=mask_r[:, None] & mask_d[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * BLOCK_G, BLOCK_D], dtype=tl.float32)
    end = tl.minimum(seq_len, ctx_len + (tile + 1) * BLOCK_M)
    for tile_start in range(0, end, BLOCK_N):
        pos = tile_start + offs_n
        mask_n = pos < end
        block = tl.load(
            block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=mask_n, other=0
        )
        slot_off = (
            block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        )
        kv_offs = slot_off[:, None] + offs_d[None, :]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale_log2
        s = tl.where(mask_n[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr
        + (q_start + tok)[:, None].to(tl.int64) * stride_ot
        + heads[:, None] * stride_oh
        + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask_r[:, None] & mask_d[None, :],
    )


def extend_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Causal attention of a varlen batch of new tokens over their paged context; returns ``out``.

    ``query``/``out``: ``[num_tokens, num_heads, head_dim]`` (last dim contiguous); sequence ``i``
    owns rows ``query_start_loc[i] .. query_start_loc[i+1]`` (absolute indices into ``query``, so
    a slice of the metadata works on the whole flattened batch). ``seq_lens[i]`` counts the cached
    prefix plus the new tokens, whose K/V must already be in ``k_cache``/``v_cache``
    (``[num_blocks, block_size, num_kv_heads, head_dim]``). ``max_query_len`` is a host int.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    block_g = triton.next_power_of_2(group)
    on_cpu = query.device.type == "cpu"
    rows = 32 if on_cpu else 64
    block_m = max(1, rows // block_g)
    block_n = 32 if on_cpu else 64
    dot_dtype, precision = dot_operands(k_cache.dtype, query.device)
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_kv_heads)
    _extend_kernel[grid](
        query,
        k_cache,
        v_cache,
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        BLOCK_G=block_g,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_DTYPE=dot_dtype,
        PRECISION=precision,
        num_warps=4,
        num_stages=2,
    )
    return out
