"""The attention backend interface: paged KV store + attention over a flattened, mixed batch.

A step's batch is flattened: the query tokens of every scheduled sequence are concatenated, decodes
first (one query token each), then prefill chunks. For sequence ``i``::

    tokens of sequence i in the batch:  query_start_loc[i] .. query_start_loc[i+1]   (query_len_i)
    its context after this step:        seq_lens[i] tokens, positions 0 .. seq_lens[i]-1
    its cached part (already in KV):    positions 0 .. seq_lens[i]-query_len_i-1
    its new part (written this step):   positions seq_lens[i]-query_len_i .. seq_lens[i]-1

    position p of sequence i lives in slot  block_tables[i][p // block_size] * block_size
                                             + p % block_size

Query token at position p attends to every context position <= p (causal). The KV cache of one
layer is a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (index 0: K, 1: V); the
whole cache is ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs to know about one step's batch (tensors on the model's device).

    ``slot_mapping[t]`` is the cache slot where token ``t``'s K/V is written (-1: do not write).
    ``block_tables`` is padded with 0 past each sequence's last block. The first ``num_decodes``
    sequences have exactly one query token each and make up the first ``num_decode_tokens``
    tokens. ``query_lens_cpu`` / ``seq_lens_cpu`` are host copies for backends that need them.
    ``prefix_groups`` names sequences that share leading blocks (see ``TorchAttentionBackend``).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32 (cu_seqlens_q)
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks_per_seq] int32
    max_query_len: int
    max_seq_len: int
    num_decodes: int
    num_decode_tokens: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    # Cascade attention hints: (member sequence indices, m) where every member's block table
    # starts with the same m blocks and every member's queries come after them. Backends that do
    # not use them stay correct; they only save recomputing attention over a shared prefix.
    prefix_groups: list[tuple[list[int], int]] = field(default_factory=list)
    # Per-step state a backend derives from the fields above on its first layer and reuses in
    # every later layer (the torch backend's index tensors). Set only by the backend.
    backend_plan: Any = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def query_start_loc_cpu(self) -> list[int]:
        return [0, *itertools.accumulate(self.query_lens_cpu)]


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
