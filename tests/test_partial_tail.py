"""Partial tails (``prefixserve.kv.partial_tail``): the KV layer's decisions one by one.

Which tail a finished sequence leaves, which one a lookup finds and how many of its tokens count,
the copy and the pin at admission, eviction, the antichain under one key, a failed step, and
prefix caching off; and the scheduler's side of it. Block size 4 throughout.
"""

from __future__ import annotations

from test_scheduler import make_request, make_scheduler, sample_all, scheduled, waiting_ids

from prefixserve.kv.block_pool import BlockPool
from prefixserve.kv.hashing import extend_block_hashes
from prefixserve.kv.kv_cache_manager import KVCacheManager
from prefixserve.kv.partial_tail import common_prefix_len, tail_key

BS = 4
EXTRA = (None, None)


def hashes_of(tokens: list[int], extra: tuple = EXTRA) -> list[int]:
    out: list[int] = []
    extend_block_hashes(tokens, BS, extra, out)
    return out


def make(num_blocks: int = 8, **kw: object) -> KVCacheManager:
    kw.setdefault("watermark", 0.0)
    return KVCacheManager(num_blocks, BS, **kw)  # type: ignore[arg-type]


def run(mgr: KVCacheManager, sid: str, tokens: list[int], extra: tuple = EXTRA):
    """Admit ``tokens`` (tail lookups on), 'run' them, commit the step; the hit and copies."""
    hs = hashes_of(tokens, extra)
    hit = mgr.lookup(tokens, hs, extra)
    copies: list[tuple[int, int]] = []
    assert mgr.allocate_for_prompt(sid, hit, len(tokens) - hit.num_tokens, copies)
    mgr.cache_full_blocks(sid, tokens, hs, len(tokens))
    mgr.commit_step()
    return hit, copies


def finish(mgr: KVCacheManager, sid: str, tokens: list[int], num_computed: int | None = None,
           extra: tuple = EXTRA) -> None:  # fmt: skip
    n = len(tokens) if num_computed is None else num_computed
    mgr.free_keeping_tail(sid, tokens, hashes_of(tokens, extra), n, extra)


def tails(mgr: KVCacheManager) -> dict[int, tuple[int, ...]]:
    return {b.block_id: b.token_ids for b in mgr.pool.tail_blocks()}  # type: ignore[misc]


def test_a_finished_sequence_leaves_its_computed_partial_block_as_a_tail() -> None:
    mgr = make()
    prompt = list(range(10))
    run(mgr, "a", prompt)
    assert mgr.get_block_table("a") == [0, 1, 2]
    finish(mgr, "a", prompt)
    assert tails(mgr) == {2: (8, 9)}
    tail = mgr.pool.blocks[2]
    assert tail.tail_key == hashes_of(prompt)[1] and tail.block_hash is None
    assert mgr.pool.lru_block_ids()[0] == 2  # evicted before its own chain
    assert mgr.stats()["tail_blocks"] == 1 and mgr.pool.num_free_blocks == 5


def test_continuation_hits_the_tail_and_copies_it_into_a_fresh_block() -> None:
    mgr = make()
    prev = list(range(10))
    run(mgr, "a", prev)
    finish(mgr, "a", prev)
    hs = hashes_of(prev + [50, 51])
    hit = mgr.lookup(prev + [50, 51], hs, EXTRA)
    assert [b.block_id for b in hit.blocks] == [0, 1] and hit.num_tokens == 10
    assert hit.tail is mgr.pool.blocks[2] and hit.num_tail_tokens == 2
    copies: list[tuple[int, int]] = []
    assert mgr.allocate_for_prompt("b", hit, 2, copies)
    table = mgr.get_block_table("b")
    assert table[:2] == [0, 1] and copies == [(2, table[2])] and table[2] != 2
    assert mgr.pool.blocks[2].ref_cnt == 1 and 2 not in mgr.pool.lru_block_ids()  # pinned
    mgr.commit_step()
    assert mgr.pool.blocks[2].ref_cnt == 0 and mgr.pool.lru_block_ids()[-1] == 2  # unpinned
    assert tails(mgr) == {2: (8, 9)}  # still there for the next request
    stats = mgr.stats()
    assert (stats["tail_hits"], stats["tail_hit_tokens"], stats["prefix_cache_hits"]) == (1, 2, 10)


