"""The Responses store's decisions: LRU order, entry/byte/age bounds, tenant isolation."""

from __future__ import annotations

from array import array

import pytest
from prefixserve.api.responses_store import ResponseStore, StoredResponse, tenant_of

from prefixserve.errors import InvalidArgumentError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def entry(text: str = "x", tokens: int = 0) -> StoredResponse:
    return StoredResponse(response={"id": "r"}, items=[], output_items=[], prompt_text=text,
                          prompt_token_ids=array("i", range(tokens)))  # fmt: skip


def test_least_recently_used_goes_first():
    store = ResponseStore(max_entries=2)
    store.put("t", "a", entry())
    store.put("t", "b", entry())
    assert store.get("t", "a") is not None  # a is now the most recent
    store.put("t", "c", entry())
    assert store.get("t", "b") is None
    assert store.get("t", "a") is not None and store.get("t", "c") is not None
    assert len(store) == 2 and store.evictions == 1


def test_bytes_bound_counts_text_and_token_ids():
    small = entry("x" * 100)
    one = small.measure()
    assert entry("x" * 100, tokens=10).measure() == one + 40  # 4 bytes per token id
    store = ResponseStore(max_bytes=2 * one + 10)
    for name in "abc":
        store.put("t", name, entry("x" * 100))
    assert [store.get("t", n) is not None for n in "abc"] == [False, True, True]
    assert store.nbytes == 2 * one and store.evictions == 1
    store.put("t", "huge", entry("x" * 10_000))  # larger than the whole store: not kept
    assert store.get("t", "huge") is None and len(store) == 2 and store.evictions == 2


def test_age_bound():
    clock = Clock()
    store = ResponseStore(max_age_s=10, clock=clock)
    store.put("t", "old", entry())
    clock.now = 5
    store.put("t", "new", entry())
    clock.now = 11
    assert store.get("t", "old") is None and store.evictions == 1
    assert store.get("t", "new") is not None
    clock.now = 16
    store.put("t", "newest", entry())  # a put sweeps expired entries from the LRU end
    assert len(store) == 1 and store.evictions == 2


def test_tenants_are_isolated_and_delete_is_not_an_eviction():
    store = ResponseStore()
    alice, bob = tenant_of("Bearer a", None), tenant_of("Bearer b", None)
    assert tenant_of("Bearer a", "salt") not in (alice, bob)
    store.put(alice, "r1", entry())
    assert store.get(bob, "r1") is None
    assert not store.delete(bob, "r1") and store.get(alice, "r1") is not None
    assert store.delete(alice, "r1") and store.get(alice, "r1") is None
    assert store.evictions == 0 and store.nbytes == 0


def test_replacing_an_id_keeps_byte_count_exact():
    store = ResponseStore()
    store.put("t", "a", entry("x" * 10))
    store.put("t", "a", entry("x" * 20))
    assert len(store) == 1 and store.nbytes == entry("x" * 20).measure()


@pytest.mark.parametrize("name", ["max_entries", "max_bytes", "max_age_s"])
def test_limits_must_be_positive(name):
    with pytest.raises(InvalidArgumentError, match=name):
        ResponseStore(**{name: 0})
