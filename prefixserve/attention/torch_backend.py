"""``TorchAttentionBackend``: the reference backend, plain torch on CPU or CUDA.

Cascade attention over shared prefixes: sequences whose block tables start with the same blocks
(requests that hit one cached system prompt, forked samples and beams) form a prefix group.
Attention of each query then splits into two parts merged by log-sum-exp::

    group g: shared blocks b_0 .. b_{m-1}  (m * block_size tokens, before every query of g)
    part 1: every query of g against the shared tokens, computed ONCE per group, no mask
    part 2: each query against its own sequence's tokens after the shared ones, causal
    out = (e^lse1 * out1 + e^lse2 * out2) / (e^lse1 + e^lse2)

Part 2 runs in a few batched calls ("buckets"): all decodes together, and prefill chunks grouped
by query length so a long chunk never pads many short ones to its length::

    context K/V of sequence i, from position start_i (its group's shared tokens, else 0):
    blocks block_tables[i][start_i / bs :] gathered into (G, L, nkv, hd), L = max(seq_len - start)
    query j of sequence i sits at position seq_len_i - query_len_i + j and sees keys <= that
"""

from __future__ import annotations

import logging

import torch

from prefixserve.attention.backend import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)

# A prefill bucket may hold at most this many padded query slots per real query token.
MAX_PADDING_FACTOR = 2.0


