"""The host tier (``--kv-offloading-size GiB``): evicted blocks kept in host memory.

An LRU of payloads capped in bytes. On a GPU the payloads are host copies of evicted blocks;
on a CPU, where host memory and the pool are the same memory, the tier pays off by holding
more blocks than the pool has room for, and more again compressed (``kv_offloading_dtype``
int8/fp8, ``codec.py``). Eviction takes the least recently used entry that is not retained
(``is_retained``), then retained ones; the evicted payloads are returned for demotion.
"""

from __future__ import annotations

from collections import OrderedDict

from prefixserve.kv.tiers import codec
from prefixserve.kv.tiers.base import MEDIUM_CPU, IsRetained, KVTier, Payload
from prefixserve.kv.tiers.payload import BlockKey


class HostTier(KVTier):
    medium = MEDIUM_CPU

    def __init__(self, capacity_bytes: int, is_retained: IsRetained | None = None) -> None:
        super().__init__()
        self.counters.capacity_bytes = capacity_bytes
        self._is_retained = is_retained or (lambda block_hash: False)
        self._entries: OrderedDict[int, tuple[BlockKey, Payload, int]] = OrderedDict()

    def contains(self, key: BlockKey) -> bool:
        with self._lock:
            entry = self._entries.get(key.block_hash)
            return entry is not None and entry[0].token_ids == key.token_ids

    def get(self, key: BlockKey) -> Payload | None:
        with self._lock:
            entry = self._entries.get(key.block_hash)
            if entry is None or entry[0].token_ids != key.token_ids:
                return None
            self._entries.move_to_end(key.block_hash)
            return entry[1]

    def put(self, key: BlockKey, payload: Payload) -> list[tuple[BlockKey, Payload | None]]:
        size = codec.nbytes(payload)
        c = self.counters
        with self._lock:
            if size > c.capacity_bytes:
                return [(key, payload)]  # never fits: straight down
            self._drop(key.block_hash)
            evicted = []
            while c.bytes + size > c.capacity_bytes:
                evicted.append(self._evict_one())
            self._entries[key.block_hash] = (key, payload, size)
            c.bytes += size
            c.blocks += 1
            c.stores += 1
            return evicted

    def _evict_one(self) -> tuple[BlockKey, Payload | None]:
        victim = next((h for h in self._entries if not self._is_retained(h)), None)
        if victim is None:
            victim = next(iter(self._entries))
        key, payload, _ = self._entries[victim]
        self._drop(victim)
        self.counters.evictions += 1
        return key, payload

    def _drop(self, block_hash: int) -> bool:
        entry = self._entries.pop(block_hash, None)
        if entry is None:
            return False
        self.counters.bytes -= entry[2]
        self.counters.blocks -= 1
        return True

    def discard(self, key: BlockKey) -> bool:
        with self._lock:
            return self._drop(key.block_hash)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.counters.bytes = self.counters.blocks = 0

    def stored_keys(self) -> list[BlockKey]:
        with self._lock:
            return [key for key, _, _ in self._entries.values()]
