"""The Responses store's decisions: records hold deltas (bytes grow with the conversation, not its
square), LRU order with whole chains, per-tenant and global bounds, namespaces, age, SQLite."""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from array import array

import pytest

from prefixserve.api.openai.responses.store import Record, ResponseStore
from prefixserve.core.errors import InvalidArgumentError


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(rid: str, parent: str | None = None, text: str = "x", owner: str = "t",
           namespace: str = "ns", persist: bool = False) -> Record:  # fmt: skip
    item = {"type": "message", "role": "user", "content": text}
    return Record(rid, namespace, owner, parent, {"id": rid}, [item], [], None, text,
                  array("i", range(3)), persist=persist)  # fmt: skip


def put(store: ResponseStore, *records: Record) -> list[bool]:
    """``store.put`` each record with its own items: whether each was kept."""

    async def each() -> list[bool]:
        return [await store.put(r, r.new_items) for r in records]

    return asyncio.run(each())


def test_a_long_conversation_holds_each_turn_once():
    """Issue 30: a 50-turn conversation of 100 kB counted 7.98 MB (every entry its whole chain)."""
    store = ResponseStore()
    parent = None
    for turn in range(50):
        put(store, record(f"r{turn}", parent, "y" * 2000))
        parent = f"r{turn}"
    assert 100_000 < store.nbytes < 2 * 100_000 + 50 * 200
    chain = store.chain("r49", ("ns",))
    assert [r.id for r in chain] == [f"r{i}" for i in range(50)]


def test_least_recently_used_chains_go_first_and_take_their_descendants():
    store = ResponseStore(max_entries=3)
    put(store, record("a"), record("a2", "a"), record("b"))
    assert store.chain("a2", ("ns",)) is not None  # refreshes a and a2
    put(store, record("c"))
    assert store.chain("b", ("ns",)) is None and store.evictions == 1
    put(store, record("d"), record("e"))  # a goes, and a2 with it
    assert store.chain("a2", ("ns",)) is None and len(store) == 3
    assert store.evictions == 3


def test_a_tenant_within_its_quota_keeps_its_records():
    store = ResponseStore(max_entries=4, tenant_max_entries=3)
    put(store, record("alice", owner="alice"))
    for i in range(5):  # bob fills his quota, then the store
        put(store, record(f"bob{i}", owner="bob"))
    assert store.chain("alice", ("ns",)) is not None
    assert store.owner_usage("bob")[0] == 3 and store.owner_usage("alice")[0] == 1
    store = ResponseStore(max_entries=3)  # global bound: the largest owner pays
    put(store, record("alice", owner="alice"), record("b1", owner="bob"), record("b2", owner="bob"))
    put(store, record("carol", owner="carol"))
    assert store.chain("alice", ("ns",)) is not None and store.chain("b1", ("ns",)) is None


def test_byte_bounds_and_a_record_larger_than_its_bound():
    one = record("x", text="z" * 100).measure()
    store = ResponseStore(max_bytes=2 * one + 10)
    for name in "abc":
        put(store, record(name, text="z" * 100))
    assert [store.chain(n, ("ns",)) is not None for n in "abc"] == [False, True, True]
    assert put(store, record("huge", text="z" * 10_000)) == [False]
    assert store.nbytes == 2 * one


def test_namespaces_isolate_and_delete_is_not_an_eviction():
    store = ResponseStore()
    put(store, record("r1", namespace="alice"))
    assert store.chain("r1", ("bob",)) is None and not asyncio.run(store.delete("r1", "bob"))
    assert store.chain("r1", ("bob", "alice")) is not None
    assert asyncio.run(store.delete("r1", "alice")) and store.chain("r1", ("alice",)) is None
    assert store.evictions == 0 and store.nbytes == 0


def test_a_parent_evicted_meanwhile_makes_the_record_a_root_with_all_its_items():
    store = ResponseStore()
    whole = [{"type": "message", "role": "user", "content": "everything"}]
    child = record("c", "gone")
    child.spliced = 5
    assert asyncio.run(store.put(child, whole))
    (root,) = store.chain("c", ("ns",))
    assert root.parent is None and root.spliced is None and root.new_items == whole


def test_age_bound():
    clock = Clock()
    store = ResponseStore(max_age_s=10, clock=clock)
    put(store, record("old"))
    clock.now += 5
    put(store, record("new"))
    clock.now += 6
    assert store.chain("old", ("ns",)) is None and store.evictions == 1
    assert store.chain("new", ("ns",)) is not None


