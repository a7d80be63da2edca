"""Paged attention on CPU (``cpu_attention.cpp``, built by ``cpu_ops``), one query token at a
time: writes the step's new K/V into the paged cache, then attends every query token to its own
context there, reading the blocks in place. A token's result is the same alone, in any batch and
under any chunking of its prompt."""

from __future__ import annotations

import torch

from prefixserve.attention.metadata import AttentionMetadata


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


def token_contexts(md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_seq, token_len)`` of a step's query tokens: each token's sequence and its context
    length (position + 1), from the metadata's host copies."""
    seqs, lens = [], []
    for s, (q, n) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu)):
        seqs += [s] * q
        lens += range(n - q + 1, n + 1)
    device = md.slot_mapping.device
    as_int32 = dict(dtype=torch.int32, device=device)
    return torch.tensor(seqs, **as_int32), torch.tensor(lens, **as_int32)
