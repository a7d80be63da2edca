"""``TorchAttentionBackend``: the reference backend, plain torch on CPU or CUDA.

Attention runs as two batched ``scaled_dot_product_attention`` calls, one for the decode group
and one for the prefill group, so a long prefill chunk never pads the decodes to its length::

    context K/V of sequence i: block_tables[i][:ceil(seq_len_i / bs)] gathered into
    (G, L, nkv, hd), L = max seq_len in the group (longer rows masked off)
    query j of sequence i sits at position seq_len_i - query_len_i + j and sees keys 0 .. that
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from prefixserve.attention.backend import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)


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
        nd, ndt = md.num_decodes, md.num_decode_tokens
        parts = []
        if nd > 0:
            parts.append(self._attend(query[:ndt], kv_cache, md, 0, nd, scale))
        if md.num_seqs > nd:
            parts.append(self._attend(query[ndt:], kv_cache, md, nd, md.num_seqs, scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

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
    def _attend(
        query: torch.Tensor,  # [Tg, nh, hd], the group's tokens
        kv_cache: torch.Tensor,
        md: AttentionMetadata,
        first: int,
        last: int,
        scale: float,
    ) -> torch.Tensor:  # [Tg, nh, hd]
        """Attention for sequences ``first .. last-1``, whose tokens are ``query``."""
        device = query.device
        q_lens_cpu, seq_lens_cpu = md.query_lens_cpu[first:last], md.seq_lens_cpu[first:last]
        g, max_q, max_len = last - first, max(q_lens_cpu), max(seq_lens_cpu)
        bs = kv_cache.shape[2]
        nblocks = -(-max_len // bs)
        tables = md.block_tables[first:last, :nblocks].long()  # (G, nb)
        k = kv_cache[0][tables].flatten(1, 2)[:, :max_len]  # (G, L, nkv, hd)
        v = kv_cache[1][tables].flatten(1, 2)[:, :max_len]

        seq_lens = md.seq_lens[first:last].to(torch.int64)  # (G,)
        q_lens = torch.tensor(q_lens_cpu, device=device)  # (G,)
        if max_q == 1 or g == 1:
            q = query.view(g, max_q, *query.shape[1:])  # (G, Q, nh, hd), no padding needed
        else:
            seq_idx = torch.repeat_interleave(torch.arange(g, device=device), q_lens)  # (Tg,)
            starts = torch.cumsum(q_lens, 0) - q_lens
            offs = torch.arange(query.shape[0], device=device) - starts[seq_idx]
            q = query.new_zeros(g, max_q, *query.shape[1:])
            q[seq_idx, offs] = query
        # Padded query rows (j >= query_len) sit at positions >= seq_len: they still see keys
        # < seq_len, so no row is all-masked (no NaN); their outputs are dropped below.
        q_pos = (seq_lens - q_lens)[:, None] + torch.arange(max_q, device=device)  # (G, Q)
        k_pos = torch.arange(max_len, device=device)  # (L,)
        mask = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
            k_pos[None, None, :] < seq_lens[:, None, None]
        )  # (G, Q, L)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),  # (G, nh, Q, hd)
            k.transpose(1, 2),  # (G, nkv, L, hd)
            v.transpose(1, 2),
            attn_mask=mask[:, None],
            scale=scale,
            enable_gqa=q.shape[2] != k.shape[2],
        ).transpose(1, 2)  # (G, Q, nh, hd)
        if max_q == 1 or g == 1:
            return out.reshape(query.shape)
        return out[seq_idx, offs]