def test_a_connection_release_keeps_what_stored_responses_continue():
    store = ResponseStore()
    put(store, record("w1", namespace="ws"), record("w2", "w1", namespace="ws"),
        record("s", "w1", namespace="tenant"))  # fmt: skip
    store.release("ws")
    assert store.chain("w2", ("ws",)) is None
    assert [r.id for r in store.chain("s", ("tenant",))] == ["w1", "s"]


def test_records_survive_a_restart_without_their_token_ids(tmp_path):
    path = str(tmp_path / "store.sqlite3")
    store = ResponseStore(path=path)
    put(store, record("a", persist=True), record("b", "a", persist=True), record("tmp"))
    put(store, record("gone", persist=True))
    assert asyncio.run(store.delete("gone", "ns"))
    store.close()
    with sqlite3.connect(path) as db:
        assert sorted(r for (r,) in db.execute("SELECT id FROM responses")) == ["a", "b"]
    again = ResponseStore(path=path)
    chain = again.chain("b", ("ns",))
    assert [r.id for r in chain] == ["a", "b"] and not chain[-1].prompt_known
    assert again.chain("tmp", ("ns",)) is None and len(again) == 2
    again.close()


def test_a_persisted_record_writes_its_ancestors(tmp_path):
    path = str(tmp_path / "store.sqlite3")
    store = ResponseStore(path=path)
    put(store, record("ws1", namespace="ws"), record("kept", "ws1", persist=True))
    store.close()
    again = ResponseStore(path=path)
    assert [r.id for r in again.chain("kept", ("ns",))] == ["ws1", "kept"]
    again.close()


@pytest.mark.parametrize("name", ["max_entries", "max_bytes", "max_age_s", "tenant_max_bytes"])
def test_limits_must_be_positive(name):
    with pytest.raises(InvalidArgumentError, match=name):
        ResponseStore(**{name: -1})


def test_a_continuation_after_a_restart_renders_again_over_http(tmp_path):
    """Issue 30: nothing survived a restart; every previous_response_id became a 404."""
    import httpx
    from servers import MODEL, server_process

    path = str(tmp_path / "responses.sqlite3")
    body = {"model": MODEL, "max_output_tokens": 3, "temperature": 0}
    with server_process("--responses-store-path", path) as (_, base):
        first = httpx.post(f"{base}/v1/responses", json={**body, "input": "hi"}, timeout=60).json()
        ephemeral = httpx.post(f"{base}/v1/responses", timeout=60,
                               json={**body, "input": "no", "store": False}).json()  # fmt: skip
    with server_process("--responses-store-path", path) as (_, base):
        assert httpx.get(f"{base}/v1/responses/{first['id']}").json()["output"] == first["output"]
        assert httpx.get(f"{base}/v1/responses/{ephemeral['id']}").status_code == 404
        r = httpx.post(f"{base}/v1/responses", timeout=60, json={
            **body, "input": "and then?", "previous_response_id": first["id"]})  # fmt: skip
        assert r.status_code == 200, r.text
        items = httpx.get(f"{base}/v1/responses/{r.json()['id']}/input_items?order=asc").json()
        assert [i.get("content") for i in items["data"]][-1][0]["text"] == "and then?"
        assert len(items["data"]) == 3  # hi, the first output, and then?


def test_the_entry_bound_evicts_from_the_owner_holding_the_most_records():
    """Issue 34.10: past ``max_entries`` the owner with the most bytes paid, not the most records."""
    store = ResponseStore(max_entries=10)
    put(store, *(record(f"b{i}", text="z" * 5000, owner="bob") for i in range(2)))
    put(store, *(record(f"a{i}", owner="alice") for i in range(9)))
    assert store.owner_usage("bob")[0] == 2 and store.owner_usage("alice")[0] == 8
    assert store.chain("a0", ("ns",)) is None and store.chain("b0", ("ns",)) is not None


def test_a_chain_whose_root_expired_is_gone_and_its_continuation_is_a_root():
    clock = Clock()
    store = ResponseStore(max_age_s=10, clock=clock)
    put(store, record("root"))
    clock.now += 8
    put(store, record("child", "root"))
    clock.now += 3
    assert store.chain("child", ("ns",)) is None and len(store) == 0
    whole = [{"type": "message", "role": "user", "content": "everything"}]
    assert asyncio.run(store.put(record("next", "child"), whole))
    assert store.chain("next", ("ns",))[0].new_items == whole


