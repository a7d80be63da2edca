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
need only part 2 with their own token included; a step of decodes alone, with no prefix group,
is one kernel call per layer and returns its output as is (no log-sum-exp to merge). Parts 2
and 3 run in a few batched calls ("buckets"): all decodes together, and prefill chunks grouped
by length so a long chunk never pads many short ones. On CPU every part runs torch's fused
flash-attention kernel.

What depends only on the batch's shape (index tensors, buckets, key-padding biases, the blocks
each part reads) is derived once per step by ``plan`` (``_StepPlan``, kept in the metadata's
``backend_plan``; the step context is the metadata itself) and reused by every layer. A group's
shared blocks that lie consecutively in the pool are read as a view of the cache instead of
being gathered. The C++ paged kernel's backend (``cpu_backend``) builds on this one.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from prefixserve.attention.backend import AttentionBackend
from prefixserve.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

# A prefill chunk joins a bucket (is padded to the bucket's longest chunk) only if that pads it to
# at most MAX_PADDING_FACTOR times its length, or if the longest chunk has at most
# FREE_PADDING_TOKENS tokens: there, one call for many short chunks beats the padding it costs.
MAX_PADDING_FACTOR = 1.25
FREE_PADDING_TOKENS = 64


class TorchAttentionBackend(AttentionBackend):
    """Reference backend; the definition of correct for every other backend."""

    name = "torch"

    def plan(self, attn_metadata: AttentionMetadata, kv_cache: torch.Tensor) -> AttentionMetadata:
        """The metadata, its ``backend_plan`` filled (``_StepPlan``)."""
        md = attn_metadata
        if 0 in md.query_lens_cpu:
            raise ValueError("every sequence of a batch needs at least one query token")
        md.backend_plan = _StepPlan.build(md, kv_cache.shape[2], kv_cache.device, kv_cache.dtype)
        return md

    def forward(
        self,
        query: torch.Tensor,  # [T, nh, hd]
        key: torch.Tensor,  # [T, nkv, hd]
        value: torch.Tensor,  # [T, nkv, hd]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, nkv, hd]
        step: AttentionMetadata,  # planned
        scale: float,
    ) -> torch.Tensor:  # [T, nh, hd]
        md = step
        plan = md.backend_plan
        if not isinstance(plan, _StepPlan):
            raise RuntimeError("the torch backend runs a step its plan() planned")
        _write_kv(key, value, kv_cache, md.slot_mapping, plan.slots_valid)
        nd = md.num_decodes
        if nd == query.shape[0] and not plan.shared:  # a pure decode step, the common case
            k, v = plan.decodes.read(kv_cache)
            return _decode_attention(query, k, v, plan.decodes.bias, scale)
        out = torch.empty_like(query)
        lse = query.new_empty(query.shape[:2])  # (T, nh)
        if nd:  # the decodes are tokens 0 .. nd - 1
            k, v = plan.decodes.read(kv_cache)
            o, o_lse = _attention(query[:nd].unsqueeze(1), k, v, plan.decodes.bias, scale)
            out[:nd], lse[:nd] = o[:, 0], o_lse[:, 0]
        for chunk in plan.chunks:
            chunk.attend(query, key, value, kv_cache, scale, out, lse)
        for tokens, ctx in plan.shared:
            o1, l1 = _attention(query[tokens][None], *ctx.read(kv_cache), None, scale)
            out[tokens], lse[tokens] = _merge(o1[0], l1[0], out[tokens], lse[tokens])
        return out

    def store_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Write each token's K/V at its slot; slots of -1 are skipped."""
        _write_kv(key, value, kv_cache, slots, bool((slots >= 0).all()))

    def copy_blocks(self, kv_caches: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        kv_caches[:, :, dst] = kv_caches[:, :, src]


def _write_kv(
    key: torch.Tensor,  # (T, nkv, hd)
    value: torch.Tensor,
    kv_cache: torch.Tensor,  # (2, num_blocks, block_size, nkv, hd)
    slots: torch.Tensor,  # (T,)
    slots_valid: bool,  # no slot is -1
) -> None:
    """K and V in one ``index_copy_`` (K/V stacked), skipping tokens at slot -1."""
    if not slots_valid:
        keep = slots >= 0
        key, value, slots = key[keep], value[keep], slots[keep]
    flat = kv_cache.view(2, -1, *kv_cache.shape[3:])  # (2, num_blocks * bs, nkv, hd)
    flat.index_copy_(1, slots, torch.stack((key, value)))


def _decode_attention(
    q: torch.Tensor,  # (G, nh, hd): one query token per sequence
    k: torch.Tensor,  # (G, L, nkv, hd)
    v: torch.Tensor,
    bias: torch.Tensor | None,  # (G, 1, 1, L) key padding, or None
    scale: float,
) -> torch.Tensor:  # (G, nh, hd)
    """``_attention`` for one query per sequence, without the log-sum-exp nobody merges: the
    same kernel on the same operands (so the same values), in a few ops instead of a dozen
    (dispatch overhead is most of a decode step's attention on CPU)."""
    g, nh, hd = q.shape
    nkv = k.shape[2]
    qh = q.reshape(g, nkv, nh // nkv, hd)  # a KV head's query heads are its query rows
    o, _ = _sdpa_with_lse(qh, k.transpose(1, 2), v.transpose(1, 2), bias, scale)
    return o.reshape(g, nh, hd)


@dataclass(slots=True)
class _Context:
    """A batch of G stretches of cached context, each a run of whole blocks, padded to ``length``.

    ``blocks`` (G, nb) names the blocks to gather; ``run`` replaces it when G == 1 and the blocks
    are consecutive in the pool, so they are read as a view without a copy. ``bias`` (G, 1, 1,
    length) masks each stretch's padding with -inf; None when no stretch is padded.
    """

    length: int
    blocks: torch.Tensor | None = None
    run: tuple[int, int] | None = None
    bias: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        tables: list[list[int]],
        firsts: list[int],
        lengths: list[int],
        bs: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> _Context:
        """Positions ``first .. first + length`` of each table (``first`` block-aligned)."""
        length = max(lengths)
        nb = -(-length // bs)
        rows = [t[f // bs : f // bs + nb] for t, f in zip(tables, firsts)]
        if len(rows) == 1 and rows[0] == list(range(rows[0][0], rows[0][0] + nb)):
            return cls(length, run=(rows[0][0], rows[0][0] + nb))
        rows = [r + [r[-1]] * (nb - len(r)) for r in rows]  # padding blocks are masked out
        ctx = cls(length, blocks=torch.tensor(rows, dtype=torch.int64, device=device))
        if any(n != length for n in lengths):
            padding = torch.arange(length) >= torch.tensor(lengths)[:, None]
            bias = torch.zeros(padding.shape, dtype=dtype).masked_fill_(padding, float("-inf"))
            ctx.bias = bias[:, None, None].to(device)
        return ctx

    def read(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every stretch, (G, length, nkv, hd) each."""
        if self.run is not None:
            a, b = self.run
            k, v = kv_cache[0, a:b], kv_cache[1, a:b]
            return k.flatten(0, 1)[None, : self.length], v.flatten(0, 1)[None, : self.length]
        g = self.blocks.shape[0]
        flat = self.blocks.flatten()
        k = kv_cache[0].index_select(0, flat).view(g, -1, *kv_cache.shape[3:])
        v = kv_cache[1].index_select(0, flat).view(g, -1, *kv_cache.shape[3:])
        return k[:, : self.length], v[:, : self.length]


@dataclass(slots=True)
class _ChunkBucket:
    """Prefill chunks attended together (parts 2 and 3), padded to the longest (``max_q``)."""

    token_idx: torch.Tensor  # (N,) the chunks' tokens in the batch
    rows: torch.Tensor  # (N,) each token's chunk within the bucket
    offs: torch.Tensor  # (N,) each token's offset within its chunk
    num_chunks: int
    max_q: int
    prior: tuple[torch.Tensor, _Context] | None  # chunks with earlier context, and that context

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> None:
        shape = (self.num_chunks, self.max_q)
        q = query.new_zeros(*shape, *query.shape[1:])  # (G, Q, nh, hd)
        kc = key.new_zeros(*shape, *key.shape[1:])  # (G, Q, nkv, hd), the chunk's own K/V
        vc = value.new_zeros(*shape, *value.shape[1:])
        ti, rows, offs = self.token_idx, self.rows, self.offs
        q[rows, offs], kc[rows, offs], vc[rows, offs] = query[ti], key[ti], value[ti]
        # Part 3: top-left causal; padded keys (j >= query_len) are seen by padded rows only.
        o, o_lse = _attention(q, kc, vc, None, scale, causal=True)  # (G, Q, nh, hd), (G, Q, nh)
        if self.prior is not None:  # part 2: the context before the chunk, all visible
            idx, ctx = self.prior
            k, v = ctx.read(kv_cache)
            o2, lse2 = _attention(q[idx], k, v, ctx.bias, scale)
            o[idx], o_lse[idx] = _merge(o[idx], o_lse[idx], o2, lse2)
        out[ti], lse[ti] = o[rows, offs], o_lse[rows, offs]


@dataclass(slots=True)
class _StepPlan:
    """What attention reads and writes in one step, derived once from the metadata and reused by
    every layer: the decodes' context, the prefill buckets, and per prefix group its query tokens
    (a slice when they are adjacent in the batch, as the model runner orders them) and its shared
    blocks."""

    decodes: _Context | None
    chunks: list[_ChunkBucket]
    shared: list[tuple[slice | torch.Tensor, _Context]]
    slots_valid: bool  # no token of the step has slot -1 (nothing to filter before the write)

    @classmethod
    def build(
        cls, md: AttentionMetadata, bs: int, device: torch.device, dtype: torch.dtype
    ) -> _StepPlan:
        qsl, q_lens, seq_lens = md.query_start_loc_cpu, md.query_lens_cpu, md.seq_lens_cpu
        tables = md.block_tables.tolist()
        starts = [0] * md.num_seqs  # first context position each sequence attends to in part 2
        for members, num_blocks in md.prefix_groups:
            for i in members:
                starts[i] = num_blocks * bs

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        def context(seqs: list[int], lengths: list[int]) -> _Context:
            firsts = [starts[i] for i in seqs]
            return _Context.build([tables[i] for i in seqs], firsts, lengths, bs, device, dtype)

        decodes = None
        if md.num_decodes:
            seqs = list(range(md.num_decodes))
            decodes = context(seqs, [seq_lens[i] - starts[i] for i in seqs])
        chunks = []
        for seqs in _buckets(md):
            lens = [q_lens[i] for i in seqs]
            prior = [seq_lens[i] - n - starts[i] for i, n in zip(seqs, lens)]
            with_prior = [r for r, p in enumerate(prior) if p > 0]
            chunks.append(
                _ChunkBucket(
                    token_idx=tensor([t for i in seqs for t in range(qsl[i], qsl[i + 1])]),
                    rows=tensor([r for r, n in enumerate(lens) for _ in range(n)]),
                    offs=tensor([j for n in lens for j in range(n)]),
                    num_chunks=len(seqs),
                    max_q=max(lens),
                    prior=(
                        tensor(with_prior),
                        context([seqs[r] for r in with_prior], [prior[r] for r in with_prior]),
                    )
                    if with_prior
                    else None,
                )
            )
        shared = []
        for members, num_blocks in md.prefix_groups:
            tokens = [t for i in members for t in range(qsl[i], qsl[i + 1])]
            adjacent = tokens == list(range(tokens[0], tokens[0] + len(tokens)))
            sel = slice(tokens[0], tokens[0] + len(tokens)) if adjacent else tensor(tokens)
            shared_len = num_blocks * bs
            ctx = _Context.build([tables[members[0]]], [0], [shared_len], bs, device, dtype)
            shared.append((sel, ctx))
        return cls(decodes, chunks, shared, bool((md.slot_mapping >= 0).all()))


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
    """Prefill chunks by descending length, in buckets of similar length (decodes are not here)."""
    buckets: list[list[int]] = []
    for i in sorted(range(md.num_decodes, md.num_seqs), key=lambda i: -md.query_lens_cpu[i]):
        n = md.query_lens_cpu[i]
        if buckets:
            longest = md.query_lens_cpu[buckets[-1][0]]
            if longest <= FREE_PADDING_TOKENS or longest <= MAX_PADDING_FACTOR * n:
                buckets[-1].append(i)
                continue
        buckets.append([i])
    return buckets
