"""KVCacheManager: the engine's only door to the KV cache.

The scheduler asks for slots by token counts: ``allocate_for_prompt`` when it admits a sequence
(after ``lookup`` found its cached prefix), ``append_slots`` when a running sequence grows. It
passes the block tables (``get_block_table``) and the copy-on-write pairs ``append_slots`` returns
on to the model runner without looking inside. Misuse by the engine's own code (an unknown
sequence, admitting one twice) is an ``AssertionError``: no user input reaches these calls.

One sequence, block_size 4, after a forward over 10 tokens (``num_computed_tokens`` 10)
and before the next step writes 3 more::

    positions      0 1 2 3 | 4 5 6 7 | 8 9 . . | . . . .
    block_table    [  b0   ,   b1    ,   b2    ,   b3   ]
    registered     h_0       h_1       (partial: no hash)
    next write                             ^^^ 10..12 -> b2 (ref_cnt must be 1), b3 fresh

Blocks full once a step's tokens are written are registered (``cache_full_blocks``) so
that another request with the same prefix, or the next turn of this conversation, hits them.
They are registered when the step is scheduled (a request admitted later in that step hits them:
the forward writes every layer's K/V before any query reads it), and journaled until the step
ends: ``commit_step`` keeps them, ``discard_step`` (the forward raised, so their K/V was never
written) unregisters every one, so no later request reads a block that holds nothing.

A finished sequence freed with ``free_keeping_tail`` leaves its partial last block behind as a
tail; a later ``lookup`` with ``extra_keys`` may end in one, and ``allocate_for_prompt`` then
adds a copy of it to the step's block copies (``prefixserve.kv.partial_tail``).

With ``tiers`` (``prefixserve.kv.tiers.KVTierManager``), full blocks continue below the pool::

    start_load(load_id, tokens, hashes)   the blocks after the pool's hit that the tiers hold:
                                          loaded on the tier worker, the request waits (False:
                                          nothing worth loading, admit it now)
    apply_loads()                         each finished load: fresh blocks, K/V copied in, then
                                          registered and freed to the LRU (cached, ref_cnt 0);
                                          ``load_finished(load_id)`` turns True
    commit_step()                         the step's new blocks are written through to the
                                          disk and shared tiers; evicted ones go to the host tier

With segment reuse (the scheduler's ``prefixserve.kv.segments.SegmentReuse`` plans), K/V is
reused past the prefix too::

    segment_source()                      the planner's ``find_block`` now: blocks a finished
                                          step wrote
    allocate_for_prompt(..., plan=, segment_copies=)  blocks through the last span, the spans'
                                          sources pinned until the step ends, their copies
                                          listed for the runner; the sequence's blocks from
                                          the first reused one on are never registered (their
                                          K/V is approximate), nor its tail

A loaded block is registered only after its K/V was copied into it, outside any step's
journal: a failed step cannot unregister it, and a failed load registers nothing. A copy-in that
raises (what the tiers' checks let through, a device error) frees its blocks unregistered and is
a miss: nothing a tier returns raises out of ``schedule`` (``tier_load_failures``).

With ``retention`` (``prefixserve.kv.retention.RetentionTable``): ``retain`` protects the
leading blocks of a prefix that the pool holds, within the tenant's share of the budget (soft
priority in the pool and the tiers, ``write_through`` to disk); ``release`` and ``tick``
(expiry, once per schedule) drop the protection. A retained hash leaves the budget when its
block leaves the pool and every tier: at once when the pool evicts it without tiers below;
with tiers, once ``KVTierManager.holds`` says no local tier keeps it (``tick`` looks at up to
``RETAINED_SWEEP`` such blocks each time; the shared tier keeps no retention).
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prefixserve.core.errors import InvalidArgumentError
from prefixserve.kv.block_pool import BlockPool, KVBlock
from prefixserve.kv.hashing import BlockHash, BlockKey, ExtraKeys
from prefixserve.kv.partial_tail import tail_key
from prefixserve.kv.segments import FindBlock, SegmentCopy, SegmentPlan

if TYPE_CHECKING:
    from prefixserve.kv.kv_events import KVEventRecorder
    from prefixserve.kv.retention import KVRetention, RetentionTable
    from prefixserve.kv.tiers.manager import KVTierManager

logger = logging.getLogger(__name__)

SeqId = Hashable
RETAINED_SWEEP = 64  # retained blocks out of the pool checked against the tiers per tick


@dataclass(slots=True)
class PrefixHit:
    """The longest cached prefix of a prompt; no side effects until ``allocate_for_prompt``.

    ``num_tokens`` counts the full ``blocks`` and then ``num_tail_tokens`` tokens of ``tail``
    (a partial block, copied at admission). Valid until the next call that can evict (an
    allocation, ``reset_prefix_cache``).
    """

    blocks: list[KVBlock]
    num_tokens: int
    num_query_tokens: int
    tail: KVBlock | None = None
    num_tail_tokens: int = 0


@dataclass(slots=True)
class _SeqState:
    blocks: list[KVBlock]
    num_registered: int  # leading blocks already looked at by cache_full_blocks
    pinned_tail: KVBlock | None = None  # the tail copied into blocks[num_registered] this step
    max_registered: int | None = None  # blocks past it hold reused (approximate) K/V
    pinned_sources: list[KVBlock] | None = None  # segment sources copied from this step


class KVCacheManager:
    """Block tables of live sequences over one ``BlockPool``.

    Invariants (checked by tests/test_kv_invariants.py): each block's ref_cnt equals the
    number of block-table entries pointing at it, plus, until the step ends, one per admission
    copying it as a partial tail; after ``append_slots`` every block a sequence will write is
    held by that sequence alone; every tail holds the K/V of its key's prefix and its tokens.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        watermark: float = 0.01,
        kv_events: KVEventRecorder | None = None,
        tiers: KVTierManager | None = None,
        retention: RetentionTable | None = None,
    ) -> None:
        if block_size <= 0:
            raise InvalidArgumentError(
                f"block_size must be positive, got {block_size}", "block_size"
            )
        if not 0.0 <= watermark < 1.0:
            raise InvalidArgumentError(f"watermark must be in [0, 1), got {watermark}", "watermark")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = int(watermark * num_blocks)
        self.tiers = tiers if enable_prefix_caching else None
        self.retention = retention
        watched = self.tiers is not None or retention is not None
        self.pool = BlockPool(
            num_blocks,
            enable_prefix_caching,
            kv_events,
            on_evict=self._on_evicted if watched else None,
            is_retained=retention.is_retained if retention is not None else None,
        )
        self._retained_out: OrderedDict[BlockHash, BlockKey] = OrderedDict()  # in tiers only
        self._finished_loads: set[Hashable] = set()
        self._cancelled_loads: set[Hashable] = set()
        self._loaded_blocks = 0  # blocks loaded from the tiers into the pool (monotonic)
        self._failed_load_blocks = 0  # loaded blocks whose copy into the pool raised
        self._seqs: dict[SeqId, _SeqState] = {}
        # this step's registrations: the blocks, and each sequence's num_registered before it
        self._step_blocks: list[tuple[KVBlock, BlockHash]] = []
        self._step_states: dict[int, tuple[_SeqState, int]] = {}
        self._pinned: list[_SeqState] = []  # sequences whose tail or segment copies run this step
        self._query_tokens = 0
        self._hit_tokens = 0
        self._tail_hits = 0
        self._tail_hit_tokens = 0

    def get_num_blocks_needed(self, num_tokens: int) -> int:
        """Blocks that hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` fresh blocks fit while keeping the watermark in reserve."""
        return self.pool.num_available_blocks - num_blocks >= self.watermark_blocks

    def lookup(
        self,
        token_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        extra_keys: ExtraKeys | None = None,
    ) -> PrefixHit:
        """Longest cached prefix of full blocks whose hash and tokens both match, then, given the
        prompt's ``extra_keys``, the tail after them sharing most of the following tokens.

        Capped so that at least one token is computed: a prompt of exactly k blocks hits at
        most k - 1 blocks and then at most ``block_size - 1`` tail tokens. Changes no ref count
        and no counter.
        """
        num_query = len(token_ids)
        if not self.enable_prefix_caching:
            return PrefixHit([], 0, num_query)
        bs = self.block_size
        max_blocks = max(0, min((num_query - 1) // bs, len(block_hashes)))
        get = self.pool.get_cached_block
        prefix = tuple(token_ids[: max_blocks * bs])  # one conversion, not one per block
        blocks: list[KVBlock] = []
        start = 0
        for block_hash in block_hashes[:max_blocks]:
            block = get(block_hash, prefix[start : start + bs])
            if block is None:
                break
            blocks.append(block)
            start += bs
        max_tail = min(bs - 1, num_query - 1 - start)
        if extra_keys is None or max_tail <= 0:
            return PrefixHit(blocks, start, num_query)
        parent = block_hashes[len(blocks) - 1] if blocks else None
        key = tail_key(parent, extra_keys)
        tail, n = self.pool.match_tail(key, token_ids[start : start + max_tail])
        return PrefixHit(blocks, start + n, num_query, tail, n)

    def allocate_for_prompt(
        self,
        seq_id: SeqId,
        hit: PrefixHit,
        num_new_tokens: int,
        copies: list[tuple[int, int]] | None = None,
        plan: SegmentPlan | None = None,
        segment_copies: list[SegmentCopy] | None = None,
    ) -> bool:
        """Admit a new sequence: its table is ``hit.blocks`` plus fresh blocks for the
        ``num_new_tokens`` tokens that follow the hit (and, with a segment ``plan``, through its
        last span, whose copies go to ``segment_copies``). Keeps the watermark in reserve.

        Returns False, having changed nothing, when the blocks do not fit. The full blocks of
        the hit are never written. A hit ending in a tail appends ``(tail, first fresh block)``
        to ``copies`` (the model runner copies it before the forward) and pins the tail until
        the step ends (``commit_step`` / ``discard_step``) or the sequence is freed. When that
        pin would take the last block the admission needs, an evictable tail is taken instead:
        it becomes the first fresh block as it is, no copy, no longer a tail. So a tail never
        makes an admission fail that would fit without it.
        """
        assert seq_id not in self._seqs, f"{seq_id!r} is already admitted"
        assert num_new_tokens >= 0
        tail = hit.tail
        assert tail is None or (copies is not None and num_new_tokens > 0)
        spans = plan.spans if plan is not None else []
        end = max(hit.num_tokens + num_new_tokens, spans[-1].end if spans else 0)
        num_fresh = self.get_num_blocks_needed(end) - len(hit.blocks)
        sources = list({id(b): b for span in spans for b in span.src_blocks}.values())
        evictable_hits = len({b.block_id for b in [*hit.blocks, *sources] if b.ref_cnt == 0})
        pin = tail is not None and (
            tail.ref_cnt > 0 or self.can_allocate(num_fresh + evictable_hits + 1)
        )
        if not self.can_allocate(num_fresh + evictable_hits):
            return False
        self.pool.touch(hit.blocks)
        self.pool.touch(sources)  # before the allocation, which must not evict them
        blocks = list(hit.blocks)
        if tail is not None:
            if pin:
                self.pool.touch([tail])  # before the allocation, which must not evict it
            else:
                blocks.append(self.pool.take_tail(tail))
                num_fresh -= 1
            self._tail_hits += 1
            self._tail_hit_tokens += hit.num_tail_tokens
        blocks.extend(self.pool.allocate(num_fresh))
        state = _SeqState(blocks, len(hit.blocks))
        self._seqs[seq_id] = state
        if tail is not None and pin:
            assert copies is not None
            copies.append((tail.block_id, blocks[len(hit.blocks)].block_id))
            state.pinned_tail = tail
        if spans:
            assert segment_copies is not None and self.enable_prefix_caching
            bs = self.block_size
            for span in spans:
                dst = [blocks[p // bs].block_id * bs + p % bs for p in range(span.start, span.end)]
                segment_copies.append(SegmentCopy(span.src_slots(bs), dst, span.src_start,
                                                  span.start))  # fmt: skip
            state.max_registered = spans[0].start // bs
            state.pinned_sources = sources
        if state.pinned_tail is not None or spans:
            self._pinned.append(state)
        self._query_tokens += hit.num_query_tokens
        self._hit_tokens += hit.num_tokens
        return True

    def segment_source(self) -> FindBlock:
        """``SegmentReuse.plan``'s ``find_block`` for this moment: the pool's block with a hash,
        if a finished step wrote it (never one registered in this step, not written yet)."""
        this_step = {id(b) for b, _ in self._step_blocks}

        def find(block_hash: BlockHash) -> KVBlock | None:
            block = self.pool.hashed_block(block_hash)
            return block if block is not None and id(block) not in this_step else None

        return find

    def append_slots(
        self, seq_id: SeqId, num_computed_tokens: int, num_new_tokens: int
    ) -> list[tuple[int, int]] | None:
        """Grow an admitted sequence's table to cover ``num_computed_tokens + num_new_tokens``.

        A shared block about to be written is first swapped for a fresh copy (copy-on-write).
        Returns the ``(src_block_id, dst_block_id)`` copies to perform before the forward, or
        None, having changed nothing, when the blocks do not fit. Growth may use the watermark.
        """
        assert num_computed_tokens >= 0 and num_new_tokens >= 0
        blocks = self._require(seq_id).blocks
        total = num_computed_tokens + num_new_tokens
        num_needed = self.get_num_blocks_needed(total)
        num_grow = max(0, num_needed - len(blocks))
        cow = []
        if num_new_tokens > 0:  # nothing is written otherwise, not even into the last block
            first_write = num_computed_tokens // self.block_size
            cow = [i for i in range(first_write, min(num_needed, len(blocks)))
                   if blocks[i].ref_cnt > 1]  # fmt: skip
        if num_grow + len(cow) > self.pool.num_available_blocks:
            return None
        copies = []
        for i in cow:
            fresh = self.pool.copy_on_write(blocks[i])
            copies.append((blocks[i].block_id, fresh.block_id))
            blocks[i] = fresh
        blocks.extend(self.pool.allocate(num_grow))
        return copies

    def cache_full_blocks(
        self,
        seq_id: SeqId,
        token_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        num_computed_tokens: int,
    ) -> None:
        """Register every block of ``seq_id`` fully covered by ``num_computed_tokens``.

        The scheduler calls it when it schedules the tokens that fill them: the forward of that
        step writes every layer's K/V before any query reads it, so a request admitted later in
        the same step may already hit these blocks. Generated tokens count like prompt tokens.
        ``block_hashes`` is the sequence's own list (it may run ahead).
        """
        state = self._require(seq_id)
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(num_computed_tokens // bs, len(state.blocks))
        if state.max_registered is not None:
            num_full = min(num_full, state.max_registered)
        assert len(block_hashes) >= num_full and len(token_ids) >= num_full * bs, (
            f"{seq_id!r}: {num_full} full blocks computed but only {len(block_hashes)} hashes "
            f"and {len(token_ids)} tokens given"
        )
        if num_full <= state.num_registered:
            return
        self._step_states.setdefault(id(state), (state, state.num_registered))
        cache_block = self.pool.cache_block
        for i in range(state.num_registered, num_full):
            block = state.blocks[i]
            if block.block_hash is None:
                parent = block_hashes[i - 1] if i > 0 else None
                if cache_block(block, block_hashes[i], token_ids[i * bs : (i + 1) * bs], parent):
                    self._step_blocks.append((block, block_hashes[i]))
        state.num_registered = num_full

    def truncate(self, seq_id: SeqId, num_tokens: int) -> None:
        """Shrink the table to the blocks holding its first ``num_tokens`` tokens: the blocks past
        them held only rejected draft tokens (never registered) and go back to the pool."""
        state = self._require(seq_id)
        keep = self.get_num_blocks_needed(num_tokens)
        assert state.num_registered <= keep, f"{seq_id!r}: a registered block would be freed"
        if len(state.blocks) > keep:
            self.pool.free(reversed(state.blocks[keep:]))
            del state.blocks[keep:]

    def commit_step(self) -> None:
        """The step's forward wrote its K/V: its registrations stand (and are written through to
        the tiers that keep every computed block), its tail and segment copies ran (their
        sources are unpinned)."""
        if self.tiers is not None and self._step_blocks:
            self.tiers.on_committed([b for b, h in self._step_blocks if b.block_hash == h])
        self._step_blocks.clear()
        self._step_states.clear()
        for state in self._pinned:
            self._unpin(state)
        self._pinned.clear()

    def discard_step(self) -> None:
        """The step's forward failed: unregister every block it registered (newest first) and
        restore each sequence's registration mark, as if the step had never been scheduled."""
        for block, block_hash in reversed(self._step_blocks):
            if block.block_hash == block_hash:  # not evicted (and reused) since
                self.pool.uncache_block(block)
        for state, num_registered in self._step_states.values():
            state.num_registered = num_registered
        self.commit_step()  # the copies from pinned tails are simply not needed any more

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """The child shares every block of the parent (ref_cnt + 1 each)."""
        parent = self._require(parent_id)
        assert child_id not in self._seqs, f"fork: {child_id!r} is already a live sequence"
        self.pool.touch(parent.blocks)
        self._seqs[child_id] = _SeqState(list(parent.blocks), parent.num_registered,
                                         max_registered=parent.max_registered)  # fmt: skip

    def free(self, seq_id: SeqId) -> None:
        """Release the sequence's blocks, tail first so chain tails are evicted before heads."""
        state = self._seqs.pop(seq_id, None)
        if state is not None:
            self._unpin(state)
            self.pool.free(reversed(state.blocks))

    def free_keeping_tail(
        self,
        seq_id: SeqId,
        token_ids: Sequence[int],
        block_hashes: Sequence[BlockHash],
        num_computed_tokens: int,
        extra_keys: ExtraKeys,
    ) -> None:
        """``free`` a finished sequence, first making its partial last block a tail: the tokens
        ``num_computed_tokens // block_size * block_size .. num_computed_tokens - 1``, whose
        K/V a successful forward wrote. Nothing is kept if that block is shared (a fork still
        writes it), if no token is past the last full block, or with prefix caching off.

        The caller guarantees the K/V: only after a step's forward succeeded or between steps,
        never for a sequence of a failed step (``Scheduler.abandon_step`` uses ``free``).
        """
        state = self._seqs.get(seq_id)
        if state is not None and self.enable_prefix_caching:
            bs = self.block_size
            num_full, num_tail = divmod(num_computed_tokens, bs)
            exact = state.max_registered is None or num_full < state.max_registered
            if num_tail > 0 and num_full < len(state.blocks) and exact:
                block = state.blocks[num_full]
                if block.ref_cnt == 1 and block.block_hash is None:
                    parent = block_hashes[num_full - 1] if num_full > 0 else None
                    tokens = token_ids[num_full * bs : num_computed_tokens]
                    self.pool.cache_tail(block, tail_key(parent, extra_keys), tokens)
        self.free(seq_id)

    def get_block_table(self, seq_id: SeqId) -> list[int]:
        return [block.block_id for block in self._require(seq_id).blocks]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, the host and disk tiers' too (not the shared tier's:
        other replicas use it); refused (False) while any block is in use."""
        if not self.pool.reset_prefix_cache():
            return False
        if self.tiers is not None:
            self.tiers.clear_local()
        if self.retention is not None:  # what it protected is gone
            self.retention.clear()
            self._retained_out.clear()
        return True

    def _on_evicted(self, block: KVBlock) -> None:
        """The pool evicts ``block`` (hash still set): down to the tiers; a retained one leaves
        the budget now without tiers, else once no tier keeps it (``tick``)."""
        if self.tiers is not None:
            self.tiers.on_evicted(block)
        h = block.block_hash
        if self.retention is not None and self.retention.is_retained(h):
            if self.tiers is None:
                self.retention.drop([h])
            else:
                self._retained_out[h] = BlockKey(h, block.token_ids, block.parent_hash)

    # ---- tiers --------------------------------------------------------------------------------

    def start_load(
        self, load_id: Hashable, token_ids: Sequence[int], block_hashes: Sequence[BlockHash]
    ) -> bool:
        """Ask the tiers for the full blocks after the pool's hit (the lookup's cap applies);
        True if a load started (the request waits for ``load_finished``)."""
        if self.tiers is None:
            return False
        hit = self.lookup(token_ids, block_hashes)
        bs = self.block_size
        first = len(hit.blocks)
        last = max(0, min((len(token_ids) - 1) // bs, len(block_hashes)))
        keys = [
            BlockKey(block_hashes[i], tuple(token_ids[i * bs : (i + 1) * bs]),
                     block_hashes[i - 1] if i > 0 else None)
            for i in range(first, last)
        ]  # fmt: skip
        num = self.tiers.plan_load(keys)
        if num == 0:
            return False
        self.tiers.start_load(load_id, keys[:num])
        return True

    def apply_loads(self) -> None:
        """Bring every finished load into the pool: fresh blocks (within the watermark), K/V
        copied in, registered, then freed to the LRU (chain tail first, evicted before its head).
        A block another request registered meanwhile is not registered twice (freed as is)."""
        if self.tiers is None:
            return
        for load_id, loaded in self.tiers.take_finished_loads():
            if load_id in self._cancelled_loads:
                self._cancelled_loads.discard(load_id)
            else:
                self._finished_loads.add(load_id)
            if loaded:
                self._apply_load(loaded)

    def _apply_load(self, loaded: list) -> None:
        # the chain's blocks still in the pool are held meanwhile: allocating room for the
        # loaded blocks must not evict the prefix they continue
        chain = self._pool_chain(loaded[0][0].parent_hash)
        self.pool.touch(chain)
        num = min(len(loaded), max(0, self.pool.num_available_blocks - self.watermark_blocks))
        loaded = [(key, kv) for key, kv in loaded[:num]
                  if self.pool.get_cached_block(key.block_hash, key.token_ids) is None]  # fmt: skip
        try:
            if loaded:
                self._register_loaded(loaded)
        finally:
            self.pool.free(reversed(chain))

    def _register_loaded(self, loaded: list) -> None:
        blocks = self.pool.allocate(len(loaded))
        try:
            self.tiers.write_blocks([b.block_id for b in blocks], [kv for _, kv in loaded])
        except Exception:
            logger.exception("KV tiers: %d loaded blocks could not be copied in; a miss",
                             len(blocks))  # fmt: skip
            self._failed_load_blocks += len(blocks)
            self.pool.free(blocks)
            return
        for block, (key, _) in zip(blocks, loaded):
            self.pool.cache_block(block, key.block_hash, key.token_ids, key.parent_hash)
        self.pool.free(reversed(blocks))
        self._loaded_blocks += len(blocks)

    def _pool_chain(self, block_hash: BlockHash | None) -> list[KVBlock]:
        """The pool's blocks of the chain ending at ``block_hash``, head first, back to the
        first one missing."""
        chain = []
        while block_hash is not None and (block := self.pool.hashed_block(block_hash)) is not None:
            chain.append(block)
            block_hash = block.parent_hash
        return chain[::-1]

    def load_finished(self, load_id: Hashable) -> bool:
        """Whether the load started for ``load_id`` was applied (forgotten once it says so)."""
        if load_id in self._finished_loads:
            self._finished_loads.discard(load_id)
            return True
        return False

    def cancel_load(self, load_id: Hashable) -> None:
        """The request went away: its load is still applied when it finishes (the blocks are
        valid), then forgotten."""
        if load_id in self._finished_loads:
            self._finished_loads.discard(load_id)
        elif self.tiers is not None and self.tiers.is_in_flight(load_id):
            self._cancelled_loads.add(load_id)

    # ---- retention ----------------------------------------------------------------------------

    def retain(
        self, token_ids: Sequence[int], block_hashes: Sequence[BlockHash], retention: KVRetention
    ) -> int:
        """Protect the full blocks of ``token_ids[:retention.num_tokens]``, as many leading ones
        as the pool holds and the tenant's share allows; the number of blocks now retained.
        ``write_through`` also writes them to the disk tier."""
        if self.retention is None or not self.enable_prefix_caching:
            return 0
        end = len(token_ids) if retention.num_tokens is None else retention.num_tokens
        hashes = block_hashes[: min(end, len(token_ids)) // self.block_size]
        held = itertools.takewhile(lambda h: self.pool.hashed_block(h) is not None, hashes)
        granted, ended = self.retention.retain(held, retention.ttl_s, retention.session,
                                               retention.tenant)  # fmt: skip
        self.pool.unretain(ended)
        self.pool.retain(granted)
        if retention.write_through and self.tiers is not None:
            in_pool = [b for h in granted if (b := self.pool.hashed_block(h)) is not None]
            self.tiers.on_committed(in_pool)
        return len(granted)

    def release(self, session: str) -> int:
        """Drop what ``session`` retained; the number of blocks no longer retained."""
        if self.retention is None:
            return 0
        hashes = self.retention.release(session)
        self.pool.unretain(hashes)
        return len(hashes)

    def rename(self, session: str, name: str) -> None:
        """What ``session`` retained is held under ``name`` instead."""
        if self.retention is not None:
            self.retention.rename(session, name)

    def observe_session(self, session: str) -> None:
        """A request of ``session`` arrived (the TTL learner's gap since its tool-call pause)."""
        if self.retention is not None:
            self.retention.observe_request(session)

    def tick(self) -> None:
        """Expire retentions whose time passed (their blocks are evicted next); retained blocks
        no tier keeps any more leave the budget."""
        if self.retention is None:
            return
        self.pool.unretain(self.retention.expire())
        for h in list(itertools.islice(self._retained_out, RETAINED_SWEEP)):
            key = self._retained_out.pop(h)
            if not self.retention.is_retained(h) or self.pool.hashed_block(h) is not None:
                continue  # released, expired, or loaded back into the pool
            if self.tiers is not None and self.tiers.holds(key):
                self._retained_out[key.block_hash] = key  # looked at again after the others
            else:
                self.retention.drop([h])

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.num_blocks

    def stats(self) -> dict[str, int | float]:
        queries, hits = self._query_tokens, self._hit_tokens
        return {
            "prefix_cache_queries": queries,
            "prefix_cache_hits": hits,
            "hit_rate": hits / queries if queries else 0.0,
            "num_blocks": self.num_blocks,
            "free_blocks": self.pool.num_free_blocks,
            "cached_blocks": self.pool.num_cached_blocks,
            "used_blocks": self.pool.num_used_blocks,
            "evictions": self.pool.evictions,
            "cow_copies": self.pool.cow_copies,
            "tail_hits": self._tail_hits,
            "tail_hit_tokens": self._tail_hit_tokens,
            "tail_blocks": self.pool.num_tail_blocks,
            "retained_cached_blocks": self.pool.num_retained_blocks,
            "tier_loaded_blocks": self._loaded_blocks,
            "tier_load_failures": self._failed_load_blocks,
            **(self.retention.stats() if self.retention is not None else {}),
        }

    def _unpin(self, state: _SeqState) -> None:
        if state.pinned_tail is not None:
            self.pool.free([state.pinned_tail])
            state.pinned_tail = None
        if state.pinned_sources is not None:
            self.pool.free(state.pinned_sources)
            state.pinned_sources = None

    def _require(self, seq_id: SeqId) -> _SeqState:
        state = self._seqs.get(seq_id)
        assert state is not None, f"unknown sequence {seq_id!r}"
        return state
