"""Paged decode attention: one query token per sequence, split-K over its context (flash-decoding).

Stage 1, grid ``(num_seqs, num_kv_heads, num_splits)``: a program owns one sequence, one KV head
and one contiguous slice of its context. All ``GROUP = num_heads // num_kv_heads`` query heads
that share the KV head are processed together as the rows of a ``[BLOCK_H, BLOCK_D]`` tile
(GQA grouping; ``BLOCK_H >= 16`` so ``tl.dot`` is legal on GPUs, padded rows are masked). The
program walks its slice in tiles of ``BLOCK_N`` tokens; every token finds its physical slot
through the block table, so a tile may span several cache blocks (any power-of-two block size)
and one block may span several tiles. An online softmax in base 2 keeps a running max ``m``,
sum ``l`` and accumulator; the program writes ``acc / l`` and ``lse = m + log2(l)`` (the walk
and the partial result are attention_common.py's, shared with the other attention kernels).

A sequence's context starts at ``context_starts[b]`` (default 0). Cascade attention sets it past
a shared prefix that another kernel attends to once for the whole group (cascade_attention.py)::

    positions of sequence b:  0 ... start_b | start_b ............................. seq_len_b
                                            |--- split 0 ---| ... |-- split S-1 --|
    split length:  ceil(ceil((seq_len_b - start_b) / S) / BLOCK_N) * BLOCK_N  (some may be empty)

Stage 2, merge_attn_states.py's kernel with grid ``(num_seqs, num_heads)``: merges the splits of
one head by their log-sum-exp, and optionally stores the merged lse (natural log). An empty split
stores ``lse = -inf`` and a zero partial output, so its weight is exactly 0; an empty context
(every split empty) gives a zero output and ``lse = -inf``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from prefixserve.kernels.attention_common import (
    PagedLaunch,
    SplitParts,
    attend_paged,
    load_query,
    split_range,
    store_split,
)
from prefixserve.kernels.merge_attn_states import Parts, merge_parts

_MAX_SPLITS = 64
_MIN_TOKENS_PER_SPLIT = 256
_TARGET_PROGRAMS = 1024


@triton.jit
def _decode_split_kernel(
    paged,
    block_tables_ptr,
    seq_lens_ptr,
    context_starts_ptr,
    num_splits,
    stride_bt,
    parts,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_STARTS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_start = 0
    if HAS_STARTS:
        ctx_start = tl.load(context_starts_ptr + seq)
    start, end = split_range(ctx_start, seq_len, split, num_splits, BLOCK_N)

    offs_h = tl.arange(0, BLOCK_H)
    heads = kv_head * paged.GROUP + offs_h
    mask_h = offs_h < paged.GROUP
    q = load_query(paged, seq, heads, mask_h)
    block_table_ptr = block_tables_ptr + seq * stride_bt
    acc, m_i, l_i = attend_paged(
        q, None, paged, block_table_ptr, kv_head, start, end, BLOCK_N, CAUSAL=False
    )
    store_split(parts, seq, heads, split, acc, m_i, l_i, mask_h, paged.HEAD_DIM)


def default_num_splits(
    num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device
) -> int:
    """Splits per sequence: enough programs to fill a GPU, each split at least a few hundred tokens.

    On CPU (Triton's interpreter) every program costs Python time, so at most 2 splits.
    """
    if device.type == "cpu":
        return 1 if max_seq_len <= 64 else 2
    by_length = triton.cdiv(max_seq_len, _MIN_TOKENS_PER_SPLIT)
    by_occupancy = triton.cdiv(_TARGET_PROGRAMS, num_seqs * num_kv_heads)
    return triton.next_power_of_2(max(1, min(by_length, by_occupancy, _MAX_SPLITS)))


def decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    max_seq_len: int,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    context_starts: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context; writes and returns ``out``.

    ``query``/``out``: ``[num_seqs, num_heads, head_dim]`` (token and head strides free, last dim
    contiguous); ``k_cache``/``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``;
    ``block_tables``: ``[num_seqs, max_blocks]`` int32; ``seq_lens``: ``[num_seqs]`` (each >= 1,
    the query's own token included). ``max_seq_len`` (a host int, an upper bound is fine) only
    sizes the split count; ``num_splits``/``block_n``/``num_warps`` override the tuned defaults.

    ``context_starts`` (``[num_seqs]`` int32, default all 0): the query attends to positions
    ``context_starts[b] .. seq_lens[b] - 1`` only (cascade attention: the rest is a shared
    prefix attended elsewhere); ``max_seq_len`` then only needs to bound ``seq_len - start``.
    ``lse`` (``[num_seqs, num_heads]`` float32, optional) receives each row's log-sum-exp of
    ``scale * q.k`` over those positions, natural log, ``-inf`` for an empty range.
    """
    part_out, part_lse = decode_splits(
        PagedLaunch(query, k_cache, v_cache, scale),
        block_tables,
        seq_lens,
        max_seq_len,
        num_splits,
        block_n,
        num_warps,
        context_starts,
    )
    return merge_splits(part_out, part_lse, out, lse)


def decode_splits(
    launch: PagedLaunch,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    context_starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 of ``decode_attention`` alone (its query, caches and scale as ``launch``, the
    other arguments as there): returns each split's partial output ``[num_seqs, num_heads,
    num_splits, head_dim]`` and its lse ``[num_seqs, num_heads, num_splits]``, both float32, lse
    in base 2 (empty split: zeros and ``-inf``). Cascade attention merges these with the
    shared-prefix parts in one pass."""
    query = launch.query
    num_seqs = query.shape[0]
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, launch.num_kv_heads, max_seq_len, query.device)
    if block_n is None:
        block_n = 32 if query.device.type == "cpu" else (64 if max_seq_len <= 4096 else 128)
    if num_warps is None:
        num_warps = 4
    part_out, part_lse = launch.empty_partials(num_seqs, num_splits)
    _decode_split_kernel[(num_seqs, launch.num_kv_heads, num_splits)](
        launch.kernel_args(),
        block_tables,
        seq_lens,
        seq_lens if context_starts is None else context_starts,
        num_splits,
        block_tables.stride(0),
        SplitParts.of(part_out, part_lse),
        BLOCK_H=max(16, triton.next_power_of_2(launch.group)),
        BLOCK_N=block_n,
        HAS_STARTS=context_starts is not None,
        num_warps=num_warps,
        num_stages=2,
    )
    return part_out, part_lse


def merge_splits(
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stage 2 of ``decode_attention`` alone: ``out`` (and ``lse`` if given, natural log) from
    the partials of ``decode_splits``, layouts as there, by merge_attn_states.py's kernel; writes
    and returns ``out``."""
    merge_parts(Parts(part_out, part_lse), None, out, lse, lse_base2=True, num_warps=4)
    return out
