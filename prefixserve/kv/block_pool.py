"""The block pool: a fixed set of KV blocks, their reference counts and the prefix cache.

Every block is in exactly one of three states::

    state     ref_cnt  identity             lives in
    free      0        none                 _free_ids (FIFO, handed out first)
    cached    0        block_hash or tail   _lru      (evictable, least recently used first)
                       retained block_hash  _retained (evicted only once _lru is empty)
    used      > 0      any                  one or more block tables (or pinned, see below)

so ``num_free_blocks + num_cached_blocks + num_used_blocks == num_blocks`` always.
``_hash_to_block`` maps each registered hash to the one block carrying it, used or cached.
A block needed while no free one is left evicts the LRU head: its identity is dropped and
the block is handed out as a fresh one. With ``on_evict`` (the tiers under the pool,
``prefixserve.kv.tiers``) a hashed block is handed to it first, hash and tokens still set, so
its K/V can go down a tier instead of being dropped.

Retention (``prefixserve.kv.retention``) is soft priority: a cached block whose hash
``is_retained`` waits in ``_retained`` and is evicted only when ``_lru`` is empty (pressure);
``unretain`` (expiry, release) moves it to the head of ``_lru``, next to be evicted.

A *tail* (``prefixserve.kv.partial_tail``) is the partial last block of a finished sequence:
``tail_key`` names the prefix before it, ``token_ids`` its computed tokens (fewer than a block).
``_tails`` indexes them by key. A tail is never written: a request that reuses it copies it into
a fresh block, and holds a reference to it (a pin, not a table entry) until that copy ran; or,
short of blocks, takes it (``take_tail``: then it is a plain used block).

With a ``KVEventRecorder``, every change to the set of registered hashes is reported as it
happens (a hash registered, evicted, or all of them cleared), so a router can mirror the cache.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixserve.core.errors import InvalidArgumentError
from prefixserve.kv.hashing import BlockHash
from prefixserve.kv.partial_tail import common_prefix_len

if TYPE_CHECKING:
    from prefixserve.kv.kv_events import KVEventRecorder


@dataclass(slots=True, eq=False)
class KVBlock:
    """One physical block of ``block_size`` KV slots.

    ``token_ids`` is stored with ``block_hash`` so that a lookup compares the tokens too:
    a hash collision can never return a block holding other tokens. A tail block has no
    ``block_hash`` but a ``tail_key``, and ``token_ids`` holds its (fewer) computed tokens.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] | None = None
    tail_key: BlockHash | None = None
    parent_hash: BlockHash | None = None  # the previous block's hash in its chain (tiers, events)

    @property
    def is_tail(self) -> bool:
        return self.tail_key is not None