class TorchAttentionBackend(AttentionBackend):
    """Reference backend; the definition of correct for every other backend."""

    name = "torch"

    def forward(
        self,
        query: torch.Tensor,  # [T, nh, hd]
        key: torch.Tensor,  # [T, nkv, hd]
        value: torch.Tensor,  # [T, nkv, hd]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, nkv, hd]
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, nh, hd]
        md = attn_metadata
        self._store(key, value, kv_cache, md.slot_mapping)
        bs = kv_cache.shape[2]
        qsl = md.query_start_loc_cpu
        starts = [0] * md.num_seqs  # first context position each sequence attends to in part 2
        for members, num_blocks in md.prefix_groups:
            for i in members:
                starts[i] = num_blocks * bs
        out = torch.empty_like(query)
        lse = query.new_empty(query.shape[:2])  # (T, nh)
        for seqs in _buckets(md):
            self._attend_suffix(query, kv_cache, md, qsl, seqs, starts, scale, out, lse)
        for members, num_blocks in md.prefix_groups:
            self._merge_shared(query, kv_cache, md, qsl, members, num_blocks, scale, out, lse)
        return out

    def copy_blocks(self, kv_caches: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        kv_caches[:, :, dst] = kv_caches[:, :, src]

    @staticmethod
    def _store(
        key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Write each token's K/V at its slot; slots of -1 are skipped."""
        nkv, hd = key.shape[1:]
        k_flat = kv_cache[0].view(-1, nkv, hd)  # (num_blocks * bs, nkv, hd)
        v_flat = kv_cache[1].view(-1, nkv, hd)
        keep = slots >= 0
        if not bool(keep.all()):
            key, value, slots = key[keep], value[keep], slots[keep]
        k_flat.index_copy_(0, slots, key)
        v_flat.index_copy_(0, slots, value)

    @staticmethod
    def _attend_suffix(
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        qsl: list[int],
        seqs: list[int],
        starts: list[int],
        scale: float,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:
        """Part 2 for the sequences ``seqs``: each query against its own context from ``start``."""
        device = query.device
        bs = kv_cache.shape[2]
        q_lens = [md.query_lens_cpu[i] for i in seqs]
        seq_lens = [md.seq_lens_cpu[i] for i in seqs]
        first = [starts[i] for i in seqs]
        g, max_q = len(seqs), max(q_lens)
        max_len = max(s - f for s, f in zip(seq_lens, first))
        nblocks = -(-max_len // bs)
        rows = torch.tensor(seqs, device=device)
        start_blocks = torch.tensor([f // bs for f in first], device=device)
        cols = (start_blocks[:, None] + torch.arange(nblocks, device=device)).clamp_(
            max=md.block_tables.shape[1] - 1
        )
        tables = md.block_tables[rows[:, None], cols].long()  # (G, nb)
        k = kv_cache[0][tables].flatten(1, 2)[:, :max_len]  # (G, L, nkv, hd)
        v = kv_cache[1][tables].flatten(1, 2)[:, :max_len]

        token_idx = torch.tensor(
            [t for i in seqs for t in range(qsl[i], qsl[i] + md.query_lens_cpu[i])], device=device
        )
        if max_q == 1:
            q = query[token_idx].unsqueeze(1)  # (G, 1, nh, hd)
            slot_rows, slot_offs = None, None
        else:
            slot_rows = torch.repeat_interleave(
                torch.arange(g, device=device), torch.tensor(q_lens, device=device)
            )
            slot_offs = torch.tensor([j for n in q_lens for j in range(n)], device=device)
            q = query.new_zeros(g, max_q, *query.shape[1:])
            q[slot_rows, slot_offs] = query[token_idx]
        if all(f == 0 and n == sl for f, n, sl in zip(first, q_lens, seq_lens)):
            # Whole prompts: plain causal attention; padded keys are seen by padded rows only.
            o, o_lse = _attention(q, k, v, None, scale, causal=True)  # (G, Q, nh, hd), (G, Q, nh)
        else:
            # Padded query rows (j >= query_len) sit at positions >= seq_len: they still see keys
            # < seq_len, so no row is all-masked (no NaN); their outputs are dropped.
            seq_lens_t = torch.tensor(seq_lens, device=device)
            q_pos = (seq_lens_t - torch.tensor(q_lens, device=device))[:, None] + torch.arange(
                max_q, device=device
            )  # (G, Q)
            k_pos = torch.tensor(first, device=device)[:, None] + torch.arange(
                max_len, device=device
            )
            mask = (k_pos[:, None, :] <= q_pos[:, :, None]) & (
                k_pos[:, None, :] < seq_lens_t[:, None, None]
            )  # (G, Q, L)
            o, o_lse = _attention(q, k, v, mask, scale)
        if slot_rows is None:
            out[token_idx] = o[:, 0]
            lse[token_idx] = o_lse[:, 0]
        else:
            out[token_idx] = o[slot_rows, slot_offs]
            lse[token_idx] = o_lse[slot_rows, slot_offs]

    @staticmethod
    def _merge_shared(
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        qsl: list[int],
        members: list[int],
        num_blocks: int,
        scale: float,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:
        """Part 1 for one prefix group, merged into ``out`` / ``lse`` by log-sum-exp."""
        device = query.device
        token_idx = torch.tensor(
            [t for i in members for t in range(qsl[i], qsl[i] + md.query_lens_cpu[i])],
            device=device,
        )
        shared = md.block_tables[members[0], :num_blocks].long()
        k = kv_cache[0][shared].flatten(0, 1)[None]  # (1, P, nkv, hd)
        v = kv_cache[1][shared].flatten(0, 1)[None]
        q = query[token_idx][None]  # (1, Tg, nh, hd)
        o1, l1 = _attention(q, k, v, None, scale)
        o1, l1 = o1[0], l1[0]
        o2, l2 = out[token_idx], lse[token_idx]
        total = torch.logaddexp(l1, l2)  # (Tg, nh)
        merged = o1 * torch.exp(l1 - total)[..., None] + o2 * torch.exp(l2 - total)[..., None]
        out[token_idx] = merged.to(out.dtype)
        lse[token_idx] = total


def _attention(
    q: torch.Tensor,  # (G, Q, nh, hd)
    k: torch.Tensor,  # (G, L, nkv, hd)
    v: torch.Tensor,  # (G, L, nkv, hd)
    mask: torch.Tensor | None,  # (G, Q, L) True = attend, or None for all
    scale: float,
    causal: bool = False,  # instead of a mask: query j sees keys <= j
) -> tuple[torch.Tensor, torch.Tensor]:  # (G, Q, nh, hd), (G, Q, nh)
    """Softmax attention that also returns each row's log-sum-exp (for merging partial results).

    Query head h reads KV head h // (nh / nkv), as grouped-query attention defines it. Without a
    causal mask the group's query heads are stacked into the query rows of their KV head, so K/V
    are read once per KV head. On CPU this runs torch's fused flash-attention kernel.
    """
    g, nq, nh, hd = q.shape
    nkv = k.shape[2]
    grp = nh // nkv
    if causal:
        qh = q.transpose(1, 2)  # (G, nh, Q, hd)
        kh = k.transpose(1, 2).repeat_interleave(grp, 1)  # (G, nh, L, hd)
        vh = v.transpose(1, 2).repeat_interleave(grp, 1)
        o, lse = _sdpa_with_lse(qh, kh, vh, None, scale, causal=True)
        return o.transpose(1, 2), lse.transpose(1, 2)
    qh = q.view(g, nq, nkv, grp, hd).permute(0, 2, 3, 1, 4).reshape(g, nkv, grp * nq, hd)
    bias = None
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
            ~mask, float("-inf")
        )
        bias = bias[:, None, None].expand(g, 1, grp, nq, mask.shape[-1]).reshape(g, 1, grp * nq, -1)
    o, lse = _sdpa_with_lse(qh, k.transpose(1, 2), v.transpose(1, 2), bias, scale)
    o = o.view(g, nkv, grp, nq, hd).permute(0, 3, 1, 2, 4).reshape(g, nq, nh, hd)
    lse = lse.view(g, nkv, grp, nq).permute(0, 3, 1, 2).reshape(g, nq, nh)
    return o, lse


def _sdpa_with_lse(
    q: torch.Tensor,  # (B, H, Q, hd)
    k: torch.Tensor,  # (B, H, L, hd)
    v: torch.Tensor,
    bias: torch.Tensor | None,  # additive, broadcastable to (B, H, Q, L)
    scale: float,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # (B, H, Q, hd), (B, H, Q)
    if q.device.type == "cpu":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=bias, scale=scale
        )
        return o, lse.float()
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # (B, H, Q, L)
    if causal:
        keep = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill_(~keep, float("-inf"))
    elif bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1)
    o = torch.matmul(torch.exp_(scores.sub_(lse[..., None])), v.float())
    return o.to(q.dtype), lse


def _buckets(md: AttentionMetadata) -> list[list[int]]:
    """Decodes in one bucket; prefill chunks by descending length, padding bounded per bucket."""
    buckets: list[list[int]] = []
    if md.num_decodes:
        buckets.append(list(range(md.num_decodes)))
    prefills = sorted(range(md.num_decodes, md.num_seqs), key=lambda i: -md.query_lens_cpu[i])
    current: list[int] = []
    real = 0
    for i in prefills:
        n = md.query_lens_cpu[i]
        if current and (len(current) + 1) * md.query_lens_cpu[current[0]] > MAX_PADDING_FACTOR * (
            real + n
        ):
            buckets.append(current)
            current, real = [], 0
        current.append(i)
        real += n
    if current:
        buckets.append(current)
    return buckets
