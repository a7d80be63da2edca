"""The interface of a tier under the block pool, and the counters every tier keeps.

A tier maps a ``BlockKey`` (chained hash with the cache salt, plus the block's token ids) to a
payload (``codec``'s dict of tensors). Threads: ``contains`` and ``keys`` read an in-memory
index and may be called from the engine thread; ``get``, ``put``, ``discard`` and ``clear`` may
do I/O and run on the tier worker (``worker.py``) or at start-up. Each tier guards its index
with its own lock.

Invariants every tier keeps:

- ``get(key)`` returns a payload only if it was ``put`` under exactly that hash *and* those
  token ids and passed every check of the tier (a blob's header, MAC, dtypes and shapes,
  ``payload.py``); anything else is a miss, and a stored entry that fails a check is deleted.
- ``put`` never holds more than the tier's capacity: it evicts least recently used entries
  first (retained ones within their tenant's quota last, ``lru_index.py``) and returns them, so
  the caller can demote them a tier down.
- A tier that cannot do its job (a full disk, a server gone) raises ``TierUnavailableError``
  from ``put``/``get``; the caller counts it and goes on without the tier.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from prefixserve.kv.tiers.payload import BlockKey

MEDIUM_CPU = "CPU_TIER"
MEDIUM_DISK = "DISK"
MEDIUM_SHARED = "SHARED"

Payload = dict[str, torch.Tensor]
RetainedBy = Callable[[int], "str | None"]  # block hash -> the tenant retaining it


class TierUnavailableError(Exception):
    """The tier cannot store or load now (disk full, server unreachable)."""


@dataclass
class TierCounters:
    """Monotonic counters of one tier, plus its current size (``blocks``, ``bytes``)."""

    blocks: int = 0
    bytes: int = 0
    capacity_bytes: int = 0
    hits: int = 0  # blocks loaded from this tier into the pool
    misses: int = 0  # blocks looked up and not there (or failed a check)
    stores: int = 0
    store_errors: int = 0
    load_errors: int = 0
    corrupt: int = 0  # entries that failed a check and were deleted
    evictions: int = 0  # entries this tier dropped for room (demoted when a tier is below)
    load_seconds: float = 0.0
    store_seconds: float = 0.0
    available: bool = True

    def snapshot(self) -> dict[str, float | int | bool]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class KVTier(ABC):
    """One tier; see the module docstring for the threads and the invariants."""

    medium: str

    def __init__(self) -> None:
        self.counters = TierCounters()
        self._lock = threading.Lock()

    @abstractmethod
    def contains(self, key: BlockKey) -> bool:
        """Whether the index names ``key`` (hash and tokens); no I/O."""

    @abstractmethod
    def get(self, key: BlockKey) -> Payload | None:
        """The payload stored under ``key``, or None (a miss)."""

    @abstractmethod
    def put(self, key: BlockKey, payload: Payload) -> list[tuple[BlockKey, Payload | None]]:
        """Store ``payload``; returns the entries evicted for room, each with its payload when
        the tier still had it in memory (for demotion), else None."""

    @abstractmethod
    def discard(self, key: BlockKey) -> bool:
        """Drop ``key`` if stored; whether it was."""

    @abstractmethod
    def clear(self) -> None:
        """Drop every entry."""

    @abstractmethod
    def stored_keys(self) -> list[BlockKey]:
        """Every stored key, least recently used first."""

    def close(self) -> None:  # noqa: B027 - tiers without resources keep the default
        """Release connections and files."""
