"""KVCacheManager: exact block ids, ref counts, hits, eviction order, copy-on-write, counters."""

from __future__ import annotations

import pytest

from prefixserve.core.errors import InvalidArgumentError
from prefixserve.kv import hashing
from prefixserve.kv.hashing import extend_block_hashes
from prefixserve.kv.kv_cache_manager import KVCacheManager, PrefixHit

BS = 4


def make(num_blocks: int = 8, **kw: object) -> KVCacheManager:
    kw.setdefault("watermark", 0.0)
    return KVCacheManager(num_blocks, BS, **kw)  # type: ignore[arg-type]


def hashes_of(tokens: list[int], extra: tuple = ()) -> list[int]:
    out: list[int] = []
    extend_block_hashes(tokens, BS, extra, out)
    return out


def admit(
    mgr: KVCacheManager, sid: str, tokens: list[int], extra: tuple = ()
) -> tuple[PrefixHit, list[tuple[int, int]] | None]:
    """Lookup, allocate and 'run' the prompt, registering its full blocks."""
    hs = hashes_of(tokens, extra)
    hit = mgr.lookup(tokens, hs)
    admitted = mgr.allocate_for_prompt(sid, hit, len(tokens) - hit.num_tokens)
    if admitted:
        mgr.cache_full_blocks(sid, tokens, hs, len(tokens))
    return hit, [] if admitted else None


def refs(mgr: KVCacheManager) -> list[int]:
    return [b.ref_cnt for b in mgr.pool.blocks]


def snapshot(mgr: KVCacheManager, sids: list[str]) -> tuple:
    return (
        mgr.stats(),
        refs(mgr),
        {s: mgr.get_block_table(s) for s in sids},
        mgr.pool.lru_block_ids(),
        {h: b.block_id for h, b in mgr.pool.hashed_blocks().items()},
        [b.block_hash for b in mgr.pool.blocks],
    )


def test_block_ids_and_ref_counts_after_a_hit() -> None:
    mgr = make(8)
    hit, copies = admit(mgr, "a", list(range(10)))
    assert hit.num_tokens == 0 and copies == []
    assert mgr.get_block_table("a") == [0, 1, 2]
    hit, copies = admit(mgr, "b", list(range(8)) + [100, 101, 102])
    assert [b.block_id for b in hit.blocks] == [0, 1] and hit.num_tokens == 8
    assert hit.num_query_tokens == 11
    assert mgr.get_block_table("b") == [0, 1, 3]
    assert refs(mgr)[:4] == [2, 2, 1, 1]


def test_lookup_has_no_side_effects() -> None:
    mgr = make(4)
    admit(mgr, "a", list(range(8)))
    mgr.free("a")
    before = snapshot(mgr, [])
    hit = mgr.lookup(list(range(9)), hashes_of(list(range(9))))
    assert hit.num_tokens == 8
    assert snapshot(mgr, []) == before


def test_partial_last_block_has_no_hash() -> None:
    mgr = make(4)
    admit(mgr, "a", list(range(6)))
    b0, b1 = (mgr.pool.blocks[i] for i in mgr.get_block_table("a"))
    assert b0.block_hash is not None and b0.token_ids == (0, 1, 2, 3)
    assert b1.block_hash is None and b1.token_ids is None


def test_decode_blocks_are_cached_once_full() -> None:
    mgr = make(4)
    tokens = [7, 8, 9]
    hs = hashes_of(tokens)
    admit(mgr, "a", tokens)
    hashed_after = []
    for step in range(6):
        assert mgr.append_slots("a", len(tokens), 1) == []
        tokens.append(50 + step)
        extend_block_hashes(tokens, BS, (), hs)
        mgr.cache_full_blocks("a", tokens, hs, len(tokens))
        hashed_after.append(
            [mgr.pool.blocks[i].block_hash is not None for i in mgr.get_block_table("a")]
        )
    assert hashed_after == [
        [True],
        [True, False],
        [True, False],
        [True, False],
        [True, True],
        [True, True, False],
    ]
    assert mgr.get_block_table("a") == [0, 1, 2]


def test_hit_is_capped_so_one_token_is_computed() -> None:
    mgr = make(8)
    admit(mgr, "a", list(range(12)))
    assert mgr.lookup(list(range(12)), hashes_of(list(range(12)))).num_tokens == 8
    assert mgr.lookup(list(range(13)), hashes_of(list(range(13)))).num_tokens == 12
    assert mgr.lookup(list(range(4)), hashes_of(list(range(4)))).num_tokens == 0
    assert mgr.lookup([], []).num_tokens == 0