def test_only_the_shared_start_of_a_tail_counts() -> None:
    mgr = make()
    prev = list(range(11))  # tail (8, 9, 10)
    run(mgr, "a", prev)
    finish(mgr, "a", prev)
    assert mgr.lookup(prev[:9] + [77, 78], hashes_of(prev[:9] + [77, 78]), EXTRA).num_tokens == 9
    miss = mgr.lookup(prev[:8] + [77, 78], hashes_of(prev[:8] + [77, 78]), EXTRA)
    assert miss.num_tokens == 8 and miss.tail is None


def test_a_tail_longer_than_the_rest_of_the_prompt_leaves_one_token_to_compute() -> None:
    mgr = make()
    prev = list(range(11))
    run(mgr, "a", prev)
    finish(mgr, "a", prev)
    for n, cached in [(11, 10), (10, 9), (9, 8)]:
        hit = mgr.lookup(prev[:n], hashes_of(prev[:n]), EXTRA)
        assert hit.num_tokens == cached < n
    hit = mgr.lookup(prev[:10], hashes_of(prev[:10]), EXTRA)
    copies: list[tuple[int, int]] = []
    assert mgr.allocate_for_prompt("b", hit, 1, copies) and len(copies) == 1


def test_no_tail_without_extra_keys_or_under_other_extra_keys() -> None:
    mgr = make()
    prev = [5, 6, 7]  # no full block: the key is the extra keys' root
    run(mgr, "a", prev, ("tenant-a", None))
    finish(mgr, "a", prev, extra=("tenant-a", None))
    assert mgr.pool.blocks[0].tail_key == tail_key(None, ("tenant-a", None))
    query = prev + [8]
    assert mgr.lookup(query, [], ("tenant-a", None)).num_tokens == 3
    assert mgr.lookup(query, [], ("tenant-b", None)).num_tokens == 0
    assert mgr.lookup(query, []).num_tokens == 0  # prompt_logprobs, beams: no tail lookup


def test_only_computed_tokens_go_into_a_tail() -> None:
    """Slots past ``num_computed_tokens`` (rejected drafts, the last sampled token) are left out."""
    mgr = make()
    tokens = list(range(6))
    run(mgr, "a", tokens)
    assert mgr.append_slots("a", 6, 4) == []  # a token and 3 drafts: slots up to 9
    finish(mgr, "a", tokens + [60, 61, 62, 63], num_computed=7)
    assert tails(mgr) == {1: (4, 5, 60)}


def test_no_tail_for_a_shared_block_or_a_block_boundary_or_caching_off() -> None:
    mgr = make()
    run(mgr, "a", list(range(6)))
    mgr.fork("a", "b")
    finish(mgr, "a", list(range(6)))  # "b" still holds (and will write) block 1
    assert tails(mgr) == {}
    finish(mgr, "b", list(range(6)))  # the last holder keeps it
    assert tails(mgr) == {1: (4, 5)}
    run(mgr, "c", list(range(100, 108)))
    finish(mgr, "c", list(range(100, 108)))  # 8 tokens: no partial block
    assert len(tails(mgr)) == 1
    off = make(enable_prefix_caching=False)
    run(off, "a", list(range(6)))
    finish(off, "a", list(range(6)))
    assert tails(off) == {} and off.pool.num_free_blocks == 8
    assert off.lookup(list(range(7)), [], EXTRA).num_tokens == 0


def test_tails_under_one_key_stay_an_antichain() -> None:
    mgr = make()
    base = list(range(4))
    for sid, tail in [("a", [9]), ("b", [9, 8]), ("c", [9]), ("d", [7, 7])]:
        run(mgr, sid, base + tail)
        finish(mgr, sid, base + tail)
    # (9,) was replaced by (9, 8), the second (9,) added nothing, (7, 7) diverges
    assert sorted(tails(mgr).values()) == [(7, 7), (9, 8)]
    pool = mgr.pool
    assert pool.num_free_blocks + pool.num_cached_blocks + pool.num_used_blocks == 8
    assert pool.num_cached_blocks == 3  # the base block and the two tails
    hit = mgr.lookup(base + [9, 8, 1], hashes_of(base + [9, 8, 1]), EXTRA)
    assert hit.tail is not None and hit.tail.token_ids == (9, 8) and hit.num_tokens == 6


