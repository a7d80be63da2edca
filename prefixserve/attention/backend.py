"""The attention backend interface: paged KV store + attention over a flattened, mixed batch.

The batch's layout (``AttentionMetadata``) is drawn in ``prefixserve.attention.metadata``. The KV
cache of one layer is a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0:
K, 1: V); the whole cache is ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from prefixserve.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Writes a step's new K/V into the paged cache and runs attention over it.

    Invariants every backend keeps: ``forward`` stores ``key``/``value`` at ``slot_mapping`` before
    any query reads them, so a query sees its own token and every earlier new token of its
    sequence; slots of -1 are never written; the result equals dense causal attention of each
    sequence over its whole context (the reference is ``TorchAttentionBackend``).
    """

    name: str = "abstract"

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store the new K/V into ``kv_cache`` and return attention outputs for every query token."""

    @abstractmethod
    def store_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        """Write token ``t``'s K/V at cache slot ``slots[t]``; slots of -1 are not written."""

    @abstractmethod
    def copy_blocks(self, kv_caches: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write: for every layer and both K and V, copy block ``src[i]`` onto ``dst[i]``.

        ``kv_caches`` is the whole cache ``[num_layers, 2, num_blocks, block_size, kv_heads, dim]``.
        """
