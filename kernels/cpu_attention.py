"""Paged attention on CPU (``cpu_attention.cpp``, built by ``cpu_ops``), one query token at a
time: writes the step's new K/V into the paged cache, then attends every query token to its own
context there, reading the blocks in place. A token's result is the same alone, in any batch and
under any chunking of its prompt. The kernels import nothing of the engine: ``(token_seq,
token_len)`` come from ``attention.metadata.token_contexts``."""

from __future__ import annotations

import torch


def paged_attention(
    query: torch.Tensor,  # [T, num_heads, head_dim] float32
    key: torch.Tensor,  # [T, num_kv_heads, head_dim]
    value: torch.Tensor,  # [T, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim], written
    slot_mapping: torch.Tensor,  # [T] int64, -1: write nothing
    block_tables: torch.Tensor,  # [S, W] int32
    token_seq: torch.Tensor,  # [T] int32: each token's row of block_tables
    token_len: torch.Tensor,  # [T] int32: each token's context length (its position + 1)
    scale: float,
) -> torch.Tensor:  # [T, num_heads, head_dim]
    return torch.ops.prefixserve_cpu.paged_attention(
        query, key, value, kv_cache, slot_mapping, block_tables, token_seq, token_len, scale
    )