def test_eviction_under_pressure_takes_the_tail_first() -> None:
    mgr = make(4)
    prev = list(range(6))
    run(mgr, "a", prev)
    finish(mgr, "a", prev)
    assert mgr.pool.lru_block_ids() == [1, 0]
    run(mgr, "p", list(range(100, 109)))  # needs 3 blocks: 2 free, then the LRU head
    assert tails(mgr) == {} and mgr.stats()["evictions"] == 1
    assert mgr.lookup(prev + [1], hashes_of(prev + [1]), EXTRA).num_tokens == 4  # chain kept


def test_a_pinned_tail_is_not_evicted_before_its_copy_ran() -> None:
    mgr = make(4)
    prev = list(range(6))
    run(mgr, "a", prev)
    finish(mgr, "a", prev)
    hit = mgr.lookup(prev + [1], hashes_of(prev + [1]), EXTRA)
    copies: list[tuple[int, int]] = []
    assert mgr.allocate_for_prompt("b", hit, 1, copies)  # block 0 hit, tail 1 pinned, 2 fresh
    assert mgr.pool.num_available_blocks == 1
    assert not mgr.allocate_for_prompt("c", mgr.lookup([9] * 8, []), 8)  # 2 > 1 left
    mgr.commit_step()
    assert mgr.pool.num_available_blocks == 2


def test_failed_admissions_and_failed_steps() -> None:
    mgr = make(4)
    prev = list(range(6))
    run(mgr, "a", prev)
    finish(mgr, "a", prev)
    hit = mgr.lookup(prev + [1] * 11, hashes_of(prev + [1] * 11), EXTRA)
    copies: list[tuple[int, int]] = []
    assert not mgr.allocate_for_prompt("b", hit, 11, copies)  # 5 blocks: does not fit
    assert copies == [] and mgr.pool.blocks[1].ref_cnt == 0 and mgr.stats()["tail_hits"] == 0
    hit = mgr.lookup(prev + [1], hashes_of(prev + [1]), EXTRA)
    assert mgr.allocate_for_prompt("b", hit, 1, copies)
    mgr.discard_step()  # the forward failed: the copy may not have run, the tail is intact
    mgr.free("b")  # Scheduler.abandon_step requeues with a plain free
    assert tails(mgr) == {1: (4, 5)} and mgr.pool.num_used_blocks == 0
    hit = mgr.lookup(prev + [1], hashes_of(prev + [1]), EXTRA)
    assert mgr.allocate_for_prompt("c", hit, 1, copies)
    mgr.free("c")  # a rolled-back admission unpins at once
    assert mgr.pool.num_used_blocks == 0 and mgr.pool.blocks[1].ref_cnt == 0


def test_a_tail_replaced_while_pinned_becomes_free_when_unpinned() -> None:
    mgr = make()
    prev = list(range(6))
    run(mgr, "a", prev)
    finish(mgr, "a", prev)
    hit = mgr.lookup(prev + [7], hashes_of(prev + [7]), EXTRA)
    copies: list[tuple[int, int]] = []
    assert mgr.allocate_for_prompt("b", hit, 1, copies)
    finish(mgr, "b", prev + [7])  # (4, 5, 7) replaces the pinned (4, 5)
    assert list(tails(mgr).values()) == [(4, 5, 7)]
    mgr.commit_step()
    pool = mgr.pool
    assert pool.blocks[1].ref_cnt == 0 and not pool.blocks[1].is_tail
    assert pool.num_free_blocks + pool.num_cached_blocks == 8 and pool.num_used_blocks == 0


