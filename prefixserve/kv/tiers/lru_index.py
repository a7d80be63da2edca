"""The index a local tier keeps: its keys, least recently used first, with their sizes.

Shared by the host tier (which keeps the payloads in it) and the disk tier (whose payloads are
files). It keeps the tier's ``blocks`` and ``bytes`` counters equal to what it holds, and picks
eviction victims: the least recently used entry that is not retained, else the least recently
used one. Not thread-safe: the tier calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

from prefixserve.kv.hashing import BlockKey
from prefixserve.kv.tiers.base import IsRetained, TierCounters

V = TypeVar("V")


class LRUIndex(Generic[V]):
    def __init__(self, counters: TierCounters, is_retained: IsRetained | None = None) -> None:
        self.counters = counters
        self._is_retained = is_retained or (lambda block_hash: False)
        self._entries: OrderedDict[int, tuple[BlockKey, int, V]] = OrderedDict()

    def get(self, key: BlockKey, touch: bool = False) -> tuple[BlockKey, int, V] | None:
        """The entry of ``key`` if its token ids match too; ``touch``: now most recently used."""
        entry = self._entries.get(key.block_hash)
        if entry is None or entry[0].token_ids != key.token_ids:
            return None
        if touch:
            self._entries.move_to_end(key.block_hash)
        return entry

    def add(self, key: BlockKey, size: int, value: V) -> None:
        self.drop(key.block_hash)
        self._entries[key.block_hash] = (key, size, value)
        self.counters.bytes += size
        self.counters.blocks += 1

    def drop(self, block_hash: int) -> tuple[BlockKey, int, V] | None:
        entry = self._entries.pop(block_hash, None)
        if entry is not None:
            self.counters.bytes -= entry[1]
            self.counters.blocks -= 1
        return entry

    def evict(self) -> tuple[BlockKey, int, V]:
        """Drop and return the victim (the index must not be empty)."""
        victim = next((h for h in self._entries if not self._is_retained(h)), None)
        if victim is None:
            victim = next(iter(self._entries))
        self.counters.evictions += 1
        entry = self.drop(victim)
        assert entry is not None
        return entry

    def keys(self) -> list[BlockKey]:
        return [key for key, _, _ in self._entries.values()]

    def clear(self) -> None:
        self._entries.clear()
        self.counters.bytes = self.counters.blocks = 0
