"""Random allocate / grow / cache / fork / free / evict sequences against a model of the KV.

Besides the bookkeeping invariants, the machine simulates what each physical slot holds
(the model runner's copies, then the forward's writes) and checks that every sequence
reads back exactly its own tokens and that every hashed block holds the KV its hash names.
Finished sequences leave their partial last block as a tail (``free_keeping_tail``), and
admissions copy tails (``lookup`` with extra keys): every tail must hold the KV its key and
tokens name.

With tiers (``KVCacheMachineWithTiers``): a fake tier manager keeps what each evicted block's
slots held, loads it back into fresh blocks (sometimes only a part: a failed load), and the
same invariants must hold: a loaded block holds exactly the KV its hash names, and the counts
still add up. Retention (retain, release, expiry) only reorders what is evicted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixserve.kv.hashing import extend_block_hashes
from prefixserve.kv.kv_cache_manager import KVCacheManager
from prefixserve.kv.partial_tail import tail_key
from prefixserve.kv.retention import KVRetention, RetentionTable

BS = 4
NUM_BLOCKS = 16
SHARED_PREFIXES = [[0, 1, 2, 0] * 4, [1] * 16, [2, 2, 0, 1] * 4]
Slot = tuple[tuple, tuple[int, ...]]  # (extra_keys, every token up to and including this one)


@dataclass
class Seq:
    extra: tuple
    tokens: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    num_computed: int = 0


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(NUM_BLOCKS, BS, watermark=0.1)  # one block in reserve
        self.seqs: dict[int, Seq] = {}
        self.finished: list[Seq] = []  # freed sequences, for continuations that reuse their tail
        self.slots: list[list[Slot | None]] = [[None] * BS for _ in range(NUM_BLOCKS)]
        self.next_id = 0
        self.next_unique_token = 1000

    def snapshot(self) -> tuple:
        pool = self.mgr.pool
        return (
            self.mgr.stats(),
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            {sid: self.mgr.get_block_table(sid) for sid in self.seqs},
            pool.lru_block_ids(),
        )

    def forward(self, sid: int, copies: list[tuple[int, int]], end: int) -> None:
        """Do what the model runner does: the copies, then write positions num_computed..end-1."""
        seq = self.seqs[sid]
        table = self.mgr.get_block_table(sid)
        for src, dst in copies:
            self.slots[dst] = list(self.slots[src])
        written = range(seq.num_computed // BS, -(-end // BS)) if end > seq.num_computed else []
        for i in written:
            assert self.mgr.pool.blocks[table[i]].ref_cnt == 1, "a write into a shared block"
        for pos in range(seq.num_computed, end):
            self.slots[table[pos // BS]][pos % BS] = (seq.extra, tuple(seq.tokens[: pos + 1]))
        seq.num_computed = end
        extend_block_hashes(seq.tokens, BS, seq.extra, seq.hashes)
        self.mgr.cache_full_blocks(sid, seq.tokens, seq.hashes, end)

    def admit(self, tokens: list[int], extra: tuple) -> int | None:
        sid, self.next_id = self.next_id, self.next_id + 1
        seq = Seq(extra, list(tokens))
        extend_block_hashes(seq.tokens, BS, extra, seq.hashes)
        hit = self.mgr.lookup(seq.tokens, seq.hashes, extra)
        assert hit.num_tokens < len(tokens)
        before = self.snapshot()
        copies: list[tuple[int, int]] = []
        if not self.mgr.allocate_for_prompt(sid, hit, len(tokens) - hit.num_tokens, copies):
            assert self.snapshot() == before and copies == []
            return None
        self.seqs[sid] = seq
        seq.num_computed = hit.num_tokens
        self.forward(sid, copies, len(tokens))
        self.mgr.commit_step()
        return sid

    def pick(self, data: st.DataObject) -> int:
        return data.draw(st.sampled_from(sorted(self.seqs)))

    @rule(
        base=st.sampled_from(SHARED_PREFIXES),
        cut=st.integers(0, 16),
        tail=st.lists(st.integers(0, 2), min_size=1, max_size=8),
        salt=st.sampled_from([None, "s"]),
    )
    def allocate(self, base: list[int], cut: int, tail: list[int], salt: str | None) -> None:
        self.admit(base[:cut] + tail, (salt, None))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), tail=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def next_turn(self, data: st.DataObject, tail: list[int]) -> None:
        """A new request that resends a live sequence's tokens, generated ones included."""
        seq = self.seqs[self.pick(data)]
        self.admit(seq.tokens + tail, seq.extra)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def finish_and_continue(self, data: st.DataObject, new: list[int]) -> None:
        """A sequence finishes keeping its tail, and its next turn comes at once."""
        sid = self.pick(data)
        seq = self.seqs.pop(sid)
        self.finished.append(seq)
        self.mgr.free_keeping_tail(sid, seq.tokens, seq.hashes, seq.num_computed, seq.extra)
        self.admit(seq.tokens + new, seq.extra)

    @precondition(lambda self: self.finished)
    @rule(data=st.data(), keep=st.integers(0, 3), tail=st.lists(st.integers(0, 2), max_size=4))
    def continue_finished(self, data: st.DataObject, keep: int, tail: list[int]) -> None:
        """The next turn of a freed sequence (minus up to ``keep`` last tokens): hits its tail."""
        seq = data.draw(st.sampled_from(self.finished))
        tokens = seq.tokens[: max(1, len(seq.tokens) - keep)] + tail
        self.admit(tokens, seq.extra)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def grow(self, data: st.DataObject, new: list[int]) -> None:
        sid = self.pick(data)
        seq = self.seqs[sid]
        before = self.snapshot()
        copies = self.mgr.append_slots(sid, seq.num_computed, len(new))
        if copies is None:
            assert self.snapshot() == before
            return
        seq.tokens.extend(new)
        self.forward(sid, copies, len(seq.tokens))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent_id = self.pick(data)
        parent = self.seqs[parent_id]
        child, self.next_id = self.next_id, self.next_id + 1
        self.mgr.fork(parent_id, child)
        self.seqs[child] = Seq(
            parent.extra, list(parent.tokens), list(parent.hashes), parent.num_computed
        )

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), keep_tail=st.booleans())
    def free(self, data: st.DataObject, keep_tail: bool) -> None:
        sid = self.pick(data)
        seq = self.seqs.pop(sid)
        self.finished.append(seq)
        if keep_tail:
            self.mgr.free_keeping_tail(sid, seq.tokens, seq.hashes, seq.num_computed, seq.extra)
        else:
            self.mgr.free(sid)

    @rule(length=st.integers(4, 40))
    def pressure(self, length: int) -> None:
        """A long unique prompt that comes and goes: forces evictions of cached blocks."""
        tokens = list(range(self.next_unique_token, self.next_unique_token + length))
        self.next_unique_token += length
        sid = self.admit(tokens, (None, None))
        if sid is not None:
            self.mgr.free(sid)
            del self.seqs[sid]

    @rule()
    def reset(self) -> None:
        in_use = self.mgr.pool.num_used_blocks > 0
        assert self.mgr.reset_prefix_cache() is not in_use

    @invariant()
    def counts_add_up(self) -> None:
        pool = self.mgr.pool
        assert pool.num_free_blocks + pool.num_cached_blocks + pool.num_used_blocks == NUM_BLOCKS
        free = sum(b.ref_cnt == 0 and b.block_hash is None and not b.is_tail for b in pool.blocks)
        assert free == pool.num_free_blocks

    @invariant()
    def ref_cnt_equals_table_entries(self) -> None:
        entries = Counter(i for sid in self.seqs for i in self.mgr.get_block_table(sid))
        assert [b.ref_cnt for b in self.mgr.pool.blocks] == [entries[i] for i in range(NUM_BLOCKS)]

    @invariant()
    def hash_map_and_lru_are_consistent(self) -> None:
        pool = self.mgr.pool
        mapped = pool.hashed_blocks()
        assert all(b.block_hash == h for h, b in mapped.items())
        assert {b.block_id for b in pool.blocks if b.block_hash is not None} == {
            b.block_id for b in mapped.values()
        }
        lru = pool.lru_block_ids()
        assert sorted(lru) == [
            b.block_id
            for b in pool.blocks
            if b.ref_cnt == 0 and (b.block_hash is not None or b.is_tail)
        ]
        tails = pool.tail_blocks()
        assert {b.block_id for b in tails} == {b.block_id for b in pool.blocks if b.is_tail}
        assert all(b.block_hash is None and b.ref_cnt == 0 for b in tails)  # no step in flight

    @invariant()
    def tails_hold_what_their_key_names(self) -> None:
        """Slot i of a tail holds token i of it, after the prefix its key names."""
        for block in self.mgr.pool.tail_blocks():
            assert block.token_ids and 0 < len(block.token_ids) < BS
            n = len(block.token_ids)
            extra, prefix = self.slots[block.block_id][n - 1]
            assert prefix[-n:] == block.token_ids
            for i in range(n):
                assert self.slots[block.block_id][i] == (extra, prefix[: len(prefix) - n + i + 1])
            full = prefix[: len(prefix) - n]
            assert len(full) % BS == 0
            hashes: list[int] = []
            extend_block_hashes(full, BS, extra, hashes)
            assert block.tail_key == tail_key(hashes[-1] if hashes else None, extra)

    @invariant()
    def hashed_blocks_hold_what_their_hash_names(self) -> None:
        for block in self.mgr.pool.hashed_blocks().values():
            content = self.slots[block.block_id]
            extra, prefix = content[BS - 1]
            assert prefix[-BS:] == block.token_ids
            expected: list[int] = []
            extend_block_hashes(prefix, BS, extra, expected)
            assert expected[-1] == block.block_hash

    @invariant()
    def every_sequence_reads_its_own_kv(self) -> None:
        for sid, seq in self.seqs.items():
            table = self.mgr.get_block_table(sid)
            assert len(table) == -(-seq.num_computed // BS)
            for pos in range(seq.num_computed):
                expected = (seq.extra, tuple(seq.tokens[: pos + 1]))
                assert self.slots[table[pos // BS]][pos % BS] == expected

    def teardown(self) -> None:
        for sid in list(self.seqs):
            self.mgr.free(sid)
        pool = self.mgr.pool
        assert pool.num_used_blocks == 0
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert pool.num_free_blocks + pool.num_cached_blocks == NUM_BLOCKS
        assert self.mgr.reset_prefix_cache()


KVCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestKVCacheInvariants = KVCacheMachine.TestCase


class FakeTiers:
    """``KVTierManager``'s surface for ``KVCacheManager``, over the machine's simulated slots:
    an evicted block's slots are kept (as the copy-out before any overwrite would), a load hands
    back the leading blocks it holds, or fewer when told to fail part way."""

    def __init__(self, slots: list) -> None:
        self.slots = slots
        self.store: dict[int, tuple[tuple[int, ...], list]] = {}
        self.pending: list[tuple[object, list]] = []
        self.in_flight: set[object] = set()
        self.fail_after: int | None = None

    def on_evicted(self, block) -> None:
        self.store[block.block_hash] = (block.token_ids, list(self.slots[block.block_id]))

    def on_committed(self, blocks, required: bool = False) -> None:
        pass

    def plan_load(self, keys) -> int:
        n = 0
        for key in keys:
            kept = self.store.get(key.block_hash)
            if kept is None or kept[0] != key.token_ids:
                break
            n += 1
        return n

    def start_load(self, load_id, keys) -> None:
        found = [(key, self.store[key.block_hash][1]) for key in keys]
        if self.fail_after is not None:
            found = found[: self.fail_after]
        self.in_flight.add(load_id)
        self.pending.append((load_id, found))

    def is_in_flight(self, load_id) -> bool:
        return load_id in self.in_flight

    def take_finished_loads(self):
        done, self.pending = self.pending, []
        for load_id, _ in done:
            self.in_flight.discard(load_id)
        return done

    def write_blocks(self, block_ids, contents) -> None:
        for block_id, content in zip(block_ids, contents):
            self.slots[block_id] = list(content)

    def holds(self, key) -> bool:
        return key.block_hash in self.store

    def clear_local(self) -> None:
        self.store.clear()


class KVCacheMachineWithTiers(KVCacheMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.tiers = FakeTiers(self.slots)
        self.retention = RetentionTable(NUM_BLOCKS // 2, clock=lambda: self.now)
        self.mgr = KVCacheManager(
            NUM_BLOCKS, BS, watermark=0.1, tiers=self.tiers, retention=self.retention
        )

    @precondition(lambda self: self.finished)
    @rule(data=st.data(), fail_after=st.sampled_from([None, 0, 1]))
    def load_then_admit(self, data: st.DataObject, fail_after: int | None) -> None:
        """A finished sequence's next turn: its blocks come back from the tier (or part of
        them), then it is admitted on whatever the pool holds."""
        seq = data.draw(st.sampled_from(self.finished))
        self.tiers.fail_after = fail_after
        load_id = object()
        if self.mgr.start_load(load_id, seq.tokens + [0], seq.hashes):
            self.mgr.apply_loads()
            assert self.mgr.load_finished(load_id)
        self.admit(seq.tokens + [0], seq.extra)

    @precondition(lambda self: self.finished)
    @rule(data=st.data(), ttl=st.sampled_from([1.0, 5.0]), session=st.sampled_from(["a", "b"]),
          tenant=st.sampled_from(["t1", "t2"]))  # fmt: skip
    def retain(self, data: st.DataObject, ttl: float, session: str, tenant: str) -> None:
        seq = data.draw(st.sampled_from(self.finished))
        self.mgr.retain(seq.tokens, seq.hashes,
                        KVRetention(ttl_s=ttl, session=session, tenant=tenant))  # fmt: skip

    @rule()
    def tier_forgets_everything(self) -> None:
        """The tier below lost every block: retained ones the pool lacks leave the budget."""
        self.tiers.store.clear()
        self.mgr.tick()
        pool = self.mgr.pool
        assert all(pool.hashed_block(h) is not None for h in self.retention._holders)

    @rule(session=st.sampled_from(["a", "b"]))
    def release(self, session: str) -> None:
        self.mgr.release(session)

    @rule(seconds=st.sampled_from([0.5, 2.0, 10.0]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        self.mgr.tick()

    @invariant()
    def retained_blocks_wait_in_the_retained_lru(self) -> None:
        pool = self.mgr.pool
        assert len(self.retention) <= self.retention.budget_blocks
        stats = self.retention.stats()
        assert stats["retention_used_blocks"] <= self.retention.budget_blocks
        assert stats["retention_sessions"] <= stats["retention_used_blocks"]
        assert stats["retention_heap_entries"] <= 2 * stats["retention_sessions"] + 64
        for block_id in pool.lru_block_ids()[len(pool.lru_block_ids()) - pool.num_retained_blocks :]:
            block = pool.blocks[block_id]
            assert block.block_hash is not None and self.retention.is_retained(block.block_hash)


KVCacheMachineWithTiers.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
TestKVCacheInvariantsWithTiers = KVCacheMachineWithTiers.TestCase