def test_reset_drops_tails_and_helpers() -> None:
    mgr = make()
    run(mgr, "a", list(range(6)))
    finish(mgr, "a", list(range(6)))
    assert mgr.reset_prefix_cache() and tails(mgr) == {} and mgr.pool.num_free_blocks == 8
    assert common_prefix_len((1, 2, 3), [1, 2, 4]) == 2 and common_prefix_len(None, [1]) == 0
    assert tail_key(None, ()) != tail_key(None, ("s",)) and tail_key(123, ("s",)) == 123
    pool = BlockPool(2, enable_caching=False)
    (block,) = pool.allocate(1)
    assert not pool.cache_tail(block, 1, (1,))


# ---- the scheduler's side: the copy joins the step, preemption keeps nothing, abort keeps it ----


def _finish(sched, out) -> None:
    while not out.is_empty:
        sample_all(sched, out)
        out = sched.schedule()


def test_admission_puts_the_tail_copy_in_the_step() -> None:
    sched = make_scheduler(32)
    sched.add_request(make_request("a", list(range(5)), max_tokens=3))
    _finish(sched, sched.schedule())  # 5 + 3 tokens, 7 computed: tail (4, 7, 7) in block 1
    (tail,) = sched.kv.pool.tail_blocks()
    assert tail.token_ids == (4, 7, 7)
    sched.add_request(make_request("b", [*range(5), 7, 7, 7, 9]))
    out = sched.schedule()
    assert scheduled(out) == [("b", 2)]  # the last output token and the new one
    table = out.block_tables[out.scheduled[0].seq.seq_id]
    assert out.block_copies == [(tail.block_id, table[1])]
    assert sched.requests["b"].num_cached_tokens == 7
    sample_all(sched, out)
    assert tail.ref_cnt == 0 and sched.kv.stats()["tail_hits"] == 1  # unpinned by the commit


def test_an_admission_that_does_not_fit_adds_no_copy() -> None:
    sched = make_scheduler(4)
    sched.add_request(make_request("a", list(range(5)), max_tokens=3))
    _finish(sched, sched.schedule())
    sched.add_request(make_request("b", [*range(5), 7, 7, 7, *range(20, 29)]))  # 5 blocks
    out = sched.schedule()
    assert out.is_empty and out.block_copies == [] and waiting_ids(sched) == ["b"]
    assert sched.kv.pool.num_used_blocks == 0 and sched.kv.stats()["tail_hits"] == 0


def test_a_tail_that_would_cost_the_last_block_is_taken_in_place() -> None:
    """4 blocks, the prompt needs all of them: pinning the tail for a copy would need a fifth, so
    the tail block itself becomes the prompt's second block (no copy, no longer a tail)."""
    sched = make_scheduler(4)
    sched.add_request(make_request("a", list(range(5)), max_tokens=3))
    _finish(sched, sched.schedule())
    (tail,) = sched.kv.pool.tail_blocks()
    sched.add_request(make_request("b", [*range(5), 7, 7, 7, *range(20, 28)]))  # 4 blocks
    out = sched.schedule()
    assert scheduled(out) == [("b", 9)] and out.block_copies == []
    assert out.block_tables[out.scheduled[0].seq.seq_id][1] == tail.block_id
    assert not tail.is_tail and tail.ref_cnt == 1 and sched.kv.pool.num_tail_blocks == 0
    assert sched.requests["b"].num_cached_tokens == 7 and sched.kv.stats()["tail_hits"] == 1


def test_preemption_keeps_no_tail_but_an_abort_does() -> None:
    sched = make_scheduler(7)
    sched.add_request(make_request("a", list(range(8))))  # 2 blocks
    sched.add_request(make_request("b", list(range(10, 18))))  # 2 blocks
    sched.add_request(make_request("c", list(range(20, 31))))  # 3 blocks: the pool is full
    sample_all(sched, sched.schedule())
    sample_all(sched, sched.schedule())  # a and b need a third block: c is preempted
    assert sched.stats().num_preemptions == 1 and waiting_ids(sched) == ["c"]
    assert sched.kv.pool.num_tail_blocks == 0  # c's 11 computed tokens leave full blocks only
    sched.abort_request("a")  # 9 computed: its first sampled token stays as a tail
    assert [t.token_ids for t in sched.kv.pool.tail_blocks()] == [(7,)]
