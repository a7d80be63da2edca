"""Paged decode attention on CPU (``cpu_attention.cpp``, built by ``cpu_ops``): writes each
sequence's new K/V into the paged cache, then attends its one query token to its whole context,
reading the blocks in place. A sequence's result is the same alone or in any batch."""

from __future__ import annotations

import torch


def decode_attention(
    query: torch.Tensor,  # [B, num_heads, head_dim] float32
    key: torch.Tensor,  # [B, num_kv_heads, head_dim]
    value: torch.Tensor,  # [B, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], written
    slot_mapping: torch.Tensor,  # [B] int64, -1: write nothing
    block_tables: torch.Tensor,  # [B, W] int32
    seq_lens: torch.Tensor,  # [B] int32, the new token included
    scale: float,
) -> torch.Tensor:  # [B, num_heads, head_dim]
    return torch.ops.prefixserve_cpu.decode_attention(
        query, key, value, kv_cache, slot_mapping, block_tables, seq_lens, scale
    )
