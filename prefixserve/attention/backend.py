"""The attention backend interface: paged KV store + attention over a flattened, mixed batch.

The batch's layout (``AttentionMetadata``) is drawn in ``prefixserve.attention.metadata``. The KV
cache of one layer is a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0:
K, 1: V); the whole cache is ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.

One step context. Before the model runs, the model runner asks the backend to ``plan`` the step:
the result (an ``AttentionStep``) is everything every layer's ``forward`` reads of the step, and
the only way step data reaches attention, eager or replayed::

    ModelRunner: metadata = build_attention_metadata(spans)     host lists + tensors
                 step = backend.plan(metadata, kv_caches[0])    derived once, before the model
    model(ids, positions, kv_caches, step)  -> every layer: backend.forward(q, k, v, cache, step)

A plan holds tensors (and, for backends that read host figures, the metadata itself); the C++
CPU backend's plan of a decode step is tensors alone (``cpu_backend.PagedStep``), so a compiled
step takes them as graph inputs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch

from prefixserve.attention.metadata import AttentionMetadata


class AttentionStep(Protocol):
    """What a backend's ``plan`` returns; the model reads ``slot_mapping`` alone (to write K/V of
    tokens whose attention it skips), the backend everything else."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1: write nothing


class AttentionBackend(ABC):
    """Writes a step's new K/V into the paged cache and runs attention over it.

    Invariants every backend keeps: ``forward`` stores ``key``/``value`` at ``slot_mapping`` before
    any query reads them, so a query sees its own token and every earlier new token of its
    sequence; slots of -1 are never written; the result equals dense causal attention of each
    sequence over its whole context (the reference is ``TorchAttentionBackend``).
    """

    name: str = "abstract"

    @abstractmethod
    def plan(self, attn_metadata: AttentionMetadata, kv_cache: torch.Tensor) -> AttentionStep:
        """The step's attention context, built once before the model runs (``kv_cache``: one
        layer's, for its shape and dtype). Raises ``ValueError`` for a sequence without query
        tokens."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        step: AttentionStep,  # this backend's ``plan`` of the step
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
