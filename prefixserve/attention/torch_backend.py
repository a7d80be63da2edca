"""``TorchAttentionBackend``: the reference backend, plain torch on CPU or CUDA.

Each query's context splits into up to three parts, each attended without a per-row mask, and the
partial results are merged by log-sum-exp (``out = sum_p e^lse_p out_p / sum_p e^lse_p``)::

    positions of sequence i:  | shared prefix | prior context | this step's chunk |
                              0           start_i     seq_len_i - query_len_i    seq_len_i
    part 1 (prefix groups):   every query of the group, once per GROUP, no mask
    part 2 (prior context):   each query sees all of it; only key padding is masked
    part 3 (the chunk):       causal among the chunk's own tokens (K/V straight from this step)

Prefix groups (``AttentionMetadata.prefix_groups``) are sequences whose block tables start with
the same blocks: requests that hit one cached system prompt, forked samples, beams; attention over
those blocks runs once for the whole group (cascade attention). Decodes (a chunk of one token)
need only part 2 with their own token included. Parts 2 and 3 run in a few batched calls
("buckets"): all decodes together, and prefill chunks grouped by length so a long chunk never pads
many short ones. On CPU every part runs torch's fused flash-attention kernel.
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
            if md.query_lens_cpu[seqs[0]] == 1:
                self._attend_decodes(query, kv_cache, md, qsl, seqs, starts, scale, out, lse)
            else:
                args = (query, key, value, kv_cache, md, qsl, seqs, starts, scale, out, lse)
                self._attend_chunks(*args)
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
    def _attend_decodes(
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
        """Part 2 for one-token chunks: each query sees its context from ``start`` to itself."""
        token_idx = torch.tensor([qsl[i] for i in seqs], device=query.device)
        first = [starts[i] for i in seqs]
        lengths = [md.seq_lens_cpu[i] - f for i, f in zip(seqs, first)]
        k, v, bias = _gather_context(kv_cache, md, seqs, first, lengths)
        o, o_lse = _attention(query[token_idx].unsqueeze(1), k, v, bias, scale)
        out[token_idx] = o[:, 0]
        lse[token_idx] = o_lse[:, 0]

    @staticmethod
    def _attend_chunks(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        qsl: list[int],
        seqs: list[int],
        starts: list[int],
        scale: float,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:
        """Parts 2 and 3 for prefill chunks, padded to the bucket's longest chunk."""
        device = query.device
        q_lens = [md.query_lens_cpu[i] for i in seqs]
        g, max_q = len(seqs), max(q_lens)
        token_idx = torch.tensor(
            [t for i in seqs for t in range(qsl[i], qsl[i] + md.query_lens_cpu[i])], device=device
        )
        rows = torch.repeat_interleave(
            torch.arange(g, device=device), torch.tensor(q_lens, device=device)
        )
        offs = torch.tensor([j for n in q_lens for j in range(n)], device=device)
        q = query.new_zeros(g, max_q, *query.shape[1:])  # (G, Q, nh, hd)
        kc = key.new_zeros(g, max_q, *key.shape[1:])  # (G, Q, nkv, hd), the chunk's own K/V
        vc = value.new_zeros(g, max_q, *value.shape[1:])
        q[rows, offs], kc[rows, offs], vc[rows, offs] = (
            query[token_idx],
            key[token_idx],
            value[token_idx],
        )
        # Part 3: top-left causal; padded keys (j >= query_len) are seen by padded rows only.
        o, o_lse = _attention(q, kc, vc, None, scale, causal=True)  # (G, Q, nh, hd), (G, Q, nh)
        prior = [md.seq_lens_cpu[i] - n - starts[i] for i, n in zip(seqs, q_lens)]
        with_prior = [r for r, p in enumerate(prior) if p > 0]
        if with_prior:  # part 2: the context before the chunk, all visible
            sub = [seqs[r] for r in with_prior]
            k, v, bias = _gather_context(
                kv_cache, md, sub, [starts[i] for i in sub], [prior[r] for r in with_prior]
            )
            idx = torch.tensor(with_prior, device=device)
            o2, lse2 = _attention(q[idx], k, v, bias, scale)
            o[idx], o_lse[idx] = _merge(o[idx], o_lse[idx], o2, lse2)
        out[token_idx] = o[rows, offs]
        lse[token_idx] = o_lse[rows, offs]

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
        out[token_idx], lse[token_idx] = _merge(o1, l1, out[token_idx], lse[token_idx])


def _attention(
    q: torch.Tensor,  # (G, Q, nh, hd)
    k: torch.Tensor,  # (G, L, nkv, hd)
    v: torch.Tensor,  # (G, L, nkv, hd)
    bias: torch.Tensor | None,  # (G, 1, 1, L) additive key padding (0 or -inf), or None
    scale: float,
    causal: bool = False,  # query j sees keys <= j (top-left aligned); bias must be None
) -> tuple[torch.Tensor, torch.Tensor]:  # (G, Q, nh, hd), (G, Q, nh)
    """Softmax attention that also returns each row's log-sum-exp (for merging partial results).

    Query head h reads KV head h // (nh / nkv), as grouped-query attention defines it. Without a
    causal mask the group's query heads are stacked into the query rows of their KV head, so K/V
    are read once per KV head.
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
    o, lse = _sdpa_with_lse(qh, k.transpose(1, 2), v.transpose(1, 2), bias, scale)
    o = o.view(g, nkv, grp, nq, hd).permute(0, 3, 1, 2, 4).reshape(g, nq, nh, hd)
    lse = lse.view(g, nkv, grp, nq).permute(0, 3, 1, 2).reshape(g, nq, nh)
    return o, lse


def _gather_context(
    kv_cache: torch.Tensor,
    md: AttentionMetadata,
    seqs: list[int],
    first: list[int],
    lengths: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V of positions ``first .. first + length`` of each sequence (``first`` block-aligned),
    padded to the longest: (G, L, nkv, hd) twice, and the key-padding bias (G, 1, 1, L)."""
    device = kv_cache.device
    bs = kv_cache.shape[2]
    max_len = max(lengths)
    rows = torch.tensor(seqs, device=device)
    cols = torch.tensor([f // bs for f in first], device=device)[:, None] + torch.arange(
        -(-max_len // bs), device=device
    )
    tables = md.block_tables[rows[:, None], cols.clamp_(max=md.block_tables.shape[1] - 1)].long()
    k = kv_cache[0][tables].flatten(1, 2)[:, :max_len]  # (G, L, nkv, hd)
    v = kv_cache[1][tables].flatten(1, 2)[:, :max_len]
    padding = torch.arange(max_len, device=device) >= torch.tensor(lengths, device=device)[:, None]
    bias = torch.zeros(padding.shape, dtype=k.dtype, device=device).masked_fill_(
        padding, float("-inf")
    )
    return k, v, bias[:, None, None]


def _merge(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two attention results over disjoint key sets: (..., nh, hd) and (..., nh)."""
    total = torch.logaddexp(lse1, lse2)
    merged = o1 * torch.exp(lse1 - total)[..., None] + o2 * torch.exp(lse2 - total)[..., None]
    return merged.to(o1.dtype), total


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
