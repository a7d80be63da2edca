"""The host tier (``--kv-offloading-size GiB``): evicted blocks kept in host memory.

An LRU of payloads capped in bytes (``LRUIndex``). On a GPU the payloads are host copies of
evicted blocks; on a CPU, where host memory and the pool are the same memory, the tier pays off
by holding more blocks than the pool has room for, and more again compressed
(``kv_offloading_dtype`` int8/fp8, ``codec.py``). Eviction takes the least recently used entry
that is not retained (within its tenant's quota), then retained ones (``lru_index.py``); the
evicted payloads are returned for demotion.
"""

from __future__ import annotations

from prefixserve.kv.hashing import BlockKey
from prefixserve.kv.tiers import codec
from prefixserve.kv.tiers.base import MEDIUM_CPU, KVTier, Payload, RetainedBy
from prefixserve.kv.tiers.lru_index import LRUIndex


class HostTier(KVTier):
    medium = MEDIUM_CPU

    def __init__(
        self,
        capacity_bytes: int,
        retained_by: RetainedBy | None = None,
        tenant_share: float = 1.0,
    ) -> None:
        super().__init__()
        self.counters.capacity_bytes = capacity_bytes
        self._index: LRUIndex[Payload] = LRUIndex(self.counters, retained_by, tenant_share)

    def contains(self, key: BlockKey) -> bool:
        with self._lock:
            return self._index.get(key) is not None

    def get(self, key: BlockKey) -> Payload | None:
        with self._lock:
            entry = self._index.get(key, touch=True)
            return entry[2] if entry is not None else None

    def put(self, key: BlockKey, payload: Payload) -> list[tuple[BlockKey, Payload | None]]:
        size = codec.nbytes(payload)
        c = self.counters
        with self._lock:
            if size > c.capacity_bytes:
                return [(key, payload)]  # never fits: straight down
            self._index.drop(key.block_hash)
            evicted: list[tuple[BlockKey, Payload | None]] = []
            while c.bytes + size > c.capacity_bytes:
                k, _, p = self._index.evict()
                evicted.append((k, p))
            self._index.add(key, size, payload)
            c.stores += 1
            return evicted

    def discard(self, key: BlockKey) -> bool:
        with self._lock:
            return self._index.drop(key.block_hash) is not None

    def clear(self) -> None:
        with self._lock:
            self._index.clear()

    def stored_keys(self) -> list[BlockKey]:
        with self._lock:
            return self._index.keys()