class BlockPool:
    """Owns every ``KVBlock``; hands them out and takes them back in a deterministic order."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        kv_events: KVEventRecorder | None = None,
        on_evict: Callable[[KVBlock], None] | None = None,
        is_retained: Callable[[BlockHash], bool] | None = None,
    ) -> None:
        if num_blocks <= 0:
            raise InvalidArgumentError(
                f"num_blocks must be positive, got {num_blocks}", "num_blocks"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        self._free_ids: deque[int] = deque(range(num_blocks))
        self._lru: OrderedDict[int, KVBlock] = OrderedDict()
        self._retained: OrderedDict[int, KVBlock] = OrderedDict()
        self.on_evict = on_evict
        self.is_retained = is_retained
        self._hash_to_block: dict[BlockHash, KVBlock] = {}
        self._tails: dict[BlockHash, list[KVBlock]] = {}
        self._num_tails = 0
        self.evictions = 0
        self.cow_copies = 0
        self.kv_events = kv_events

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0 and no hash."""
        return len(self._free_ids)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with ref_cnt 0 that still carry a hash or are tails (evictable)."""
        return len(self._lru) + len(self._retained)

    @property
    def num_tail_blocks(self) -> int:
        """Blocks registered as tails (cached, or pinned by a copy in flight)."""
        return self._num_tails

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref_cnt > 0."""
        return self.num_blocks - len(self._free_ids) - self.num_cached_blocks

    @property
    def num_retained_blocks(self) -> int:
        """Cached blocks evicted only under pressure (retained)."""
        return len(self._retained)

    @property
    def num_available_blocks(self) -> int:
        """Blocks that ``allocate`` can hand out now, evicting cached ones if needed."""
        return len(self._free_ids) + self.num_cached_blocks

    def is_evictable(self, block: KVBlock) -> bool:
        return block.block_id in self._lru or block.block_id in self._retained

    def lru_block_ids(self) -> list[int]:
        """Evictable block ids, next to be evicted first."""
        return list(self._lru) + list(self._retained)

    def hashed_blocks(self) -> dict[BlockHash, KVBlock]:
        """A copy of the hash map (for tests and debugging)."""
        return dict(self._hash_to_block)

    def allocate(self, num: int) -> list[KVBlock]:
        """Hand out ``num`` blocks with ref_cnt 1: free ones first, then evict LRU ones.

        The caller checks ``num_available_blocks`` first.
        """
        assert num <= self.num_available_blocks, "allocate() past num_available_blocks"
        out = []
        for _ in range(num):
            if self._free_ids:
                block = self.blocks[self._free_ids.popleft()]
            else:
                _, block = (self._lru or self._retained).popitem(last=False)
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVBlock) -> None:
        assert block.ref_cnt == 0
        self.evictions += 1
        if block.is_tail:
            self._unindex_tail(block)
            return
        assert block.block_hash is not None
        if self.on_evict is not None:
            self.on_evict(block)
        self._unhash(block)

    def _unhash(self, block: KVBlock) -> None:
        """Take a hashed block out of the hash map (a ``BlockRemoved`` event) and clear its
        identity; where it is listed (LRU, free) is the caller's to change."""
        if self.kv_events is not None:
            self.kv_events.on_block_removed(block.block_hash)
        del self._hash_to_block[block.block_hash]
        block.block_hash = None
        block.token_ids = None
        block.parent_hash = None

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference to each block, in order.

        A block reaching ref_cnt 0 joins the MRU end of the LRU if hashed, else the free queue;
        so freeing ``[b2, b1, b0]`` makes ``b2`` the first of the three to be evicted.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than held"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None and not block.is_tail:
                    self._free_ids.append(block.block_id)
                elif self._retains(block):
                    self._retained[block.block_id] = block
                else:
                    self._lru[block.block_id] = block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference to each block (a prefix hit or a fork); out of the LRU."""
        for block in blocks:
            if block.ref_cnt == 0:
                assert block.block_hash is not None or block.is_tail, "touching a free block"
                self._unlist(block)
            block.ref_cnt += 1

    def _unlist(self, block: KVBlock) -> None:
        """Take a cached block out of whichever LRU holds it."""
        if self._lru.pop(block.block_id, None) is None:
            del self._retained[block.block_id]

    def _retains(self, block: KVBlock) -> bool:
        return (
            self.is_retained is not None
            and block.block_hash is not None
            and self.is_retained(block.block_hash)
        )

    def retain(self, hashes: Iterable[BlockHash]) -> None:
        """Cached blocks carrying these hashes wait in the retained LRU (used ones move there
        when freed, through ``is_retained``)."""
        for h in hashes:
            block = self._hash_to_block.get(h)
            if block is not None and self._lru.pop(block.block_id, None) is not None:
                self._retained[block.block_id] = block

    def unretain(self, hashes: Iterable[BlockHash]) -> None:
        """Retention over (expired, released): these blocks are evicted next."""
        for h in hashes:
            block = self._hash_to_block.get(h)
            if block is not None and self._retained.pop(block.block_id, None) is not None:
                self._lru[block.block_id] = block
                self._lru.move_to_end(block.block_id, last=False)

    def copy_on_write(self, block: KVBlock) -> KVBlock:
        """Swap one reference to a shared block for a fresh block holding a copy of it.

        The caller copies the KV of ``block`` into the returned block before writing.
        """
        assert block.ref_cnt > 1, "copy-on-write of a block that is not shared"
        (fresh,) = self.allocate(1)
        block.ref_cnt -= 1
        self.cow_copies += 1
        return fresh

    def uncache_block(self, block: KVBlock) -> None:
        """Unregister a block whose K/V was never written (its step failed); a cached one (ref_cnt
        0) becomes free. Not an eviction: the hash was never valid."""
        assert block.block_hash is not None and self._hash_to_block[block.block_hash] is block
        self._unhash(block)
        if block.ref_cnt == 0:
            self._unlist(block)
            self._free_ids.append(block.block_id)

    def hashed_block(self, block_hash: BlockHash) -> KVBlock | None:
        """The block registered under ``block_hash`` (used or cached), if any."""
        return self._hash_to_block.get(block_hash)

    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        """The block registered under ``block_hash`` if it holds exactly ``token_ids``."""
        block = self._hash_to_block.get(block_hash)
        if block is not None and block.token_ids == tuple(token_ids):
            return block
        return None

    def cache_block(
        self,
        block: KVBlock,
        block_hash: BlockHash,
        token_ids: Sequence[int],
        parent_hash: BlockHash | None = None,
    ) -> bool:
        """Register a full, used block under ``block_hash``; True if it was registered.

        If another block already carries ``block_hash`` that mapping is kept and ``block``
        stays unhashed (it is freed as a plain block later). ``parent_hash`` (the previous
        block's hash in its chain) only goes into the KV event.
        """
        assert block.block_hash is None and block.ref_cnt > 0
        if not self.enable_caching or block_hash in self._hash_to_block:
            return False
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        block.parent_hash = parent_hash
        self._hash_to_block[block_hash] = block
        if self.kv_events is not None:
            self.kv_events.on_block_stored(block_hash, parent_hash, block.token_ids)
        return True

    # ---- tails -------------------------------------------------------------------------------

    def cache_tail(self, block: KVBlock, tail_key: BlockHash, token_ids: Sequence[int]) -> bool:
        """Register the partial last block of a sequence about to free it (its only holder) as a
        tail of ``token_ids`` under ``tail_key``; True if it was registered.

        The tails under one key stay an antichain: a tail whose tokens begin another's adds
        nothing (not registered); one that extends others replaces them (they become free).
        """
        assert block.ref_cnt == 1 and block.block_hash is None and not block.is_tail
        tokens = tuple(token_ids)
        assert tokens, "an empty tail"
        if not self.enable_caching:
            return False
        tails = self._tails.get(tail_key, [])
        if any(common_prefix_len(t.token_ids, tokens) == len(tokens) for t in tails):
            return False
        for old in [t for t in tails if common_prefix_len(t.token_ids, tokens) == len(t.token_ids)]:
            self.drop_tail(old)
        block.tail_key = tail_key
        block.token_ids = tokens
        self._tails.setdefault(tail_key, []).append(block)
        self._num_tails += 1
        return True

    def match_tail(
        self, tail_key: BlockHash, token_ids: Sequence[int]
    ) -> tuple[KVBlock | None, int]:
        """The tail under ``tail_key`` sharing the longest common prefix with ``token_ids``, and
        that prefix's length (None, 0 when none shares a first token). Changes nothing."""
        best, best_len = None, 0
        for tail in self._tails.get(tail_key, ()):
            n = common_prefix_len(tail.token_ids, token_ids)
            if n > best_len:
                best, best_len = tail, n
        return best, best_len

    def take_tail(self, block: KVBlock) -> KVBlock:
        """Hand out a cached tail as a used block (ref_cnt 1) keeping its K/V; no longer a tail."""
        assert block.is_tail and block.ref_cnt == 0
        self._unindex_tail(block)
        del self._lru[block.block_id]
        block.ref_cnt = 1
        return block

    def drop_tail(self, block: KVBlock) -> None:
        """Forget a tail; a cached one (ref_cnt 0) becomes free, a pinned one when unpinned."""
        self._unindex_tail(block)
        if block.ref_cnt == 0:
            del self._lru[block.block_id]
            self._free_ids.append(block.block_id)

    def _unindex_tail(self, block: KVBlock) -> None:
        assert block.tail_key is not None
        tails = self._tails[block.tail_key]
        tails.remove(block)
        if not tails:
            del self._tails[block.tail_key]
        block.tail_key = None
        block.token_ids = None
        self._num_tails -= 1

    def tail_blocks(self) -> list[KVBlock]:
        """Every tail block (for tests and debugging)."""
        return [block for tails in self._tails.values() for block in tails]

    def reset_prefix_cache(self) -> bool:
        """Drop every hash and tail. Refused (False) while any block is in use."""
        if self.num_used_blocks > 0:
            return False
        for block in self.blocks:
            block.block_hash = None
            block.token_ids = None
            block.tail_key = None
            block.parent_hash = None
        self._tails.clear()
        self._num_tails = 0
        self._hash_to_block.clear()
        self._lru.clear()
        self._retained.clear()
        self._free_ids = deque(range(self.num_blocks))
        if self.kv_events is not None:
            self.kv_events.on_all_cleared()
        return True
