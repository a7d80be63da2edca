"""Segment reuse: a document's K/V served wherever it sits in a prompt, not only as a prefix.

A prefix hit is exact (the same tokens after the same tokens); a segment hit is not (the same
tokens after other tokens), so segments live in their own index beside the prefix cache::

    key     the tenant's extra keys (cache salt) and a 128-bit hash of the segment's tokens
    entry   the chained hashes of the prefix-cache blocks that hold its K/V, and the position
            its first token was computed at

An entry points at blocks by hash, never by id: its blocks are ordinary prefix-cache blocks
(reference counts, LRU eviction, tenants and tiers as for any block), and a lookup accepts an
entry only while every one of them is in the pool with the segment's tokens (and was written by
a finished step). Entries are added for the exactly computed part of a prompt, so reused K/V is
never itself reused.

Planning a prompt (``plan``): after its prefix hit, the prompt splits into segments
(``segment_bounds``); each one found becomes a ``ReuseSpan`` whose first ``ceil(ratio * len)``
tokens are recomputed in their new context and whose rest is copied, keys re-rotated by the
position difference (``runner/segment_copy.py``)::

    prompt      | prefix hit | template | doc B ................ | doc A ......... | question |
    span                                  [recompute][reused ....][recompute][reuse]
    computed    | cached     | chunk 1          |    chunk 2     |       chunk 3     ...      |

A span ends before the prompt's last token, whose logits are needed. Entries are bounded
(``max_entries``, least recently used first). Not thread-safe: the engine thread only.
"""

from __future__ import annotations

import math
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

from xxhash import xxh3_128_intdigest

from prefixserve.kv.block_pool import KVBlock
from prefixserve.kv.hashing import BlockHash, ExtraKeys
from prefixserve.kv.segment_bounds import segment_bounds

MIN_SEGMENT_TOKENS = 32
MAX_SEGMENT_TOKENS = 256

FindBlock = Callable[[BlockHash], "KVBlock | None"]


class SegmentCopy(NamedTuple):
    """A reused segment's K/V moved into a new prompt: slot ``src_slots[i]`` (block id *
    block_size + offset), computed at position ``src_start + i``, to ``dst_slots[i]``, at
    position ``dst_start + i``, in every layer; keys re-rotated (``prefixserve.kv.segments``,
    ``prefixserve.runner.segment_copy``)."""

    src_slots: list[int]
    dst_slots: list[int]
    src_start: int
    dst_start: int


@dataclass(frozen=True, slots=True)
class SegmentEntry:
    """Where a segment's K/V was computed: the blocks covering positions ``start`` to
    ``start + num_tokens`` (the first one holds ``start``), by chained hash."""

    block_hashes: tuple[BlockHash, ...]
    start: int
    num_tokens: int


@dataclass(slots=True)
class SegmentPlan:
    """What ``plan`` found: the spans, and how many segments it looked up and found."""

    spans: list[ReuseSpan]
    lookups: int = 0
    hits: int = 0

    @property
    def num_reused_tokens(self) -> int:
        return sum(span.num_tokens for span in self.spans)


