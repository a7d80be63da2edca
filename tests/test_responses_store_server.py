"""The Responses store over HTTP with a real SQLite file (issue 34, items 10-12): eviction from the
tenant over its share, start-up over a damaged file or bad rows, a write committed before the
reply (kill -9), and expired and orphaned rows deleted from the file.

The in-process tests serve the real app (``build_app``) on a scripted engine; the kill -9 test
starts ``prefixserve serve`` as a process and reads its file back through a fresh app.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sqlite3
import threading
import time
from pathlib import Path

import httpx
from scripted_engine import ScriptedEngine, scripted_client
from servers import MODEL, server_process

from prefixserve.api.openai.responses.metrics import ResponsesCollector

KEYS = {"key-a": "team-a", "key-b": "team-b"}
LOG = "prefixserve.api.openai.responses.store_file"
TERMINAL = ("response.completed", "response.incomplete")  # 2 output tokens: incomplete


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def create(client, key: str = "key-a", text: str = "hi", **extra) -> dict:
    r = client.post("/v1/responses", headers=bearer(key),
                    json={"model": "m", "input": text, **extra})  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def found(client, rid: str, key: str = "key-a") -> bool:
    return client.get(f"/v1/responses/{rid}", headers=bearer(key)).status_code == 200


def store_stats(client) -> dict:
    """The Responses figures of /stats (which the scripted app does not serve)."""
    return client.app.state.responses.stats()


def file_ids(path: Path) -> set[str]:
    """The ids of the rows in the store file, read with sqlite3 directly."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        return {rid for (rid,) in db.execute("SELECT id FROM responses")}


def stored_file(path: Path, count: int = 2) -> list[str]:
    """A store file holding ``count`` responses of team-a; their ids."""
    with scripted_client(ScriptedEngine(), api_keys=KEYS, responses_store_path=str(path)) as c:
        return [create(c, text=f"turn {i}")["id"] for i in range(count)]


def test_the_tenant_over_its_share_of_the_entry_bound_loses_its_oldest(tmp_path):
    """Issue 34.10: nine tiny records of one key evicted one of the other key's two (larger)."""
    config = dict(api_keys=KEYS, responses_store_max_entries=10,
                  responses_store_path=str(tmp_path / "store.sqlite3"))  # fmt: skip
    with scripted_client(ScriptedEngine(), **config) as client:
        b = [create(client, "key-b", "a long question " * 200)["id"] for _ in range(2)]
        a = [create(client, "key-a")["id"] for _ in range(9)]
        assert all(found(client, rid, "key-b") for rid in b)
        assert [found(client, rid) for rid in a] == [False] + [True] * 8
        assert store_stats(client)["responses_store_evictions"] == 1
    assert file_ids(tmp_path / "store.sqlite3") == {*b, *a[1:]}


def test_bad_rows_are_skipped_counted_and_deleted_with_their_orphans(tmp_path, caplog):
    """Issue 34.11: a row whose body is ``{`` stopped start-up."""
    path = tmp_path / "store.sqlite3"
    good = stored_file(path)
    with sqlite3.connect(path) as db:
        namespace, owner = db.execute("SELECT namespace, owner FROM responses").fetchone()
        now = time.time()
        rows = [("bad", None, "{"), ("child-of-bad", "bad", json.dumps([{}, [], []])),
                ("not-items", None, json.dumps([{}, "x", []]))]  # fmt: skip
        for rid, parent, body in rows:
            db.execute("INSERT INTO responses VALUES (?, ?, ?, ?, ?, ?)",
                       (rid, namespace, owner, parent, now, body))  # fmt: skip
        db.execute("INSERT INTO responses VALUES ('expired', ?, ?, NULL, 1.0, ?)",
                   (namespace, owner, json.dumps([{}, [], []])))  # fmt: skip
    with (
        caplog.at_level(logging.WARNING, LOG),
        scripted_client(ScriptedEngine(), api_keys=KEYS, responses_store_path=str(path)) as c,
    ):
        assert all(found(c, rid) for rid in good)
        stats = store_stats(c)
        assert stats["responses_store_skipped_rows"] == 2
        assert stats["responses_store_entries"] == 2
        metrics = {m.name: m for m in ResponsesCollector("m", c.app.state.responses).collect()}
        assert metrics["prefixserve_responses_store_skipped_rows"].samples[0].value == 2
    assert [r.message for r in caplog.records if r.name == LOG] == [
        f"responses store: skipped 2 unreadable rows of {path} (deleted)"]  # fmt: skip
    assert file_ids(path) == set(good)  # the bad rows, the orphan and the expired row are gone


