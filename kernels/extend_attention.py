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

from prefixserve.kernels.attention_common import (
    PagedLaunch,
    attend_paged,
    group_rows,
    load_query,
    store_output,
)


@triton.jit
def _extend_kernel(
    paged,
    out_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    stride_ot,
    stride_oh,
    stride_bt,
    BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
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

    tok, heads, mask_r = group_rows(0, query_len, tile, kv_head, paged.GROUP, BLOCK_G, BLOCK_M)
    q = load_query(paged, (q_start + tok)[:, None].to(tl.int64), heads, mask_r)
    end = tl.minimum(seq_len, ctx_len + (tile + 1) * BLOCK_M)  # past the tile's last query
    block_table_ptr = block_tables_ptr + seq * stride_bt
    acc, _, l_i = attend_paged(
        q, ctx_len + tok, paged, block_table_ptr, kv_head, 0, end, BLOCK_N, CAUSAL=True
    )
    store_output(
        out_ptr + (q_start + tok)[:, None].to(tl.int64) * stride_ot + heads[:, None] * stride_oh,
        acc,
        l_i,
        mask_r,
        paged.HEAD_DIM,
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
    launch = PagedLaunch(query, k_cache, v_cache, scale)
    block_g = triton.next_power_of_2(launch.group)
    on_cpu = query.device.type == "cpu"
    block_m = max(1, (32 if on_cpu else 64) // block_g)
    grid = (triton.cdiv(max_query_len, block_m), seq_lens.shape[0], launch.num_kv_heads)
    _extend_kernel[grid](
        launch.kernel_args(),
        out,
        query_start_loc,
        seq_lens,
        block_tables,
        *out.stride()[:2],
        block_tables.stride(0),
        BLOCK_G=block_g,
        BLOCK_M=block_m,
        BLOCK_N=32 if on_cpu else 64,
        num_warps=4,
        num_stages=2,
    )
    return out
