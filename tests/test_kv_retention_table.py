"""The retention table's sessions and its budget between tenants, in plain Python (no engine):
max-min fair shares, blocks that left the pool leaving the budget, one session per prefix, and
the bounds on sessions, names and the expiry heap (``prefixserve.kv.retention``)."""

from __future__ import annotations

import torch

from prefixserve.kv.kv_cache_manager import KVCacheManager
from prefixserve.kv.retention import (
    HEAP_SLACK,
    MAX_NAMES_PER_SESSION,
    KVRetention,
    RetentionTable,
)
from prefixserve.kv.tiers import HostTier, KVTierManager


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def chain(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_a_tenant_alone_takes_the_whole_budget_and_yields_to_another_down_to_equal_shares():
    table = RetentionTable(8, clock=Clock())
    assert table.retain(chain(0, 6), 60, "a1", "A") == (chain(0, 6), [])
    assert table.retain(chain(10, 4), 60, "a2", "A") == (chain(10, 2), [])  # budget full
    assert table.refused == 2 and table.usage("A") == 8
    # B asks for 6: A gives back from its least recently retained session, tail first
    granted, ended = table.retain(chain(20, 6), 60, "b", "B")
    assert granted == chain(20, 4) and ended == [5, 4, 3, 2]
    assert table.usage("A") == table.usage("B") == 4 and table.revoked == 4
    assert not table.is_retained(5) and table.is_retained(1)
    # at equal shares nobody takes from anybody
    assert table.retain(chain(30, 1), 60, "b2", "B") == ([], [])
    assert table.retain(chain(40, 1), 60, "a3", "A") == ([], [])


def test_three_tenants_end_within_one_block_of_each_other():
    table = RetentionTable(10, clock=Clock())
    table.retain(chain(0, 10), 60, "a", "A")
    table.retain(chain(100, 10), 60, "b", "B")
    table.retain(chain(200, 10), 60, "c", "C")
    shares = sorted(table.usage(t) for t in "ABC")
    assert sum(shares) == 10 and shares[-1] - shares[0] <= 1


def test_a_hash_shared_between_tenants_counts_for_each():
    table = RetentionTable(4, clock=Clock())
    table.retain([1, 2], 60, "a", "A")
    table.retain([1, 2], 60, "b", "B")  # one block, two tenants retain it: both pay
    assert table.usage("A") == table.usage("B") == 2 and len(table) == 2
    assert table.release("a") == [] and table.is_retained(1)  # B still holds them
    assert sorted(table.release("b")) == [1, 2]


def test_blocks_that_left_the_pool_leave_the_budget():
    table = RetentionTable(4, clock=Clock())
    table.retain(chain(0, 4), 60, "a", "A")
    assert table.retain([9], 60, "b", "B") == ([9], [3])  # room taken back from A
    table.drop([3, 2, 1])  # already gone: 3; then the pool evicted 2 and 1
    assert table.usage("A") == 1 and table.usage("B") == 1 and table.dropped == 2
    assert table.retain([7, 8], 60, "b2", "B") == ([7, 8], [])  # the room is granted again
    assert table.stats()["retention_sessions"] == 3  # A's session now ends at its hash 0
    assert table.release("a") == [0]


def test_the_same_prefix_again_refreshes_one_session():
    clock = Clock()
    table = RetentionTable(100, clock=clock)
    for i in range(200):
        clock.now += 1
        table.retain(chain(0, 13), 3600, f"ns/resp_{i}", "A")
    stats = table.stats()
    assert stats["retention_sessions"] == 1 and stats["retained_blocks"] == 13
    assert stats["retention_heap_entries"] <= 2 + HEAP_SLACK  # stale entries were compacted
    (session,) = table._sessions.values()
    assert list(session.names) == [f"ns/resp_{i}" for i in range(200 - MAX_NAMES_PER_SESSION, 200)]
    clock.now += 3599
    assert table.expire() == []  # the last refresh runs until 200 + 3600
    clock.now += 1
    assert sorted(table.expire()) == chain(0, 13) and not table._heap


def test_a_tenant_keeps_a_bounded_number_of_sessions_oldest_ending_first():
    table = RetentionTable(100, clock=Clock(), max_sessions_per_tenant=3)
    for i in range(5):
        table.retain([10 * i, 10 * i + 1], 60, f"s{i}", "A")
    table.retain([90], 60, "other", "B")  # another tenant's sessions are its own
    assert sorted(k for k in table._sessions) == [("A", 21), ("A", 31), ("A", 41), ("B", 90)]
    assert table.release("s0") == [] and not table.is_retained(0)


def test_a_session_that_lost_its_last_hash_merges_into_the_shorter_prefix():
    table = RetentionTable(100, clock=Clock())
    table.retain([1, 2], 60, "turn1", "A")
    table.retain([1, 2, 3], 600, "turn2", "A")
    table.drop([3])  # turn2's session is now the prefix [1, 2]: the same as turn1's
    (session,) = table._sessions.values()
    assert list(session.hashes) == [1, 2] and set(session.names) == {"turn1", "turn2"}
    assert session.expiry == 600
    assert table.release("turn1") == [] and sorted(table.release("turn2")) == [1, 2]


def test_the_manager_retains_what_the_pool_holds_and_forgets_what_it_evicts():
    table = RetentionTable(8, clock=Clock())
    mgr = KVCacheManager(8, 2, watermark=0.0, retention=table)
    tokens, hashes = list(range(8)), [100, 101, 102, 103]
    hit = mgr.lookup(tokens + [0], hashes)
    assert mgr.allocate_for_prompt("s", hit, 9)
    mgr.cache_full_blocks("s", tokens + [0], hashes, 4)  # blocks 0 and 1 written
    mgr.commit_step()
    mgr.free("s")
    # only the leading blocks the pool holds are retained: 102, 103 were never computed
    assert mgr.retain(tokens, hashes, KVRetention(ttl_s=60, session="a", tenant="A")) == 2
    assert table.usage("A") == 2
    mgr.pool.allocate(8)  # pressure: the retained blocks are evicted last, but evicted
    assert table.usage("A") == 0 and len(table) == 0 and table.dropped == 2


def test_with_a_host_tier_a_retained_block_leaves_the_budget_once_no_tier_keeps_it():
    kv = torch.zeros(1, 2, 8, 2, 1, 4)  # [layers, K/V, blocks, block_size, heads, head_dim]
    one_block = 2 * 2 * 1 * 4 * kv.element_size()
    table = RetentionTable(8, clock=Clock())
    host = HostTier(one_block, retained_by=table.tenant_of)  # room for one block
    tiers = KVTierManager([host], block_size=2, dtype=kv.dtype)
    tiers.attach(kv)
    try:
        mgr = KVCacheManager(8, 2, watermark=0.0, tiers=tiers, retention=table)
        tokens, hashes = list(range(4)), [100, 101]
        assert mgr.allocate_for_prompt("s", mgr.lookup(tokens + [0], hashes), 5)
        mgr.cache_full_blocks("s", tokens + [0], hashes, 4)
        mgr.commit_step()
        mgr.free("s")
        assert mgr.retain(tokens, hashes, KVRetention(ttl_s=60, tenant="A")) == 2
        mgr.pool.allocate(8)  # both evicted from the pool, on their way to the host tier
        tiers.flush()
        mgr.tick()  # queued for the host tier: still kept below the pool
        assert table.usage("A") == 2
    finally:
        tiers.close()  # the stores ran: the host tier kept one block, the other is gone
    mgr.tick()
    assert table.usage("A") == 1 and table.dropped == 1
    host.clear()
    mgr.tick()
    assert table.usage("A") == 0 and len(table) == 0


def test_a_renamed_pause_keeps_its_blocks_and_its_start_under_the_new_name():
    clock = Clock()
    table = RetentionTable(8, clock=clock, learn_ttl=True)
    table.retain(chain(0, 3), None, "s/~req", "A")  # a pause: the learned TTL
    clock.now = 2.0
    table.rename("s/~req", "s/call_1")
    assert table.release("s/~req") == [] and table.is_retained(2)  # the old name is gone
    clock.now = 5.0
    table.observe_request("s/call_1")  # the next turn: the gap runs from the pause, 5 s
    assert list(table._gaps) == [5.0]
    assert table.release("s/call_1") == chain(0, 3) and len(table) == 0
