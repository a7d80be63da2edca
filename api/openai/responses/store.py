"""The Responses store: what ``previous_response_id``, ``GET`` and ``DELETE /v1/responses/{id}``
and a WebSocket connection's chain read; bounded per tenant and globally, and kept on disk.

A record holds one response's delta, never its whole conversation::

    Record(id, namespace, owner, parent, response body, new input items, output items,
           spliced, text delta, prompt ids delta, output ids)

    chain(r) = chain(parent) + parent's output items + r's new items    (a root: its own items)
    prompt(r) = (prompt(parent) + parent's output ids)[:spliced] + r's ids delta
                (spliced None: the prompt is r's own, a re-rendered or truncated one)

``ResponseStore.chain(id, namespaces)`` returns the records from the root to ``id``; the serving
rebuilds the conversation from them (``StoredResponse``). So a 50-turn conversation holds each
turn once, and ``nbytes`` counts exactly the bytes records hold (their JSON, text and 4 bytes per
token id).

Invariants:
- A record is visible only in its ``namespace`` (a tenant's store namespace, or a WebSocket
  connection's own for ``store: false``): no tenant reads, continues or deletes another's.
- After every ``put``: each owner (an API key's tenant) holds at most ``tenant_max_entries`` and
  ``tenant_max_bytes`` (its least recently used records go first), and the store at most
  ``max_entries`` and ``max_bytes``; past the global bound the owner holding the most bytes loses
  its least recently used records, so a tenant within its share never loses records to another.
  A record is kept with its ancestors: reading a chain refreshes every record in it, and evicting
  a record evicts its descendants. A record past ``max_age_s`` is never returned.
- ``evictions`` counts records dropped for a bound; ``delete`` and a closed connection's release
  are not evictions.
- Persistence (``path``, SQLite; ``":memory:"`` keeps nothing on disk): every record put with
  ``persist`` is written, with its ancestors, on a writer thread (never on the event loop), and
  deleted with it. A restarted server loads the records (bodies and items, not token ids): a
  continuation then renders its conversation again.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from array import array
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefixserve.core.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

DEFAULT_MAX_ENTRIES = 10_000
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_AGE_S = 24 * 3600.0
IN_MEMORY = ":memory:"


@dataclass(slots=True)
class Record:
    """One response as the store holds it (see the module doc). ``spliced``: how many tokens of
    the parent's prompt and output begin this prompt (None: the prompt is its own);
    ``text_delta``/``ids_delta``: the prompt's text and ids after them; ``prompt_known``: the
    token fields are valid (False after a restart)."""

    id: str
    namespace: str
    owner: str
    parent: str | None
    response: dict[str, Any]
    new_items: list[dict[str, Any]]
    output_items: list[dict[str, Any]]
    spliced: int | None = None
    text_delta: str = ""
    ids_delta: array = field(default_factory=lambda: array("i"))
    output_ids: array = field(default_factory=lambda: array("i"))
    prompt_known: bool = True
    persist: bool = False
    created: float = 0.0
    nbytes: int = 0

    def measure(self) -> int:
        bodies = json.dumps([self.response, self.new_items, self.output_items], ensure_ascii=False)
        text = len(bodies.encode()) + len(self.text_delta.encode())
        return text + self.ids_delta.itemsize * (len(self.ids_delta) + len(self.output_ids))


@dataclass(slots=True)
class StoredResponse:
    """A response with its whole conversation, rebuilt from its chain: ``items`` are the input
    items of the chain (for ``input_items`` and the next render); ``prompt_text`` (None when not
    known: continue by rendering again) is the template text that ``prompt_token_ids`` spell."""

    response: dict[str, Any]
    items: list[dict[str, Any]]
    output_items: list[dict[str, Any]]
    prompt_text: str | None
    prompt_token_ids: array
    output_token_ids: array


def _positive(**limits: float) -> None:
    for name, value in limits.items():
        if value <= 0:
            raise InvalidArgumentError(
                f"responses_store_{name}: must be > 0, got {value}", f"responses_store_{name}"
            )


class ResponseStore:
    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        tenant_max_entries: int | None = None,
        tenant_max_bytes: int | None = None,
        path: str = IN_MEMORY,
        clock: Callable[[], float] = time.time,
    ) -> None:
        tenant_max_entries = tenant_max_entries or max_entries
        tenant_max_bytes = tenant_max_bytes or max_bytes
        _positive(max_entries=max_entries, max_bytes=max_bytes, max_age_s=max_age_s,
                  tenant_max_entries=tenant_max_entries, tenant_max_bytes=tenant_max_bytes)  # fmt: skip
        self.max_entries, self.max_bytes, self.max_age_s = max_entries, max_bytes, max_age_s
        self.tenant_max_entries, self.tenant_max_bytes = tenant_max_entries, tenant_max_bytes
        self._clock = clock
        self._records: OrderedDict[str, Record] = OrderedDict()  # LRU first
        self._children: defaultdict[str, set[str]] = defaultdict(set)
        self._owner_bytes: defaultdict[str, int] = defaultdict(int)
        self._owner_count: defaultdict[str, int] = defaultdict(int)
        self.nbytes = 0
        self.evictions = 0
        self._disk = None if path == IN_MEMORY else _Disk(path)
        if self._disk is not None:
            for record in self._disk.load(clock() - max_age_s):
                self._insert(record)
            self._bound(None)

    def __len__(self) -> int:
        return len(self._records)

    def owner_usage(self, owner: str) -> tuple[int, int]:
        """(records, bytes) ``owner`` holds."""
        return self._owner_count[owner], self._owner_bytes[owner]

    def put(self, record: Record, items: list[dict[str, Any]]) -> bool:
        """Keep ``record``; False when a bound left it out. ``items``: its whole conversation's
        input items, kept instead of its delta when its parent was evicted meanwhile."""
        if record.parent is not None and record.parent not in self._records:
            record.parent, record.spliced, record.new_items = None, None, items
        record.created = self._clock()
        record.nbytes = record.measure()
        self._drop(record.id)
        if record.nbytes > min(self.max_bytes, self.tenant_max_bytes):
            self.evictions += 1  # larger than a whole bound: never kept, evicts nothing
            return False
        self._insert(record)
        self._bound(record.owner)
        kept = record.id in self._records
        if kept and record.persist and self._disk is not None:
            self._persist(record)
        return kept

    def chain(self, response_id: str, namespaces: tuple[str, ...]) -> list[Record] | None:
        """The records from the root to ``response_id`` (refreshed), or None when it is not
        visible in ``namespaces`` or has expired."""
        record = self._records.get(response_id)
        if record is None or record.namespace not in namespaces:
            return None
        if self._clock() - record.created > self.max_age_s:
            self._evict(response_id)
            return None
        chain = [record]
        while chain[-1].parent is not None:
            chain.append(self._records[chain[-1].parent])
        for r in chain:
            self._records.move_to_end(r.id)
        return chain[::-1]

    def delete(self, response_id: str, namespace: str) -> bool:
        record = self._records.get(response_id)
        if record is None or record.namespace != namespace:
            return False
        self._drop(response_id)
        return True

    def release(self, namespace: str) -> None:
        """Drop a closed connection's records, but those that records elsewhere continue."""
        mine = [r for r in self._records.values() if r.namespace == namespace]
        for record in sorted(mine, key=lambda r: r.created, reverse=True):  # children first
            if not self._children.get(record.id):
                self._drop(record.id)

    def close(self) -> None:
        if self._disk is not None:
            self._disk.close()

    # -- bookkeeping ----------------------------------------------------------------------------

    def _insert(self, record: Record) -> None:
        self._records[record.id] = record
        if record.parent is not None:
            self._children[record.parent].add(record.id)
        self.nbytes += record.nbytes
        self._owner_bytes[record.owner] += record.nbytes
        self._owner_count[record.owner] += 1

    def _bound(self, owner: str | None) -> None:
        now = self._clock()
        while self._records:  # expired records, from the LRU end
            oldest = next(iter(self._records.values()))
            if now - oldest.created <= self.max_age_s:
                break
            self._evict(oldest.id)
        if owner is not None:
            while (self._owner_count[owner] > self.tenant_max_entries
                   or self._owner_bytes[owner] > self.tenant_max_bytes):  # fmt: skip
                self._evict(next(r.id for r in self._records.values() if r.owner == owner))
        while len(self._records) > self.max_entries or self.nbytes > self.max_bytes:
            largest = max(self._owner_bytes, key=self._owner_bytes.__getitem__)
            self._evict(next(r.id for r in self._records.values() if r.owner == largest))

    def _evict(self, response_id: str) -> None:
        self.evictions += self._drop(response_id)

    def _drop(self, response_id: str) -> int:
        """Remove a record and its descendants; how many were removed."""
        record = self._records.pop(response_id, None)
        if record is None:
            return 0
        dropped = 1
        for child in list(self._children.pop(response_id, ())):
            dropped += self._drop(child)
        if record.parent is not None:
            self._children.get(record.parent, set()).discard(response_id)
        self.nbytes -= record.nbytes
        self._owner_bytes[record.owner] -= record.nbytes
        self._owner_count[record.owner] -= 1
        if not self._owner_count[record.owner]:
            del self._owner_count[record.owner], self._owner_bytes[record.owner]
        if record.persist and self._disk is not None:
            self._disk.delete(record.id)
        return dropped

    def _persist(self, record: Record) -> None:
        """Write ``record`` and every ancestor not written yet (a chain survives whole)."""
        chain = [record]
        while chain[-1].parent is not None and not self._records[chain[-1].parent].persist:
            chain.append(self._records[chain[-1].parent])
        for r in reversed(chain):
            r.persist = True
            self._disk.write(r)  # type: ignore[union-attr]