def test_a_damaged_file_is_moved_aside_and_the_server_starts_empty(tmp_path, caplog):
    """Issue 34.11: random bytes or a truncated file stopped start-up."""
    noise, truncated = tmp_path / "noise.sqlite3", tmp_path / "truncated.sqlite3"
    noise.write_bytes(os.urandom(8192))
    stored_file(truncated, count=40)
    db = sqlite3.connect(truncated)  # pages enough that a cut one is missed
    with db:
        db.execute("UPDATE responses SET body = json_set(body, '$[0].pad', ?)", ("x" * 2000,))
    db.close()  # the last connection: the WAL is checkpointed into the file and removed
    assert not Path(f"{truncated}-wal").exists()
    truncated.write_bytes(truncated.read_bytes()[: truncated.stat().st_size // 2])
    for path in (noise, truncated):
        damaged = path.read_bytes()
        caplog.clear()
        with (
            caplog.at_level(logging.WARNING, LOG),
            scripted_client(
                ScriptedEngine(), api_keys=KEYS, responses_store_path=str(path)
            ) as client,
        ):
            rid = create(client)["id"]
            assert found(client, rid)
        (aside,) = tmp_path.glob(f"{path.name}.damaged-*")
        assert aside.read_bytes() == damaged
        (line,) = [r.message for r in caplog.records if r.name == LOG]
        assert line.startswith(f"responses store: {path} is damaged") and str(aside) in line
        assert file_ids(path) == {rid}


def test_a_failed_write_is_said_in_the_reply(tmp_path):
    """Issue 34.12: a response the file could not commit is not acknowledged as stored."""
    path = tmp_path / "store.sqlite3"
    with scripted_client(ScriptedEngine(), responses_store_path=str(path)) as client:
        with sqlite3.connect(path) as db:
            db.execute("DROP TABLE responses")  # the next write fails
        body = create(client)
        assert body["store"] is False and not found(client, body["id"])
        assert store_stats(client)["responses_store_write_failures"] == 1
        assert create(client, stream=False, store=False)["store"] is False


def test_expired_rows_are_deleted_from_the_file(tmp_path):
    """Issue 34.12: rows past --responses-store-max-age were never deleted from the file."""
    path = tmp_path / "store.sqlite3"
    config = dict(responses_store_path=str(path), responses_store_max_age_s=1.0)
    with scripted_client(ScriptedEngine(), **config) as client:
        old = create(client)["id"]
        time.sleep(1.5)
        new = create(client)["id"]
        assert file_ids(path) == {new} and not found(client, old)


def test_acknowledged_responses_survive_kill_9(tmp_path):
    """Issue 34.12: 7 of 16 acknowledged ``store: true`` responses were lost on kill -9 (the
    write came after the reply). Every fourth is streamed, the last one too: the process is
    killed as soon as its terminal event (``response.incomplete``: 2 output tokens) arrives.
    While the last one is written the test holds the file's write lock for a second, so a reply
    sent before the commit would be killed with its row unwritten."""
    path = str(tmp_path / "store.sqlite3")
    body = {"model": MODEL, "max_output_tokens": 2, "temperature": 0}
    ids = []
    with server_process("--responses-store-path", path, num_kv_blocks=64) as (proc, base):
        with httpx.Client(base_url=base, timeout=60) as client:
            for i in range(16):
                request = {**body, "input": f"question {i}"}
                if i % 4 != 3:
                    ids.append(client.post("/v1/responses", json=request).json()["id"])
                    continue
                if i == 15:
                    blocker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
                    blocker.execute("BEGIN IMMEDIATE")
                    release = threading.Timer(1.0, blocker.execute, ("ROLLBACK",))
                    release.start()
                with client.stream("POST", "/v1/responses", json={**request, "stream": True}) as r:
                    for line in r.iter_lines():
                        event = json.loads(line[6:]) if line.startswith("data: ") else {}
                        if event.get("type") in TERMINAL:
                            ids.append(event["response"]["id"])
                            break
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert proc.returncode == -signal.SIGKILL and len(ids) == 16
    release.join()
    blocker.close()
    with scripted_client(ScriptedEngine(), responses_store_path=path) as client:
        assert [client.get(f"/v1/responses/{rid}").status_code for rid in ids] == [200] * 16
