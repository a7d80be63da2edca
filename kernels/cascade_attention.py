"""Cascade decode attention: a prefix group's shared K/V is read once for all of its queries.

Sequences of a prefix group start with the same physical blocks (one system prompt behind many
agents, forked samples, beams). Attention over a context splits into parts merged by log-sum-exp
(see ``TorchAttentionBackend``); here each query's context is two parts::

    positions of member b:   0 ............... shared_len | shared_len ........... seq_len_b - 1
    part 1 (shared kernel):  every query token of the group, one program per tile of the group's
                             query rows: each K/V tile of the shared blocks is loaded once per group
    part 2 (decode kernel):  each member alone over its suffix (decode_attention with
                             context_starts = shared_len); a sequence in no group starts at 0

``CascadeGroups`` lays the groups out as tensors, built once per step and reused by every layer.
Example: 7 decode tokens (token t is sequence t), group 0 = {0, 3, 4}, group 1 = {2, 5}::

    token t:                  0    1    2    3    4    5    6
    group of t:               0    -    1    0    0    1    -
    token_idx   [N]         = [0, 3, 4, 2, 5]       group 0's tokens, then group 1's (N = 5 rows)
    token_start [G + 1]     = [0, 3, 5]             group g owns rows token_start[g] .. [g + 1]
    token_rows  [T]         = [0, -1, 3, 1, 2, 4, -1]   row of token t in token_idx, -1 outside
    shared_block_tables [G, max_shared_blocks]      group g's shared blocks (later columns unread)
    shared_lens [G]         = tokens in those blocks
    context_starts [num_seqs] = [L0, 0, L1, L0, L0, L1, 0]   where each member's suffix starts

Shared kernel, grid ``(row tiles, G, num_kv_heads * num_splits)``: a program owns ``BLOCK_M``
rows of one group and all ``GROUP`` query heads of one KV head, packed into ``BLOCK_M * BLOCK_G``
tile rows as in extend_attention (``group_rows``), and one slice of the shared length. No mask
inside the shared part: every query of a group sits after it. It writes a float32 partial output
and a base-2 lse per split into *compact* buffers ``[N, H, S, D]`` / ``[N, H, S]`` (rows of
``token_idx``, so their size follows the group tokens, not the batch).

Three launches in all: ``cascade_decode_attention`` merges the decode kernel's splits with the
shared kernel's in one pass of merge_attn_states.py's kernel (no intermediate rounding to the
model dtype). Every lse this module takes or returns is the natural log; the split buffers between
the kernels are base 2 and never leave the kernels package.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from prefixserve.kernels.attention_common import (
    PagedLaunch,
    SplitParts,
    attend_paged,
    group_rows,
    head_block,
    load_query,
    split_range,
    store_split,
)
from prefixserve.kernels.decode_attention import decode_splits, default_num_splits, merge_splits
from prefixserve.kernels.merge_attn_states import Parts, merge_parts

# cascade_pays (estimates, to be calibrated by a GPU benchmark): the HBM bandwidth a decode
# kernel sustains, in bytes per microsecond (H100 SXM: 3.35 TB/s peak, H200: 4.8); what cascade
# adds to a step per layer: one more launch (the shared kernel) plus the ramp and tail between
# two dependent kernels, a few microseconds without CUDA graphs (assumed 4 us). Its partials
# (float32 out + lse per member, head and split) are written and read once: per member about
# the bytes of MERGE_TOKENS_PER_MEMBER K/V tokens (Llama-3-8B: 2 x 32 heads x 128 x 4 bytes).
HBM_BYTES_PER_US = 3.0e6
EXTRA_LAUNCH_US = 4.0
MERGE_TOKENS_PER_MEMBER = 16
MIN_SAVED_FRACTION = 0.1


@dataclass(frozen=True, slots=True)
class CascadeGroups:
    """A step's prefix groups as the cascade kernels read them (layout in the module docstring).

    Every query token belongs to at most one group, and each group's query tokens all sit after
    its shared part. Host ints size the grids, so launching never reads a device tensor.
    """

    token_idx: torch.Tensor  # [N] int32, the groups' query tokens, group by group
    token_start: torch.Tensor  # [G + 1] int32, group g owns rows token_start[g] .. [g + 1]
    token_rows: torch.Tensor  # [T] int32, row of token t in token_idx, -1 if in no group
    shared_block_tables: torch.Tensor  # [G, max_shared_blocks] int32
    shared_lens: torch.Tensor  # [G] int32, shared positions (tokens) of each group
    context_starts: torch.Tensor  # [num_seqs] int32, first position after the seq's shared part
    num_groups: int  # G
    num_rows: int  # N
    max_group_tokens: int  # the largest group's query-token count
    max_shared_len: int
    max_suffix_len: int  # max over sequences of seq_len - context_start

    @classmethod
    def build(
        cls,
        prefix_groups: Sequence[tuple[Sequence[int], int]],
        block_tables: torch.Tensor,
        query_start_loc: Sequence[int],
        seq_lens: Sequence[int],
        block_size: int,
    ) -> CascadeGroups:
        """From ``AttentionMetadata``'s ``prefix_groups`` (member sequences, shared blocks),
        ``block_tables`` (device, ``[num_seqs, max_blocks]``) and host lists ``query_start_loc``
        (``num_seqs + 1`` entries) and ``seq_lens``. Groups may be of one member."""
        num_tokens = query_start_loc[-1]
        token_idx: list[int] = []
        token_start = [0]
        token_rows = [-1] * num_tokens
        context_starts = [0] * len(seq_lens)
        shared_lens = []
        for members, num_blocks in prefix_groups:
            shared_len = num_blocks * block_size
            for i in members:
                assert context_starts[i] == 0, f"sequence {i} is in two prefix groups"
                query_len = query_start_loc[i + 1] - query_start_loc[i]
                assert seq_lens[i] - query_len >= shared_len, "a query inside the shared part"
                context_starts[i] = shared_len
                for t in range(query_start_loc[i], query_start_loc[i + 1]):
                    token_rows[t] = len(token_idx)
                    token_idx.append(t)
            token_start.append(len(token_idx))
            shared_lens.append(shared_len)
        # One host-to-device copy for all index vectors; the fields are views into it. From
        # pinned memory it is asynchronous: building a step's groups never waits for the device.
        leaders = [members[0] for members, _ in prefix_groups]
        packed = torch.tensor(
            token_idx + token_start + token_rows + shared_lens + context_starts + leaders,
            dtype=torch.int32,
        )
        if block_tables.device.type == "cuda":
            packed = packed.pin_memory()
        packed = packed.to(block_tables.device, non_blocking=True)
        fields = packed.split(
            [len(token_idx), len(token_start), num_tokens, len(shared_lens), len(seq_lens)]
            + [len(leaders)]
        )
        max_blocks = max((n for _, n in prefix_groups), default=0)
        sizes = [token_start[g + 1] - token_start[g] for g in range(len(prefix_groups))]
        return cls(
            token_idx=fields[0],
            token_start=fields[1],
            token_rows=fields[2],
            shared_block_tables=block_tables[:, :max_blocks].index_select(0, fields[5]),
            shared_lens=fields[3],
            context_starts=fields[4],
            num_groups=len(prefix_groups),
            num_rows=len(token_idx),
            max_group_tokens=max(sizes, default=0),
            max_shared_len=max(shared_lens, default=0),
            max_suffix_len=max((n - s for n, s in zip(seq_lens, context_starts)), default=1),
        )


@triton.jit
def _shared_prefix_kernel(
    paged,
    token_idx_ptr,
    token_start_ptr,
    block_tables_ptr,
    shared_lens_ptr,
    num_splits,
    stride_bt,
    parts,
    BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tile = tl.program_id(0)
    grp = tl.program_id(1)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    row_start = tl.load(token_start_ptr + grp)
    num_rows = tl.load(token_start_ptr + grp + 1) - row_start
    if tile * BLOCK_M >= num_rows:
        return
    shared_len = tl.load(shared_lens_ptr + grp)
    start, end = split_range(0, shared_len, split, num_splits, BLOCK_N)

    # Rows of token_idx; padded rows hold q = 0: finite scores, masked at the store.
    row, heads, mask_r = group_rows(
        row_start, num_rows, tile, kv_head, paged.GROUP, BLOCK_G, BLOCK_M
    )
    tok = tl.load(token_idx_ptr + row, mask=mask_r, other=0)
    q = load_query(paged, tok[:, None].to(tl.int64), heads, mask_r)
    block_table_ptr = block_tables_ptr + grp * stride_bt
    acc, m_i, l_i = attend_paged(
        q, None, paged, block_table_ptr, kv_head, start, end, BLOCK_N, CAUSAL=False
    )
    store_split(parts, row, heads, split, acc, m_i, l_i, mask_r, paged.HEAD_DIM)


def _shared_parts(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    groups: CascadeGroups,
    scale: float,
    num_splits: int | None,
    block_n: int | None,
) -> Parts:
    """Launch the shared kernel; partials of every group row, each split of the shared length."""
    launch = PagedLaunch(query, k_cache, v_cache, scale)
    block_g = triton.next_power_of_2(launch.group)
    # Tile shape: rows x BLOCK_N keys. Compiled for sm_90 (bf16, head_dim <= 128), 16 to 64 rows
    # x 64 keys fit 8 warps without register spills (190-250 registers) where 4 warps spill;
    # head_dim 256 fits 32 x 32 on 4 warps. The interpreter wants few, large programs.
    if query.device.type == "cpu":
        rows, default_block_n, num_warps = 32, 32, 4
    elif head_block(query.shape[2]) <= 128:
        rows, default_block_n, num_warps = 64, 64, 8
    else:
        rows, default_block_n, num_warps = 32, 32, 4
    # No more tokens a tile than the largest group has, and at least 16 rows in all: tl.dot
    # needs M >= 16 on GPUs (padded rows are masked).
    block_m = max(1, rows // block_g)
    block_m = min(block_m, triton.next_power_of_2(groups.max_group_tokens))
    block_m = max(block_m, triton.cdiv(16, block_g))
    num_tiles = triton.cdiv(groups.max_group_tokens, block_m)
    if num_splits is None:
        num_splits = default_num_splits(
            groups.num_groups * num_tiles, launch.num_kv_heads, groups.max_shared_len, query.device
        )
    parts = Parts(*launch.empty_partials(groups.num_rows, num_splits), groups.token_rows)
    grid = (num_tiles, groups.num_groups, launch.num_kv_heads * num_splits)
    _shared_prefix_kernel[grid](
        launch.kernel_args(),
        groups.token_idx,
        groups.token_start,
        groups.shared_block_tables,
        groups.shared_lens,
        num_splits,
        groups.shared_block_tables.stride(0),
        SplitParts.of(parts.out, parts.lse),
        BLOCK_G=block_g,
        BLOCK_M=block_m,
        BLOCK_N=block_n or default_block_n,
        num_warps=num_warps,
        num_stages=2,
    )
    return parts


def shared_prefix_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    groups: CascadeGroups,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    num_splits: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every group's query tokens over the group's shared blocks (no mask); writes
    and returns ``out`` and ``lse``.

    ``query``/``out``: ``[T, num_heads, head_dim]`` (last dim contiguous, ``out`` in any float
    dtype); ``lse``: ``[T, num_heads]`` float32, natural log. A token in no group gets a zero
    output and ``lse = -inf``, so ``merge_attn_states`` with its other part returns that part.
    ``num_splits`` splits the shared length (default: by length and occupancy).
    """
    if groups.num_groups == 0:
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    parts = _shared_parts(query, k_cache, v_cache, groups, scale, num_splits, block_n)
    merge_parts(parts, None, out, lse, lse_base2=True)
    return out, lse