@dataclass(slots=True)
class ReuseSpan:
    """Prompt positions ``[start, end)`` whose K/V is copied from ``src_blocks``, where they were
    computed at ``src_start ..``; ``src_blocks[0]`` holds position ``src_first_block * bs``."""

    start: int
    end: int
    src_start: int
    src_blocks: list[KVBlock]
    src_first_block: int

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    def src_slots(self, block_size: int) -> list[int]:
        slots = []
        for pos in range(self.src_start, self.src_start + self.num_tokens):
            block = self.src_blocks[pos // block_size - self.src_first_block]
            slots.append(block.block_id * block_size + pos % block_size)
        return slots


class SegmentReuse:
    """The segment index of one engine, and the planner over it (see the module doc)."""

    def __init__(
        self,
        block_size: int,
        breaks: frozenset[int],
        max_entries: int = 1 << 16,
        min_tokens: int = MIN_SEGMENT_TOKENS,
        max_tokens: int = MAX_SEGMENT_TOKENS,
    ) -> None:
        self.block_size = block_size
        self.max_entries = max_entries
        self._bounds = partial(segment_bounds, breaks=breaks, min_tokens=min_tokens,
                               max_tokens=max_tokens)  # fmt: skip
        self._index: OrderedDict[int, SegmentEntry] = OrderedDict()
        self.lookups = 0  # segments looked up
        self.hits = 0  # segments found (their K/V reused, a share recomputed)
        self.reused_tokens = 0  # tokens whose K/V was copied instead of computed

    def __len__(self) -> int:
        return len(self._index)

    @staticmethod
    def key(extra_keys: ExtraKeys, token_ids: Sequence[int]) -> int:
        salt = repr(tuple(extra_keys)).encode()
        return xxh3_128_intdigest(len(salt).to_bytes(4, "little") + salt
                                  + array("q", token_ids).tobytes())  # fmt: skip

    def record(
        self,
        token_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        end: int,
        extra_keys: ExtraKeys,
    ) -> None:
        """Index the segments of ``token_ids[:end]`` (computed exactly, ``end`` block-aligned: the
        blocks its K/V is registered in). A segment indexed already keeps its entry (one whose
        blocks are gone is dropped at its next lookup, and indexed again from here)."""
        bs = self.block_size
        end = min(end, len(block_hashes) * bs)
        for a, b in self._bounds(token_ids, 0, end):
            key = self.key(extra_keys, token_ids[a:b])
            if key in self._index:
                self._index.move_to_end(key)
                continue
            self._index[key] = SegmentEntry(tuple(block_hashes[a // bs : -(-b // bs)]), a, b - a)
        while len(self._index) > self.max_entries:
            self._index.popitem(last=False)

    def plan(
        self,
        token_ids: Sequence[int],
        start: int,
        end: int,
        extra_keys: ExtraKeys,
        ratio: float,
        find_block: FindBlock,
    ) -> SegmentPlan:
        """The spans of ``token_ids[start:end]`` served from indexed segments, in order.
        ``find_block(hash)``: the pool's block with that hash, written by a finished step (else
        None). No side effects but the LRU order and stale entries dropped; ``admitted``
        counts a plan that was used."""
        plan = SegmentPlan([])
        for a, b in self._bounds(token_ids, start, end):
            plan.lookups += 1
            key = self.key(extra_keys, token_ids[a:b])
            entry = self._index.get(key)
            if entry is None:
                continue
            blocks = self._blocks(entry, token_ids[a:b], find_block)
            if blocks is None:
                del self._index[key]
                continue
            self._index.move_to_end(key)
            plan.hits += 1
            skip = math.ceil(ratio * (b - a))
            if skip < b - a:
                first = entry.start // self.block_size
                plan.spans.append(ReuseSpan(a + skip, b, entry.start + skip, blocks, first))
        return plan

    def admitted(self, plan: SegmentPlan) -> None:
        """Count a plan a request was admitted with."""
        self.lookups += plan.lookups
        self.hits += plan.hits
        self.reused_tokens += plan.num_reused_tokens

    def _blocks(
        self, entry: SegmentEntry, tokens: Sequence[int], find_block: FindBlock
    ) -> list[KVBlock] | None:
        """The entry's blocks if every one is in the pool and they hold ``tokens``."""
        bs = self.block_size
        blocks, held = [], []
        for block_hash in entry.block_hashes:
            block = find_block(block_hash)
            if block is None or block.token_ids is None:
                return None
            blocks.append(block)
            held.extend(block.token_ids)
        offset = entry.start % bs
        if tuple(held[offset : offset + entry.num_tokens]) != tuple(tokens):
            return None
        return blocks

    def stats(self) -> dict[str, int]:
        return {
            "segment_entries": len(self._index),
            "segment_lookups": self.lookups,
            "segment_hits": self.hits,
            "segment_reused_tokens": self.reused_tokens,
        }
