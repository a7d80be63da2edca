"""KVTierManager: the tiers under the block pool, their worker thread, and when to use them.

::

    engine thread                                        tier worker (one thread)
    BlockPool evicts a hashed block ── on_evicted ──┐
    a step's new blocks committed ─── on_committed ─┤  pending copy-outs (block id + key)
    flush(), before anything writes the cache ──────┴─ copy_out ─▶ stores ─▶ put into tiers,
                                                                            demote what a tier
                                                                            evicts, record events
    plan_load(keys): host/disk indexes + cost model
    start_load(load_id, keys) ─────────────────────────────────▶ loads (before any store) ─▶
    take_finished_loads() ◀──────── (load_id, [(key, K/V)]) ◀── get from the tiers in order,
                                                                 stop at the first miss
    write_blocks(block_ids, K/V) = flush() + copy_in
    take_events() ◀── (stored | removed, medium, key) for the KV events

Which tier gets what: blocks a step computed are written through to the disk and shared tiers
(so a restart or another replica finds them); a block the pool evicts goes to the host tier
(or, without one, to the first tier that lacks it); what the host tier evicts goes down to the
disk tier if that lacks it. A block whose store is still queued is loaded from the queue.
A tier that already holds a block, or has it queued, is not written again (the shared tier
remembers what this process wrote, ``shared.py``). Stores are best effort: past ``max_pending_store_bytes`` of queued
payloads new ones are dropped (counted in ``stores_dropped``), a retention's write-through too.

Invariants: a block is copied out while its K/V is still the one its key names (evictions are
flushed before the next forward or copy-in can overwrite the block; a committed block is copied
only if it still carries its hash); a load hands back only payloads a tier returned for exactly
that key (a miss, a failed check or an unavailable tier ends the load there); the caller
registers a loaded block only after ``write_blocks`` copied it into the pool. The engine thread
never waits on the worker except in ``wait_for_loads``, which it calls only when no step can run.
Nothing here raises on the engine thread for a tier's sake: a copy-out that fails drops its
stores (logged), and whatever the disk or shared tier returns passed ``payload.py``'s checks.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from prefixserve.kv.block_pool import KVBlock
from prefixserve.kv.tiers import codec
from prefixserve.kv.tiers.base import KVTier, Payload, TierUnavailableError
from prefixserve.kv.tiers.block_io import copy_in, copy_out
from prefixserve.kv.tiers.cost import LoadCost
from prefixserve.kv.tiers.payload import BlockKey

logger = logging.getLogger(__name__)

SHARED_BATCH = 32  # blocks fetched from the shared tier per round trip
STORED, REMOVED = "stored", "removed"


@dataclass(slots=True)
class _Store:
    key: BlockKey
    block: torch.Tensor
    tiers: tuple[int, ...]  # indexes into KVTierManager.tiers
    nbytes: int


@dataclass(slots=True)
class _Load:
    load_id: object
    keys: list[BlockKey]


class KVTierManager:
    """Owns the tiers (top first: host, disk, shared) and their worker thread."""

    def __init__(
        self,
        tiers: Sequence[KVTier],
        block_size: int,
        dtype: torch.dtype,
        offloading_dtype: str = "auto",
        max_pending_store_bytes: int = 512 << 20,
    ) -> None:
        self.tiers = list(tiers)
        self.block_size = block_size
        self.dtype = dtype
        self.offloading_dtype = offloading_dtype
        self.max_pending_store_bytes = max_pending_store_bytes
        self.cost = LoadCost(block_size)
        self.kv_caches: torch.Tensor | None = None
        self._local = [i for i, t in enumerate(self.tiers) if not getattr(t, "remote", False)]
        self._remote = [i for i, t in enumerate(self.tiers) if getattr(t, "remote", False)]
        self._host = [i for i in self._local if self.tiers[i].medium == "CPU_TIER"]
        self._write_through = [i for i, t in enumerate(self.tiers) if t.medium != "CPU_TIER"]
        # engine thread only
        self._evicted: dict[int, tuple[int, BlockKey]] = {}  # hash -> (block id, key)
        self._committed: list[tuple[KVBlock, BlockKey]] = []
        self._in_flight: set[object] = set()
        # shared with the worker, under _cond
        self._cond = threading.Condition()
        self._stores: deque[_Store] = deque()
        self._loads: deque[_Load] = deque()
        self._finished: list[tuple[object, list[tuple[BlockKey, torch.Tensor, str]]]] = []
        self._events: list[tuple[str, str, BlockKey]] = []
        self._pending_bytes = 0
        self._queued: dict[int, _Store] = {}  # block hash -> its store not yet done
        self._busy = False
        self._stopping = False
        self.stores_dropped = 0
        self.promotions = 0  # blocks loaded into the pool
        self.demotions = 0  # blocks a tier evicted into the tier below
        for tier in self.tiers:  # what a restart found (the disk tier's index)
            self._events.extend((STORED, tier.medium, key) for key in tier.stored_keys())
        self._thread = threading.Thread(target=self._run, name="kv-tier-worker", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def attach(self, kv_caches: torch.Tensor) -> None:
        """The paged cache blocks are copied out of and into (``ModelRunner.kv_caches``)."""
        self.kv_caches = kv_caches

    # ---- engine thread: stores ---------------------------------------------------------------

    def on_evicted(self, block: KVBlock) -> None:
        """The pool is evicting ``block`` (hash and tokens still set, K/V intact until the next
        flush)."""
        assert block.block_hash is not None and block.token_ids is not None
        key = BlockKey(block.block_hash, block.token_ids, block.parent_hash)
        self._evicted[block.block_hash] = (block.block_id, key)

    def on_committed(self, blocks: Sequence[KVBlock]) -> None:
        """A step's forward wrote these newly registered blocks (or a retention asks for them):
        write them through to the disk and shared tiers that lack them."""
        if not self._write_through:
            return
        for block in blocks:
            if block.block_hash is not None and block.token_ids is not None:
                key = BlockKey(block.block_hash, block.token_ids, block.parent_hash)
                self._committed.append((block, key))

    def flush(self) -> None:
        """Copy out every pending block in one indexed copy and queue its stores. Called before
        anything writes the cache (the forward, a copy-in)."""
        if not (self._evicted or self._committed) or self.kv_caches is None:
            self._evicted.clear()
            self._committed.clear()
            return
        plans: dict[int, tuple[int, BlockKey, set[int]]] = {}
        for block_hash, (block_id, key) in self._evicted.items():
            targets = self._eviction_targets(key)
            if targets:
                plans[block_hash] = (block_id, key, targets)
        for block, key in self._committed:
            queued = self._queued_store(key)
            targets = {i for i in self._write_through if not self.tiers[i].contains(key)
                       and (queued is None or i not in queued.tiers)}  # fmt: skip
            if block.block_hash == key.block_hash:  # still the block it was
                block_id = block.block_id
            elif key.block_hash in self._evicted:  # evicted since: its copy-out is pending
                block_id = self._evicted[key.block_hash][0]
            else:
                continue
            old = plans.get(key.block_hash)
            if old is not None:
                targets |= old[2]
            if targets:
                plans[key.block_hash] = (block_id, key, targets)
        self._evicted.clear()
        self._committed.clear()
        if not plans:
            return
        items = list(plans.values())
        try:
            blocks = copy_out(self.kv_caches, [block_id for block_id, _, _ in items])
        except Exception:  # a device error: the tiers miss these blocks, the step goes on
            logger.exception("KV tiers: copying %d blocks out failed; not stored", len(items))
            self.stores_dropped += len(items)
            return
        with self._cond:
            for (_, key, targets), block in zip(items, blocks):
                nbytes = block.numel() * block.element_size()
                if self._pending_bytes + nbytes > self.max_pending_store_bytes:
                    self.stores_dropped += 1
                    continue
                self._pending_bytes += nbytes
                store = _Store(key, block, tuple(sorted(targets)), nbytes)
                self._stores.append(store)
                self._queued[key.block_hash] = store
            self._cond.notify()

    def _eviction_targets(self, key: BlockKey) -> set[int]:
        """The host tier, or without one the first tier lacking the block (local tiers only: the
        shared tier got it by write-through)."""
        for i in self._host or self._local:
            return set() if self.tiers[i].contains(key) else {i}
        return set()

    # ---- engine thread: loads ----------------------------------------------------------------

    def plan_load(self, keys: Sequence[BlockKey]) -> int:
        """How many of ``keys`` (consecutive blocks after the pool's hit) to ask the worker for:
        the leading ones the local tiers hold and load cheaper than recomputing, or all of them
        when a shared tier may hold the rest (it is asked on the worker)."""
        n = 0
        for key in keys:
            if self._queued_store(key) is None:
                tier = self._local_tier_of(key)
                if tier is None or not self.cost.worth_loading(tier.medium):
                    break
            n += 1
        if n < len(keys) and any(
            self.tiers[i].counters.available and self.cost.worth_loading(self.tiers[i].medium)
            for i in self._remote
        ):
            return len(keys)
        return n

    def start_load(self, load_id: object, keys: Sequence[BlockKey]) -> None:
        self._in_flight.add(load_id)
        with self._cond:
            self._loads.append(_Load(load_id, list(keys)))
            self._cond.notify()

    def has_loads_in_flight(self) -> bool:
        return bool(self._in_flight)

    def is_in_flight(self, load_id: object) -> bool:
        return load_id in self._in_flight

    def take_finished_loads(self) -> list[tuple[object, list[tuple[BlockKey, torch.Tensor]]]]:
        """Loads the worker finished since the last call: per load, the leading blocks found
        (possibly none), each as its key and K/V in the cache's dtype."""
        with self._cond:
            finished, self._finished = self._finished, []
        out = []
        for load_id, blocks in finished:
            self._in_flight.discard(load_id)
            out.append((load_id, [(key, kv) for key, kv, _ in blocks]))
            self.promotions += len(blocks)
        return out

    def wait_for_loads(self, timeout_s: float) -> None:
        """Block until a load finishes or ``timeout_s`` passes (only when no step can run)."""
        with self._cond:
            if not self._finished:
                self._cond.wait(timeout_s)

    def write_blocks(self, block_ids: Sequence[int], blocks: Sequence[torch.Tensor]) -> None:
        """Copy loaded K/V into freshly allocated blocks (evictions that freed them first)."""
        self.flush()
        assert self.kv_caches is not None
        copy_in(self.kv_caches, block_ids, blocks)

    def _queued_store(self, key: BlockKey) -> _Store | None:
        """The queued store of ``key``, if any (a load may take its K/V from there; its hit
        counts for the tier it is on its way to)."""
        with self._cond:
            store = self._queued.get(key.block_hash)
        return store if store is not None and store.key.token_ids == key.token_ids else None

    def holds(self, key: BlockKey) -> bool:
        """Whether a block the pool evicted is still kept below it: on its way down or in a
        local tier (the retention budget's test; the shared tier keeps no retention)."""
        return (key.block_hash in self._evicted or self._queued_store(key) is not None
                or self._local_tier_of(key) is not None)  # fmt: skip

    def _local_tier_of(self, key: BlockKey) -> KVTier | None:
        return next((self.tiers[i] for i in self._local if self.tiers[i].contains(key)), None)

    # ---- engine thread: the rest -------------------------------------------------------------

    def observe_forward(self, num_tokens: int, seconds: float) -> None:
        self.cost.observe_forward(num_tokens, seconds)

    def take_events(self) -> list[tuple[str, str, BlockKey]]:
        """Tier changes since the last call, in order: (``STORED``|``REMOVED``, medium, key)."""
        with self._cond:
            events, self._events = self._events, []
        return events

    def clear_local(self) -> None:
        """Drop what this engine keeps (host and disk tiers, queued stores), not the shared
        tier (other replicas use it): ``reset_prefix_cache``."""
        self._evicted.clear()
        self._committed.clear()
        with self._cond:
            while self._busy:
                self._cond.wait(0.05)
            self._stores.clear()
            self._queued.clear()
            self._pending_bytes = 0
            for i in self._local:
                self.tiers[i].clear()
            self._events.clear()

    def stats(self) -> dict:
        with self._cond:
            pending = (len(self._stores), self._pending_bytes)
        return {
            "tiers": {t.medium: t.counters.snapshot() for t in self.tiers},
            "promotions": self.promotions,
            "demotions": self.demotions,
            "stores_dropped": self.stores_dropped,
            "pending_stores": pending[0],
            "pending_store_bytes": pending[1],
            "loads_in_flight": len(self._in_flight),
            **self.cost.snapshot(),
        }

    def close(self, drain_timeout_s: float = 10.0) -> None:
        """Finish the queued stores (up to ``drain_timeout_s``), stop the worker, close tiers.
        Idempotent; also run at interpreter exit, so an offline ``LLM`` that is never shut down
        still leaves its computed blocks on disk for the next start."""
        atexit.unregister(self.close)
        deadline = time.monotonic() + drain_timeout_s
        with self._cond:
            if self._stopping:
                return
            while (self._stores or self._busy) and time.monotonic() < deadline:
                self._cond.wait(0.05)
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=drain_timeout_s)
        for tier in self.tiers:
            tier.close()

    # ---- worker thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._loads or self._stores or self._stopping):
                    self._cond.wait()
                if self._stopping:
                    return
                job: _Load | _Store = (
                    self._loads.popleft() if self._loads else self._stores.popleft()
                )
                self._busy = True
            try:
                if isinstance(job, _Load):
                    found = self._load(job.keys)
                    with self._cond:
                        self._finished.append((job.load_id, found))
                else:
                    self._store(job)
            except Exception:  # a tier bug must not stop the worker: the job is a miss
                logger.exception("KV tier worker")
                if isinstance(job, _Load):
                    with self._cond:
                        self._finished.append((job.load_id, []))
            finally:
                with self._cond:
                    if isinstance(job, _Store):
                        self._pending_bytes -= job.nbytes
                        if self._queued.get(job.key.block_hash) is job:
                            del self._queued[job.key.block_hash]
                    self._busy = False
                    self._cond.notify_all()

    def _store(self, job: _Store) -> None:
        for i in job.tiers:
            payload = (
                codec.encode(job.block, self.offloading_dtype)
                if i in self._host
                else {"kv": job.block}
            )
            self._put(i, job.key, payload)

    def _put(self, i: int, key: BlockKey, payload: Payload) -> None:
        tier = self.tiers[i]
        start = time.perf_counter()
        try:
            evicted = tier.put(key, payload)
        except TierUnavailableError as exc:
            tier.counters.store_errors += 1
            if tier.counters.store_errors in (1, 10, 100) or tier.counters.store_errors % 1000 == 0:
                logger.warning("KV %s tier: store failed (%d so far): %s", tier.medium,
                               tier.counters.store_errors, exc)  # fmt: skip
            return
        tier.counters.store_seconds += time.perf_counter() - start
        events = [(STORED, tier.medium, key)] if tier.contains(key) or i in self._remote else []
        events += [(REMOVED, tier.medium, k) for k, _ in evicted if k != key]
        with self._cond:
            self._events.extend(events)
        below = next((j for j in self._local if j > i), None)
        for k, p in evicted:
            if p is not None and below is not None and not self.tiers[below].contains(k):
                self.demotions += 1
                self._put(below, k, p)

    def _load(self, keys: list[BlockKey]) -> list[tuple[BlockKey, torch.Tensor, str]]:
        """The leading blocks of ``keys`` the tiers hold, each from the first tier that has it."""
        out: list[tuple[BlockKey, torch.Tensor, str]] = []
        i = 0
        while i < len(keys):
            key = keys[i]
            queued = self._queued_store(key)
            if queued is not None:  # still on its way down: served from the queue
                target = self.tiers[queued.tiers[0]]
                out.append((key, queued.block.to(self.dtype), target.medium))
                target.counters.hits += 1
                i += 1
                continue
            tier = self._local_tier_of(key)
            if tier is not None:
                start = time.perf_counter()
                payload = tier.get(key)
                if payload is None:
                    tier.counters.misses += 1
                    break
                out.append((key, codec.decode(payload, self.dtype), tier.medium))
                self._count_hit(tier, 1, time.perf_counter() - start)
                i += 1
                continue
            batch = keys[i : i + SHARED_BATCH]
            got = self._load_remote(batch)
            out.extend(got)
            i += len(got)
            if len(got) < len(batch):
                break
        return out

    def _load_remote(self, keys: list[BlockKey]) -> list[tuple[BlockKey, torch.Tensor, str]]:
        for r in self._remote:
            tier = self.tiers[r]
            start = time.perf_counter()
            try:
                payloads = tier.get_many(keys)
            except TierUnavailableError:
                tier.counters.load_errors += 1
                continue
            got = []
            for key, payload in zip(keys, payloads):
                if payload is None:
                    break
                got.append((key, codec.decode(payload, self.dtype), tier.medium))
            tier.counters.misses += 0 if got else 1
            if got:
                self._count_hit(tier, len(got), time.perf_counter() - start)
                return got
        return []

    def _count_hit(self, tier: KVTier, num_blocks: int, seconds: float) -> None:
        tier.counters.hits += num_blocks
        tier.counters.load_seconds += seconds
        self.cost.observe_load(tier.medium, num_blocks, seconds)
