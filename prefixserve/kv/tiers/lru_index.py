"""The index a local tier keeps: its keys, least recently used first, with their sizes.

Shared by the host tier (which keeps the payloads in it) and the disk tier (whose payloads are
files). It keeps the tier's ``blocks`` and ``bytes`` counters equal to what it holds, and picks
eviction victims::

    protected   a retained entry within its tenant's quota: ``tenant_share`` of the tier's
                capacity, counted over the tenant's retained entries newest first
    victim      the least recently used entry that is not protected; when all are, the least
                recently used one of the tenant whose retained entries take the most bytes

So retention is priority within a quota: one tenant's retained blocks cannot fill a tier and
turn every other tenant's blocks into the first to go (``tenant_share`` 1.0: no quota). The
common case (the least recently used entry is not retained) costs one lookup; otherwise one pass
over the index. Not thread-safe: the tier calls it under its lock.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Generic, TypeVar

from prefixserve.kv.hashing import BlockKey
from prefixserve.kv.tiers.base import RetainedBy, TierCounters

V = TypeVar("V")


class LRUIndex(Generic[V]):
    def __init__(
        self,
        counters: TierCounters,
        retained_by: RetainedBy | None = None,
        tenant_share: float = 1.0,
    ) -> None:
        self.counters = counters
        self._retained_by = retained_by or (lambda block_hash: None)
        self.tenant_share = tenant_share
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
        victim = next(iter(self._entries))
        if self._retained_by(victim) is not None:
            victim = self._victim()
        self.counters.evictions += 1
        entry = self.drop(victim)
        assert entry is not None
        return entry

    def _victim(self) -> int:
        """The module doc's victim, by one pass newest first and one oldest first."""
        quota = self.tenant_share * self.counters.capacity_bytes
        held: Counter[str] = Counter()
        protected = set()
        for h, (_, size, _) in reversed(self._entries.items()):
            tenant = self._retained_by(h)
            if tenant is not None:
                held[tenant] += size
                if held[tenant] <= quota:
                    protected.add(h)
        victim = next((h for h in self._entries if h not in protected), None)
        if victim is None:
            top = max(held, key=held.__getitem__)
            victim = next((h for h in self._entries if self._retained_by(h) == top), None)
        return victim if victim is not None else next(iter(self._entries))

    def keys(self) -> list[BlockKey]:
        return [key for key, _, _ in self._entries.values()]

    def clear(self) -> None:
        self._entries.clear()
        self.counters.bytes = self.counters.blocks = 0