def cascade_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    groups: CascadeGroups,
    scale: float,
    out: torch.Tensor,
    num_splits: int | None = None,
    shared_splits: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """``decode_attention`` (same layouts: query token b is sequence b) that reads each group's
    shared blocks once for all its members; writes and returns ``out``.

    Three launches: the decode kernel's splits over each sequence's suffix (``context_starts``),
    the shared kernel over the groups, one merge of both into ``out``. Without groups it is
    ``decode_attention`` (the decode kernel's splits, its own merge). ``num_splits`` /
    ``shared_splits`` override the split counts of the suffixes / the shared lengths.
    """
    suffix_out, suffix_lse = decode_splits(
        PagedLaunch(query, k_cache, v_cache, scale),
        block_tables,
        seq_lens,
        groups.max_suffix_len,
        num_splits,
        block_n,
        context_starts=groups.context_starts,
    )
    if groups.num_groups == 0:
        return merge_splits(suffix_out, suffix_lse, out)
    shared = _shared_parts(query, k_cache, v_cache, groups, scale, shared_splits, block_n)
    merge_parts(Parts(suffix_out, suffix_lse), shared, out, None, lse_base2=True)
    return out


def cascade_pays(
    group_size: int,
    shared_len: int,
    suffix_lens: Sequence[int],
    kv_bytes_per_token: int = 4096,
) -> bool:
    """Whether a prefix group should take the cascade path on a GPU (pure Python, per step).

    Decode attention is bound by HBM reads of K/V. Cascade reads the shared part once instead of
    ``group_size`` times, saving ``(group_size - 1) * shared_len`` token reads per layer; it costs
    one more kernel launch per layer (``EXTRA_LAUNCH_US``) and the float32 partials of each member.
    It pays when the bytes saved take longer to read than that overhead, and when they are at
    least ``MIN_SAVED_FRACTION`` of the group's attention traffic (below that, the estimate's error
    is as large as the gain). The launch is shared by every group of a step; charging it to each
    group is conservative. ``suffix_lens`` are the members' tokens after the shared part (read
    once either way). ``kv_bytes_per_token``: K and V of one token in one layer, ``2 *
    num_kv_heads * head_dim * dtype bytes`` (default: 8 KV heads x 128 x bf16, Llama-3-8B).

    With the defaults the launch costs ``EXTRA_LAUNCH_US * HBM_BYTES_PER_US / 4096`` ~ 2,930
    token reads, so 8 members pay from a shared length of ~440 tokens, 32 members from ~110,
    2 members from ~2,960; a model with 2 KV heads x 64 (512 bytes a token) needs 8x longer.
    """
    if group_size < 2 or shared_len <= 0:
        return False
    saved = (group_size - 1) * shared_len
    overhead = EXTRA_LAUNCH_US * HBM_BYTES_PER_US / kv_bytes_per_token
    overhead += group_size * MERGE_TOKENS_PER_MEMBER
    plain = group_size * shared_len + sum(suffix_lens)
    return saved > overhead and saved >= MIN_SAVED_FRACTION * plain
