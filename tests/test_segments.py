"""The segment index and planner (``prefixserve.kv.segments``) over a plain-Python block pool:
what gets indexed, what a lookup accepts (blocks in the pool holding the segment's tokens, the
same tenant), the recompute share, stale entries, the bound, and the slots a span copies."""

from __future__ import annotations

import math

import pytest

from prefixserve.kv.block_pool import BlockPool
from prefixserve.kv.hashing import extend_block_hashes
from prefixserve.kv.segments import SegmentReuse

BS = 4
NL = 1
SALT = ("tenant-a",)


def doc(tag: int, n: int = 11) -> list[int]:
    """A document: ``n`` tokens then the break token."""
    return [100 * tag + i for i in range(n)] + [NL]


def computed(pool: BlockPool, tokens: list[int], keys=SALT) -> list[int]:
    """Register ``tokens``' full blocks in ``pool`` as a finished prefill would; their hashes."""
    hashes: list[int] = []
    extend_block_hashes(tokens, BS, keys, hashes)
    blocks = pool.allocate(len(hashes))
    for i, (block, h) in enumerate(zip(blocks, hashes)):
        pool.cache_block(block, h, tokens[i * BS : (i + 1) * BS], hashes[i - 1] if i else None)
    pool.free(reversed(blocks))
    return hashes


def setup(ratio_tokens=None):
    pool = BlockPool(64)
    seg = SegmentReuse(BS, frozenset({NL}), min_tokens=8, max_tokens=100)
    first = [7, 7, NL] + doc(1) + doc(2) + [9, 9, 9]  # template, A, B, question
    hashes = computed(pool, first)
    seg.record(first, hashes, len(first), SALT)
    return pool, seg, first


def test_a_document_found_in_another_order_and_place_is_a_span():
    pool, seg, first = setup()
    assert len(seg) == 2  # A and B; the template and the question are too short
    second = [7, 7, NL] + doc(3) + doc(2) + doc(1) + [8]
    plan = seg.plan(second, 3, len(second) - 1, SALT, 0.25, pool.hashed_block)
    assert plan.lookups == 3 and plan.hits == 2
    b, a = plan.spans  # B then A, in prompt order
    skip = math.ceil(0.25 * 12)
    assert (b.start, b.end, b.src_start) == (15 + skip, 27, 15 + skip)  # B sat at 15 before
    assert (a.start, a.end, a.src_start) == (27 + skip, 39, 3 + skip)
    assert plan.num_reused_tokens == 2 * (12 - skip)
    slots = a.src_slots(BS)
    assert len(slots) == 12 - skip
    for i, slot in enumerate(slots):  # each slot holds the token it claims
        pos = 3 + skip + i
        block = pool.hashed_block(pool_hash(first, pos))
        assert slot == block.block_id * BS + pos % BS and block.token_ids[pos % BS] == first[pos]
    assert seg.hits == 0  # counted once admitted
    seg.admitted(plan)
    assert (seg.lookups, seg.hits, seg.reused_tokens) == (3, 2, 2 * (12 - skip))


def pool_hash(tokens: list[int], pos: int) -> int:
    hashes: list[int] = []
    extend_block_hashes(tokens, BS, SALT, hashes)
    return hashes[pos // BS]


def test_another_tenant_or_salt_finds_nothing():
    pool, seg, _ = setup()
    second = [5, NL] + doc(2) + [8]
    assert seg.plan(second, 0, len(second) - 1, ("tenant-b",), 0.0, pool.hashed_block).hits == 0
    assert seg.plan(second, 0, len(second) - 1, (), 0.0, pool.hashed_block).hits == 0
    assert seg.plan(second, 0, len(second) - 1, SALT, 0.0, pool.hashed_block).hits == 1


@pytest.mark.parametrize("ratio, spans", [(0.0, 1), (0.5, 1), (1.0, 0)])
def test_the_recompute_share_leaves_the_first_tokens_to_compute(ratio, spans):
    pool, seg, _ = setup()
    second = [5, NL] + doc(1) + [8]
    plan = seg.plan(second, 0, len(second) - 1, SALT, ratio, pool.hashed_block)
    assert plan.hits == 1 and len(plan.spans) == spans  # 100%: found, nothing reused
    if spans:
        assert plan.spans[0].start == 2 + math.ceil(ratio * 12)


def test_an_entry_whose_blocks_left_the_pool_or_are_not_ready_is_dropped():
    pool, seg, first = setup()
    second = [5, NL] + doc(2) + [8]
    h = pool_hash(first, 20)  # a block of B
    assert seg.plan(second, 0, len(second) - 1, SALT, 0.0, lambda x: None if x == h
                    else pool.hashed_block(x)).hits == 0  # fmt: skip
    assert len(seg) == 1  # B's entry is gone; A's stays
    assert seg.plan(second, 0, len(second) - 1, SALT, 0.0, pool.hashed_block).hits == 0


def test_a_block_holding_other_tokens_is_no_hit():
    pool, seg, first = setup()
    block = pool.hashed_block(pool_hash(first, 16))
    block.token_ids = (0, 0, 0, 0)  # as if a collision put other tokens under that hash
    second = [5, NL] + doc(2) + [8]
    assert seg.plan(second, 0, len(second) - 1, SALT, 0.0, pool.hashed_block).hits == 0


def test_only_segments_in_full_blocks_are_indexed_and_the_index_is_bounded():
    pool = BlockPool(64)
    seg = SegmentReuse(BS, frozenset({NL}), max_entries=2, min_tokens=8, max_tokens=100)
    tokens = doc(1) + doc(2) + doc(3, n=6)  # the last piece ends in a partial block
    hashes = computed(pool, tokens)
    seg.record(tokens, hashes, len(tokens), SALT)
    assert len(seg) == 2
    seg.record(doc(4) + doc(5), computed(pool, doc(4) + doc(5)), 24, SALT)
    assert len(seg) == 2  # least recently recorded first out
    probe = [5, NL] + doc(1) + [8]
    assert seg.plan(probe, 0, len(probe) - 1, SALT, 0.0, pool.hashed_block).hits == 0
    probe = [5, NL] + doc(5) + [8]
    assert seg.plan(probe, 0, len(probe) - 1, SALT, 0.0, pool.hashed_block).hits == 1


def test_a_segment_indexed_already_keeps_its_entry():
    """A later prompt holding the same segment does not replace a working entry (its own blocks
    may never be registered: the request may be aborted, or reuse K/V just before them)."""
    pool, seg, _ = setup()
    other = [5, 5, NL] + doc(1) + [3] * 4
    seg.record(other, [7] * (len(other) // BS), len(other), SALT)  # hashes nobody registered
    probe = [6, NL] + doc(1) + [8]
    assert seg.plan(probe, 0, len(probe) - 1, SALT, 0.0, pool.hashed_block).hits == 1