def test_hit_block_is_not_evicted_and_tails_go_before_heads() -> None:
    mgr = make(3)
    admit(mgr, "a", [0, 1, 2, 3])
    mgr.free("a")
    admit(mgr, "b", list(range(10, 18)))
    mgr.free("b")
    # Block 0 is the LRU head; b's chain was freed tail first: 2 before 1.
    assert mgr.pool.lru_block_ids() == [0, 2, 1]
    hit, copies = admit(mgr, "c", [0, 1, 2, 3, 5, 5, 5, 5, 5])
    assert [b.block_id for b in hit.blocks] == [0]
    assert copies == [] and mgr.get_block_table("c") == [0, 2, 1]
    assert mgr.stats()["evictions"] == 2


def test_eviction_drops_the_tail_first_so_the_head_still_hits() -> None:
    mgr = make(4)
    admit(mgr, "a", list(range(12)))
    mgr.free("a")
    admit(mgr, "x", [90, 91, 92, 93, 94])  # free block 3, then evicts a's tail (block 2)
    assert mgr.get_block_table("x") == [3, 2]
    assert mgr.lookup(list(range(13)), hashes_of(list(range(13)))).num_tokens == 8


def test_unhashed_blocks_are_reused_before_cached_ones_are_evicted() -> None:
    mgr = make(3)
    admit(mgr, "a", list(range(6)))  # block 0 hashed, block 1 partial
    mgr.free("a")
    admit(mgr, "b", [50, 51])
    admit(mgr, "c", [60, 61])
    assert mgr.get_block_table("b") == [2] and mgr.get_block_table("c") == [1]
    assert mgr.stats()["evictions"] == 0
    assert mgr.lookup(list(range(6)), hashes_of(list(range(6)))).num_tokens == 4


def test_salted_requests_do_not_share() -> None:
    mgr = make(8)
    tokens = list(range(9))
    admit(mgr, "a", tokens, ("tenant-a", None))
    assert mgr.lookup(tokens, hashes_of(tokens, ("tenant-b", None))).num_tokens == 0
    assert mgr.lookup(tokens, hashes_of(tokens, (None, None))).num_tokens == 0
    assert mgr.lookup(tokens, hashes_of(tokens, ("tenant-a", None))).num_tokens == 8


def test_failed_allocation_changes_nothing() -> None:
    mgr = make(4)
    admit(mgr, "a", list(range(8)))
    admit(mgr, "b", [40, 41, 42])
    mgr.free("a")  # blocks 0, 1 cached; 2 used by b; 3 free
    before = snapshot(mgr, ["b"])
    tokens = list(range(8)) + list(range(100, 110))
    hit, copies = admit(mgr, "c", tokens)  # hit 2 blocks, needs 3 more, only 1 free
    assert hit.num_tokens == 8 and copies is None
    assert mgr.append_slots("b", 3, 14) is None
    assert snapshot(mgr, ["b"]) == before
    with pytest.raises(AssertionError):
        mgr.get_block_table("c")


def test_admission_keeps_the_watermark_growth_may_use_it() -> None:
    mgr = KVCacheManager(100, BS, watermark=0.1)
    assert not mgr.allocate_for_prompt("a", PrefixHit([], 0, 0), 91 * BS)
    assert mgr.allocate_for_prompt("a", PrefixHit([], 0, 0), 90 * BS)
    assert not mgr.can_allocate(1)
    assert mgr.append_slots("a", 90 * BS, 10 * BS) == []
    assert mgr.usage == 1.0


def test_reset_refused_while_in_use_then_works() -> None:
    mgr = make(4)
    admit(mgr, "a", list(range(8)))
    assert not mgr.reset_prefix_cache()
    assert mgr.lookup(list(range(9)), hashes_of(list(range(9)))).num_tokens == 8
    mgr.free("a")
    assert mgr.reset_prefix_cache()
    assert mgr.lookup(list(range(9)), hashes_of(list(range(9)))).num_tokens == 0
    assert mgr.stats()["free_blocks"] == 4 and mgr.stats()["cached_blocks"] == 0


def test_hash_collision_never_returns_other_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "xxh3_128_intdigest", lambda data: 42)
    mgr = make(8)
    admit(mgr, "a", [1, 2, 3, 4, 5])
    hit, _ = admit(mgr, "b", [9, 9, 9, 9, 5])
    assert hit.num_tokens == 0
    assert mgr.get_block_table("b") == [2, 3]
    assert mgr.pool.blocks[2].block_hash is None  # 42 stays mapped to block 0
    hit = mgr.lookup([1, 2, 3, 4, 6], hashes_of([1, 2, 3, 4, 6]))
    assert [b.block_id for b in hit.blocks] == [0]