class _Disk:
    """The SQLite file under a store: one writer thread owns the connection."""

    _SCHEMA = (
        "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, namespace TEXT NOT NULL, "
        "owner TEXT NOT NULL, parent TEXT, created REAL NOT NULL, body TEXT NOT NULL)"
    )

    def __init__(self, path: str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="responses-store")
        self._db: sqlite3.Connection | None = None
        self._writer.submit(self._open).result()

    def _open(self) -> None:
        self._db = sqlite3.connect(self.path, timeout=30, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(self._SCHEMA)
        self._db.commit()

    def load(self, since: float) -> list[Record]:
        """The records written since ``since``, oldest first, without token ids."""
        rows = self._writer.submit(lambda: self._db.execute(  # type: ignore[union-attr]
            "SELECT id, namespace, owner, parent, created, body FROM responses "
            "WHERE created >= ? ORDER BY created", (since,)).fetchall()).result()  # fmt: skip
        records, known = [], set()
        for rid, namespace, owner, parent, created, body in rows:
            if parent is not None and parent not in known:
                continue  # its conversation's start is gone
            response, new_items, output_items = json.loads(body)
            record = Record(rid, namespace, owner, parent, response, new_items, output_items,
                            prompt_known=False, persist=True, created=created)  # fmt: skip
            record.nbytes = record.measure()
            records.append(record)
            known.add(rid)
        return records

    def write(self, record: Record) -> None:
        body = json.dumps([record.response, record.new_items, record.output_items],
                          ensure_ascii=False)  # fmt: skip
        row = (record.id, record.namespace, record.owner, record.parent, record.created, body)
        self._submit("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?)", row)

    def delete(self, response_id: str) -> None:
        self._submit("DELETE FROM responses WHERE id = ?", (response_id,))

    def _submit(self, sql: str, row: tuple) -> None:
        def run() -> None:
            try:
                self._db.execute(sql, row)  # type: ignore[union-attr]
                self._db.commit()  # type: ignore[union-attr]
            except sqlite3.Error:
                logger.exception("responses store: writing %s failed", self.path)

        self._writer.submit(run)

    def close(self) -> None:
        self._writer.submit(lambda: self._db.close()).result()  # type: ignore[union-attr]
        self._writer.shutdown()
