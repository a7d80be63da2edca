"""Turns a ``SchedulerOutput`` into one forward pass over the flattened batch and returns logits.

Per step: perform the copy-on-write block copies, build ``input_ids`` / ``positions`` and the
``AttentionMetadata`` (decodes first, then prefill chunks), run the model once, and compute logits
only at the last token of every sequence that samples.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from prefixserve.attention.backend import AttentionMetadata
from prefixserve.attention.selector import get_attention_backend
from prefixserve.config import DEFAULT_CPU_KV_CACHE_GB, EngineConfig
from prefixserve.errors import CacheCapacityError, InvalidArgumentError
from prefixserve.models.loader import load_model
from prefixserve.scheduler import ScheduledSeq, SchedulerOutput

if TYPE_CHECKING:
    from prefixserve.engine import StepTimes

logger = logging.getLogger(__name__)

# Sequences sharing at least this many leading tokens of KV attend to them once, as a group.
MIN_SHARED_PREFIX_TOKENS = 64


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgumentError(
            "device: CUDA was asked for but is not available", param="device"
        )
    return device


class ModelRunner:
    """Owns the model weights and the paged KV cache ``[layers, 2, blocks, block_size, kv_heads, dim]``."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        self.attn_backend = get_attention_backend(config.attention_backend, self.device)
        self.model, self.model_config, self.model_name = load_model(
            config.model,
            dtype=config.dtype,
            device=self.device,
            attn_backend=self.attn_backend,
            revision=config.revision,
        )
        self.dtype = next(self.model.parameters()).dtype
        self.block_size = config.block_size
        self.num_blocks = self._num_kv_blocks()
        mc = self.model_config
        shape = (mc.num_hidden_layers, 2, self.num_blocks, self.block_size,
                 mc.num_key_value_heads, mc.head_dim)  # fmt: skip
        self.kv_caches = torch.zeros(shape, dtype=self.dtype, device=self.device)
        logger.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB)",
            self.num_blocks,
            self.block_size,
            self.kv_caches.numel() * self.kv_caches.element_size() / 2**30,
        )

    def _bytes_per_block(self) -> int:
        mc = self.model_config
        elems = mc.num_hidden_layers * 2 * self.block_size * mc.num_key_value_heads * mc.head_dim
        return elems * torch.finfo(self.dtype).bits // 8

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        if self.config.kv_cache_memory_gb is not None:
            budget = self.config.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = 0.9 * free
        else:
            budget = DEFAULT_CPU_KV_CACHE_GB * 2**30
        num_blocks = int(budget // self._bytes_per_block())
        if num_blocks < 2:
            raise CacheCapacityError(
                "the KV cache budget holds fewer than 2 blocks; raise kv_cache_memory_gb"
            )
        return num_blocks

    @torch.inference_mode()
    def execute(
        self, out: SchedulerOutput, block_tables: dict[int, list[int]], times: StepTimes
    ) -> tuple[list[ScheduledSeq], torch.Tensor]:
        """Run one step. Returns the sequences that sample, in order, and their logits ``[n, V]``.

        Adds the time spent building inputs and running the model to ``times``.
        """
        t0 = time.perf_counter()
        if out.block_copies:
            src, dst = zip(*out.block_copies)
            self.attn_backend.copy_blocks(
                self.kv_caches,
                torch.tensor(src, dtype=torch.int64, device=self.device),
                torch.tensor(dst, dtype=torch.int64, device=self.device),
            )
        # Decodes first; sequences that share leading blocks next to each other, so each prefix
        # group's tokens are one slice of the batch.
        batch = sorted(
            out.scheduled, key=lambda s: (s.num_new_tokens != 1, block_tables[s.seq.seq_id])
        )
        input_ids, positions, meta, keep, samplers = self._prepare_inputs(batch, block_tables)
        t1 = time.perf_counter()
        hidden = self.model(input_ids, positions, self.kv_caches, meta, keep)
        logits = self.model.compute_logits(hidden)
        t2 = time.perf_counter()
        times.prepare += t1 - t0
        times.forward += t2 - t1
        return samplers, logits

    def _prepare_inputs(self, batch: list[ScheduledSeq], block_tables: dict[int, list[int]]):
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []  # the token that samples, per sampling sequence
        sample_seqs: list[int] = []  # its sequence's index in the batch
        samplers: list[ScheduledSeq] = []
        num_decodes = 0
        for sched in batch:
            seq, n = sched.seq, sched.num_new_tokens
            start = seq.num_computed_tokens
            end = start + n
            table = block_tables[seq.seq_id]
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(end)
            query_lens.append(n)
            tables.append(table)
            if n == 1:
                num_decodes += 1
            if sched.samples:
                sample_rows.append(query_start_loc[-1] - 1)
                sample_seqs.append(len(seq_lens) - 1)
                samplers.append(sched)
        max_blocks = max(len(t) for t in tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in tables]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            num_decodes=num_decodes,
            num_decode_tokens=num_decodes,
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            prefix_groups=_prefix_groups(tables, [s - q for s, q in zip(seq_lens, query_lens)], bs),
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos = torch.tensor(positions, dtype=torch.int64, device=dev)
        keep = None
        if len(sample_rows) < len(input_ids):  # the last layer runs for the sampling rows only
            rows = torch.tensor(sample_rows, dtype=torch.int64, device=dev)
            keep = (rows, sampling_rows_metadata(meta, rows, sample_seqs, tables, bs))
        return ids, pos, meta, keep, samplers


def sampling_rows_metadata(
    meta: AttentionMetadata,
    rows: torch.Tensor,
    seqs: list[int],
    tables: list[list[int]],
    block_size: int,
) -> AttentionMetadata | None:
    """The batch's sampling tokens alone, each a one-token query over its whole context; None
    when no token samples.

    ``rows[j]`` is the last query token of batch sequence ``seqs[j]``; ``tables`` are the batch's
    unpadded block tables. The model's last layer attends only from these rows (see
    ``LlamaForCausalLM.forward``); their K/V, this step's included, are in the cache by then.
    """
    if not seqs:
        return None
    seq_lens = [meta.seq_lens_cpu[i] for i in seqs]
    sub_tables = [tables[i] for i in seqs]
    dev = meta.block_tables.device
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[rows],
        query_start_loc=torch.arange(len(seqs) + 1, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=meta.block_tables[seqs, : max(len(t) for t in sub_tables)],
        max_query_len=1,
        max_seq_len=max(seq_lens),
        num_decodes=len(seqs),
        num_decode_tokens=len(seqs),
        query_lens_cpu=[1] * len(seqs),
        seq_lens_cpu=seq_lens,
        prefix_groups=_prefix_groups(sub_tables, [n - 1 for n in seq_lens], block_size),
    )


def _prefix_groups(
    tables: list[list[int]], context_starts: list[int], block_size: int
) -> list[tuple[list[int], int]]:
    """Group the batch's sequences whose block tables start with the same blocks.

    A group's shared blocks lie wholly before every member's first query token
    (``context_starts``), so each member sees all of them. Sharing can nest (a preamble shared by
    all, then documents shared within sets): ``_split_group`` picks the grouping that reads the
    fewest KV blocks per member. Groups of one are dropped.
    """
    min_blocks = -(-MIN_SHARED_PREFIX_TOKENS // block_size)
    limits = [c // block_size for c in context_starts]
    by_first: dict[int, list[int]] = {}
    for i, table in enumerate(tables):
        if limits[i] >= min_blocks:  # a member still computing the shared blocks cannot join
            by_first.setdefault(table[0], []).append(i)
    groups = []
    for members in by_first.values():
        if len(members) >= 2:
            groups.extend(_split_group(members, tables, limits, 1))
    return [(members, shared) for members, shared in groups if shared >= min_blocks]


def _split_group(
    members: list[int], tables: list[list[int]], limits: list[int], depth: int
) -> list[tuple[list[int], int]]:
    """Members share their first ``depth`` blocks; extend that, or split where they diverge."""
    limit = min(limits[i] for i in members)
    ref = tables[members[0]]
    shared = depth
    while shared < limit and all(tables[i][shared] == ref[shared] for i in members):
        shared += 1
    if shared == limit:
        return [(members, shared)]
    by_next: dict[int, list[int]] = {}
    for i in members:
        by_next.setdefault(tables[i][shared], []).append(i)
    subgroups = [
        g
        for sub in by_next.values()
        if len(sub) >= 2
        for g in _split_group(sub, tables, limits, shared + 1)
    ]
    # KV blocks read per step: the shared blocks once per group, the rest once per member.
    keep_cost = shared + sum(limits[i] - shared for i in members)
    grouped = {i for sub, _ in subgroups for i in sub}
    split_cost = sum(k + sum(limits[i] - k for i in sub) for sub, k in subgroups)
    split_cost += sum(limits[i] for i in members if i not in grouped)
    return subgroups if split_cost < keep_cost else [(members, shared)]
