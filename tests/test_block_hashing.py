"""Chained block hashes: determinism, chaining, extra keys, incremental extension."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixserve.core.errors import InvalidArgumentError
from prefixserve.kv.hashing import extend_block_hashes, hash_block_tokens


def chain(token_ids: list[int], block_size: int, extra_keys: tuple = ()) -> list[int]:
    hashes: list[int] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


def test_hash_is_deterministic_128_bit_int() -> None:
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert h == hash_block_tokens(None, (1, 2, 3, 4))
    assert isinstance(h, int) and 0 <= h < 2**128


def test_hash_depends_on_parent_tokens_and_extra_keys() -> None:
    base = hash_block_tokens(None, [1, 2, 3, 4])
    assert hash_block_tokens(base, [1, 2, 3, 4]) != base
    assert hash_block_tokens(None, [1, 2, 3, 5]) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("tenant-a", None)) != base
    assert hash_block_tokens(None, [1, 2, 3, 4], ("tenant-a", None)) != hash_block_tokens(
        None, [1, 2, 3, 4], ("tenant-b", None)
    )
    assert hash_block_tokens(None, [1, 2, 3, 4], (None, 7)) != hash_block_tokens(
        None, [1, 2, 3, 4], (None, 8)
    )


def test_parent_zero_differs_from_no_parent() -> None:
    assert hash_block_tokens(0, [1, 2]) != hash_block_tokens(None, [1, 2])


def test_only_full_blocks_are_hashed() -> None:
    hashes: list[int] = []
    extend_block_hashes(list(range(10)), 4, (), hashes)
    assert hashes == chain(list(range(10)), 4)
    assert len(hashes) == 2


def test_extend_is_incremental_and_never_rehashes() -> None:
    tokens = list(range(7))
    hashes: list[int] = []
    extend_block_hashes(tokens, 4, ("s",), hashes)
    assert len(hashes) == 1
    first = hashes[0]
    tokens.append(7)
    extend_block_hashes(tokens, 4, ("s",), hashes)
    assert hashes[0] == first and len(hashes) == 2
    # A sentinel in the list proves earlier entries are read, not recomputed.
    hashes[1] = 12345
    tokens.extend(range(8, 12))
    extend_block_hashes(tokens, 4, ("s",), hashes)
    assert hashes[:2] == [first, 12345]
    assert hashes[2] == hash_block_tokens(12345, [8, 9, 10, 11], ("s",))


def test_extend_with_nothing_new_is_a_no_op() -> None:
    hashes: list[int] = []
    extend_block_hashes([1, 2, 3], 4, (), hashes)
    assert hashes == []


def test_block_size_must_be_positive() -> None:
    with pytest.raises(InvalidArgumentError):
        extend_block_hashes([1], 0, (), [])


@given(
    tokens=st.lists(st.integers(0, 2**40), max_size=60),
    block_size=st.integers(1, 8),
    cuts=st.lists(st.integers(0, 60), max_size=5),
)
def test_incremental_matches_one_shot(tokens: list[int], block_size: int, cuts: list[int]) -> None:
    hashes: list[int] = []
    for cut in sorted(cuts):
        extend_block_hashes(tokens[:cut], block_size, ("x", 1), hashes)
    extend_block_hashes(tokens, block_size, ("x", 1), hashes)
    assert hashes == chain(tokens, block_size, ("x", 1))