def test_put_and_delete_return_once_the_file_is_committed(tmp_path):
    """Issue 34.12: the write came after the reply; now ``put`` returns after SQLite's commit,
    and ``delete`` after its rows' (a record and its descendants) are deleted."""
    path = str(tmp_path / "store.sqlite3")
    store = ResponseStore(path=path)

    def rows() -> list[str]:
        with contextlib.closing(sqlite3.connect(path)) as db:
            return sorted(rid for (rid,) in db.execute("SELECT id FROM responses"))

    async def put_then_delete() -> tuple[list[str], list[str]]:
        await store.put(record("a", persist=True), [])
        await store.put(record("a2", "a", persist=True), [])
        written = rows()
        await store.delete("a", "ns")
        return written, rows()

    assert asyncio.run(put_then_delete()) == (["a", "a2"], [])
    store.close()


def test_rows_in_a_parent_cycle_are_orphans(tmp_path):
    path = str(tmp_path / "store.sqlite3")
    store = ResponseStore(path=path)
    put(store, record("root", persist=True))
    store.close()
    with sqlite3.connect(path) as db:
        for rid, parent in (("x", "y"), ("y", "x"), ("z", "missing")):
            db.execute("INSERT INTO responses VALUES (?, 'ns', 't', ?, 2e9, '[{}, [], []]')",
                       (rid, parent))  # fmt: skip
    again = ResponseStore(path=path)
    assert len(again) == 1 and again.skipped_rows == 0
    again.close()
    with sqlite3.connect(path) as db:
        assert [rid for (rid,) in db.execute("SELECT id FROM responses")] == ["root"]


class Spelling:
    """A tokenizer whose token ``i`` spells ``<i>``."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=True) -> str:
        return "".join(f"<{i}>" for i in ids)


def turn(rid: str, parent: str | None = None, spliced: int | None = None, text: str = "",
         ids: tuple[int, ...] = (), out: tuple[int, ...] = (), persist: bool = False) -> Record:  # fmt: skip
    """A record whose items and output name it: ``in:<rid>`` and ``out:<rid>``."""
    return Record(rid, "ns", "t", parent, {"id": rid, "status": "completed"},
                  [{"id": f"in:{rid}"}], [{"id": f"out:{rid}"}], spliced, text,
                  array("i", ids), array("i", out), persist=persist)  # fmt: skip


def test_a_conversation_is_rebuilt_from_its_deltas():
    """Items grow by the parent's output and the new items; a spliced prompt is the parent's
    prompt, the part of its output it kept (spelled by the tokenizer) and the delta; a
    re-rendered one (``spliced`` None) starts again from its own."""
    store = ResponseStore()
    put(store, turn("a", text="A", ids=(1, 2), out=(3, 4)),
        turn("b", "a", spliced=3, text="B", ids=(5,), out=(6,)),
        turn("c", "b", text="C", ids=(7,), out=(8,)))  # fmt: skip
    b = store.conversation("b", ("ns",), Spelling())
    assert b.response == {"id": "b", "status": "completed", "output": [{"id": "out:b"}]}
    assert [i["id"] for i in b.items] == ["in:a", "out:a", "in:b"]
    assert b.output_items == [{"id": "out:b"}]
    assert (b.prompt_text, list(b.prompt_token_ids)) == ("A<3>B", [1, 2, 3, 5])
    assert list(b.output_token_ids) == [6]
    c = store.conversation("c", ("ns",), Spelling())
    assert [i["id"] for i in c.items] == ["in:a", "out:a", "in:b", "out:b", "in:c"]
    assert (c.prompt_text, list(c.prompt_token_ids), list(c.output_token_ids)) == ("C", [7], [8])


def test_a_conversation_is_visible_in_its_namespaces_only():
    store = ResponseStore()
    put(store, turn("a", text="A"))
    assert store.conversation("a", ("other",), Spelling()) is None
    assert store.conversation("missing", ("ns",), Spelling()) is None
    assert store.conversation("a", ("other", "ns"), Spelling()).prompt_text == "A"


def test_after_a_restart_a_conversation_has_no_prompt_until_one_renders_again(tmp_path):
    path = str(tmp_path / "store.sqlite3")
    store = ResponseStore(path=path)
    put(store, turn("a", text="A", ids=(1,), out=(2,), persist=True),
        turn("b", "a", spliced=2, text="B", ids=(3,), out=(4,), persist=True))  # fmt: skip
    store.close()
    again = ResponseStore(path=path)
    b = again.conversation("b", ("ns",), Spelling())
    assert b.prompt_text is None and [i["id"] for i in b.items] == ["in:a", "out:a", "in:b"]
    put(again, turn("c", "b", text="C", ids=(5,), out=(6,)),
        turn("d", "c", spliced=2, text="D", ids=(7,)))  # fmt: skip
    d = again.conversation("d", ("ns",), Spelling())
    assert (d.prompt_text, list(d.prompt_token_ids)) == ("C<6>D", [5, 6, 7])
    assert len(d.items) == 7
    again.close()
