"""``AttentionMetadata`` and its one builder, used by the model runner, the tests and the GPU check.

A step's batch is flattened: the query tokens of every scheduled sequence are concatenated, decodes
first (one query token each), then prefill chunks. For sequence ``i``::

    tokens of sequence i in the batch:  query_start_loc[i] .. query_start_loc[i+1]   (query_len_i)
    its context after this step:        seq_lens[i] tokens, positions 0 .. seq_lens[i]-1
    its cached part (already in KV):    positions 0 .. seq_lens[i]-query_len_i-1
    its new part (written this step):   positions seq_lens[i]-query_len_i .. seq_lens[i]-1

    position p of sequence i lives in slot  block_tables[i][p // block_size] * block_size
                                             + p % block_size

Query token at position p attends to every context position <= p (causal).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from prefixserve.attention.prefix_groups import plan_prefix_groups


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs to know about one step's batch (tensors on the model's device).

    ``slot_mapping[t]`` is the cache slot where token ``t``'s K/V is written (-1: do not write).
    ``block_tables`` is padded with 0 past each sequence's last block. The first ``num_decodes``
    sequences have exactly one query token each and make up the first ``num_decode_tokens``
    tokens. ``query_lens_cpu`` / ``seq_lens_cpu`` are host copies for backends that need them.
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
    # Cascade attention hints (``plan_prefix_groups``): (member sequence indices, m) where every
    # member's block table starts with the same m blocks and every member's queries come after
    # them. Backends that do not use them stay correct; they only save re-reading a shared prefix.
    prefix_groups: list[tuple[list[int], int]] = field(default_factory=list)
    # Per-step state a backend derives from the fields above in its ``plan``, before the model
    # runs, and every layer reads (the torch backend's index tensors). Set only by the backend.
    backend_plan: Any = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def query_start_loc_cpu(self) -> list[int]:
        return [0, *itertools.accumulate(self.query_lens_cpu)]

    def first_decodes(self, n: int) -> AttentionMetadata:
        """The metadata of this batch's first ``n`` sequences, which must be decodes: views of
        these tensors, host figures of those rows, no prefix groups. A CUDA graph of ``n`` rows
        captures it over static buffers built once for the largest batch."""
        assert 1 <= n <= self.num_decodes, (n, self.num_decodes)
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:n],
            query_start_loc=self.query_start_loc[: n + 1],
            seq_lens=self.seq_lens[:n],
            block_tables=self.block_tables[:n],
            max_query_len=1,
            max_seq_len=max(self.seq_lens_cpu[:n]),
            num_decodes=n,
            num_decode_tokens=n,
            query_lens_cpu=self.query_lens_cpu[:n],
            seq_lens_cpu=self.seq_lens_cpu[:n],
        )


class SeqSpan(NamedTuple):
    """One sequence's part of a step: ``num_new_tokens`` query tokens after
    ``num_computed_tokens`` tokens already in the cache, over its (unpadded) ``block_table``."""

    block_table: list[int]
    num_computed_tokens: int
    num_new_tokens: int


def build_attention_metadata(
    spans: Sequence[SeqSpan],
    block_size: int,
    device: torch.device | str,
    plan_groups: bool = True,
) -> tuple[torch.Tensor, AttentionMetadata]:
    """``(positions [T], metadata)`` of a batch. Spans with one query token at the head of
    ``spans`` are its decodes; with ``plan_groups`` the shared-prefix groups are planned too."""
    positions: list[int] = []
    slot_mapping: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    for table, start, n in spans:
        end = start + n
        positions.extend(range(start, end))
        slot_mapping.extend(table[p // block_size] * block_size + p % block_size
                            for p in range(start, end))  # fmt: skip
        query_lens.append(n)
        seq_lens.append(end)
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    tables = [span.block_table for span in spans]
    width = max(len(t) for t in tables)

    def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    meta = AttentionMetadata(
        slot_mapping=tensor(slot_mapping, torch.int64),
        query_start_loc=tensor([0, *itertools.accumulate(query_lens)], torch.int32),
        seq_lens=tensor(seq_lens, torch.int32),
        block_tables=tensor([t + [0] * (width - len(t)) for t in tables], torch.int32),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        num_decodes=num_decodes,
        num_decode_tokens=num_decodes,
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    if plan_groups:
        starts = [span.num_computed_tokens for span in spans]
        meta.prefix_groups = plan_prefix_groups(tables, starts, block_size)
    return tensor(positions, torch.int64), meta


def token_contexts(md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """``(token_seq, token_len)`` of a step's query tokens, as the CPU paged-attention kernel
    takes them: each token's sequence and its context length (position + 1), from the
    metadata's host copies."""
    seqs, lens = [], []
    for s, (q, n) in enumerate(zip(md.query_lens_cpu, md.seq_lens_cpu)):
        seqs += [s] * q
        lens += range(n - q + 1, n + 1)
    device = md.slot_mapping.device
    as_int32 = dict(dtype=torch.int32, device=device)
    return torch.tensor(seqs, **as_int32), torch.tensor(lens, **as_int32)
