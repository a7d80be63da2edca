"""BlockPool: ids handed out, ref counts, LRU eviction, the hash map, reset."""

from __future__ import annotations

import pytest

from prefixserve.core.errors import InvalidArgumentError
from prefixserve.kv.block_pool import BlockPool, KVBlock


def counts(pool: BlockPool) -> tuple[int, int, int]:
    return pool.num_free_blocks, pool.num_cached_blocks, pool.num_used_blocks


def cached_and_freed(num_blocks: int) -> tuple[BlockPool, list[KVBlock]]:
    """A pool whose every block is cached (hash ``id + 1``, tokens ``[id]``) and then freed, so
    the LRU holds them in id order."""
    pool = BlockPool(num_blocks)
    blocks = pool.allocate(num_blocks)
    for b in blocks:
        pool.cache_block(b, b.block_id + 1, [b.block_id])
    pool.free(blocks)
    return pool, blocks


def test_ids_are_handed_out_in_order() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert counts(pool) == (1, 0, 3)


def test_freed_unhashed_blocks_queue_behind_never_used_ones() -> None:
    pool = BlockPool(4)
    b0, b1 = pool.allocate(2)
    pool.free([b1, b0])
    assert [b.block_id for b in pool.allocate(4)] == [2, 3, 1, 0]


def test_free_hashed_block_becomes_cached_not_free() -> None:
    pool = BlockPool(3)
    (b0,) = pool.allocate(1)
    assert pool.cache_block(b0, 111, (1, 2))
    pool.free([b0])
    assert counts(pool) == (2, 1, 0)
    assert b0.block_hash == 111 and pool.is_evictable(b0)


def test_get_cached_block_compares_tokens() -> None:
    pool = BlockPool(2)
    (b0,) = pool.allocate(1)
    pool.cache_block(b0, 7, [1, 2])
    assert pool.get_cached_block(7, [1, 2]) is b0
    assert pool.get_cached_block(7, (1, 2)) is b0
    assert pool.get_cached_block(7, [1, 3]) is None
    assert pool.get_cached_block(8, [1, 2]) is None


def test_cache_block_keeps_the_existing_mapping() -> None:
    pool = BlockPool(2)
    b0, b1 = pool.allocate(2)
    assert pool.cache_block(b0, 7, [1, 2])
    assert not pool.cache_block(b1, 7, [1, 2])
    assert b1.block_hash is None and b1.token_ids is None
    assert pool.hashed_blocks() == {7: b0}
    pool.free([b1, b0])
    assert counts(pool) == (1, 1, 0)


def test_unhashed_blocks_are_used_before_any_eviction() -> None:
    pool = BlockPool(3)
    b0, b1, b2 = pool.allocate(3)
    pool.cache_block(b0, 10, [0])
    pool.free([b0, b1, b2])
    assert [b.block_id for b in pool.allocate(2)] == [1, 2]
    assert pool.evictions == 0
    assert pool.get_cached_block(10, [0]) is b0


def test_lru_evicts_in_free_order_and_unregisters() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for b in blocks:
        pool.cache_block(b, 100 + b.block_id, [b.block_id])
    pool.free([blocks[2], blocks[0], blocks[1]])
    assert pool.lru_block_ids() == [2, 0, 1]
    (got,) = pool.allocate(1)
    assert got.block_id == 2 and got.block_hash is None and got.token_ids is None
    assert got.ref_cnt == 1
    assert pool.evictions == 1
    assert 102 not in pool.hashed_blocks()
    assert pool.get_cached_block(102, [2]) is None
    assert pool.lru_block_ids() == [0, 1]


def test_touch_takes_a_hit_out_of_the_lru() -> None:
    pool, (b0, b1) = cached_and_freed(2)
    pool.touch([b0])
    assert b0.ref_cnt == 1 and not pool.is_evictable(b0)
    assert pool.lru_block_ids() == [1]
    pool.touch([b0])
    assert b0.ref_cnt == 2
    (got,) = pool.allocate(1)
    assert got is b1
    assert counts(pool) == (0, 0, 2)


def test_refree_moves_block_to_mru_end() -> None:
    pool, (b0, _) = cached_and_freed(2)
    pool.touch([b0])
    pool.free([b0])
    assert pool.lru_block_ids() == [1, 0]


def test_copy_on_write_counts_and_keeps_the_original() -> None:
    pool = BlockPool(3)
    (b0,) = pool.allocate(1)
    pool.touch([b0])
    fresh = pool.copy_on_write(b0)
    assert fresh.block_id == 1 and fresh.ref_cnt == 1
    assert b0.ref_cnt == 1
    assert pool.cow_copies == 1


def test_reset_refused_while_in_use_then_drops_every_hash() -> None:
    pool = BlockPool(3)
    b0, b1 = pool.allocate(2)
    pool.cache_block(b0, 5, [0])
    pool.free([b1])
    assert not pool.reset_prefix_cache()
    assert pool.hashed_blocks() == {5: b0}
    pool.free([b0])
    assert pool.reset_prefix_cache()
    assert pool.hashed_blocks() == {} and b0.block_hash is None
    assert counts(pool) == (3, 0, 0)
    assert [b.block_id for b in pool.allocate(3)] == [0, 1, 2]


def test_caching_disabled_never_registers() -> None:
    pool = BlockPool(2, enable_caching=False)
    (b0,) = pool.allocate(1)
    assert not pool.cache_block(b0, 5, [0])
    pool.free([b0])
    assert counts(pool) == (2, 0, 0)


def test_num_blocks_must_be_positive() -> None:
    with pytest.raises(InvalidArgumentError):
        BlockPool(0)