def test_fork_shares_every_block_and_first_writer_copies() -> None:
    mgr = make(8)
    admit(mgr, "a", list(range(6)))  # [0 full][1 partial: 2 tokens]
    mgr.fork("a", "b")
    mgr.fork("a", "c")
    assert mgr.get_block_table("b") == mgr.get_block_table("c") == [0, 1]
    assert refs(mgr)[:2] == [3, 3]
    assert mgr.append_slots("b", 6, 1) == [(1, 2)]
    assert mgr.get_block_table("b") == [0, 2]
    assert mgr.append_slots("c", 6, 1) == [(1, 3)]
    assert mgr.append_slots("a", 6, 1) == []  # the last holder keeps the original
    assert mgr.get_block_table("a") == [0, 1]
    assert refs(mgr)[:4] == [3, 1, 1, 1]
    assert mgr.stats()["cow_copies"] == 2


def test_fork_at_a_block_boundary_needs_no_copy() -> None:
    mgr = make(8)
    admit(mgr, "a", list(range(8)))
    mgr.fork("a", "b")
    assert mgr.append_slots("a", 8, 1) == []
    assert mgr.append_slots("b", 8, 1) == []
    assert mgr.get_block_table("a") == [0, 1, 2] and mgr.get_block_table("b") == [0, 1, 3]


def test_copy_that_does_not_fit_changes_nothing() -> None:
    mgr = make(2)
    admit(mgr, "a", [1, 2])
    mgr.fork("a", "b")
    admit(mgr, "x", [7])
    before = snapshot(mgr, ["a", "b", "x"])
    assert mgr.append_slots("a", 2, 1) is None
    assert snapshot(mgr, ["a", "b", "x"]) == before


def test_next_turn_hits_the_generated_answer() -> None:
    mgr = make(8)
    tokens = list(range(6))
    hs = hashes_of(tokens)
    admit(mgr, "t1", tokens)
    for tok in range(100, 106):
        mgr.append_slots("t1", len(tokens), 1)
        tokens.append(tok)
        extend_block_hashes(tokens, BS, (), hs)
        mgr.cache_full_blocks("t1", tokens, hs, len(tokens))
    mgr.free("t1")
    hit, _ = admit(mgr, "t2", tokens + [7, 7, 7])
    assert hit.num_tokens == 12


def test_counters() -> None:
    mgr = make(4)
    admit(mgr, "a", list(range(9)))
    admit(mgr, "b", list(range(9)))
    _, copies = admit(mgr, "c", list(range(9)))  # fails: counts nothing
    assert copies is None
    stats = mgr.stats()
    assert stats == {
        "prefix_cache_queries": 18,
        "prefix_cache_hits": 8,
        "hit_rate": 8 / 18,
        "num_blocks": 4,
        "free_blocks": 0,
        "cached_blocks": 0,
        "used_blocks": 4,
        "evictions": 0,
        "cow_copies": 0,
        "tail_hits": 0,
        "tail_hit_tokens": 0,
        "tail_blocks": 0,
        "retained_cached_blocks": 0,
        "tier_loaded_blocks": 0,
        "tier_load_failures": 0,
    }
    assert make(3).stats()["hit_rate"] == 0.0


def test_caching_disabled() -> None:
    mgr = make(4, enable_prefix_caching=False)
    admit(mgr, "a", list(range(8)))
    hit = mgr.lookup(list(range(9)), hashes_of(list(range(9))))
    assert hit.blocks == [] and hit.num_query_tokens == 9
    mgr.free("a")
    assert mgr.stats()["free_blocks"] == 4 and mgr.stats()["cached_blocks"] == 0


def test_internal_misuse_asserts_bad_configuration_raises() -> None:
    """Only the engine calls the manager: its misuse is a bug (AssertionError), not a 400."""
    mgr = make(4)
    mgr.free("nobody")
    with pytest.raises(AssertionError):
        mgr.get_block_table("nobody")
    with pytest.raises(AssertionError):
        mgr.append_slots("a", 4, 1)  # growth of a sequence never admitted
    admit(mgr, "a", [1])
    with pytest.raises(AssertionError):
        mgr.allocate_for_prompt("a", PrefixHit([], 0, 0), 1)  # admitted twice
    with pytest.raises(AssertionError):
        mgr.fork("a", "a")
    with pytest.raises(AssertionError):
        mgr.append_slots("a", -1, 1)
    with pytest.raises(InvalidArgumentError):
        KVCacheManager(4, 0)
    with pytest.raises(InvalidArgumentError):
        KVCacheManager(4, 4, watermark=1.0)


def test_segment_sources_are_blocks_a_finished_step_wrote() -> None:
    mgr = make(8)
    tokens = list(range(8))
    hs = hashes_of(tokens)
    admit(mgr, "a", tokens)  # registered in this step: its K/V is not written yet
    assert [mgr.segment_source()(h) for h in hs] == [None, None]
    mgr.commit_step()
    find = mgr.segment_source()
    assert [find(h).block_id for h in hs] == mgr.get_block_table("a")[:2]
    assert find(hashes_of([9, 9, 9, 9])[0]) is None  # a hash the pool does not hold
