"""The Responses store: what ``previous_response_id``, ``GET`` and ``DELETE /v1/responses/{id}``
and a WebSocket connection's chain read; bounded per tenant and globally, and kept on disk.

A record holds one response's delta, never its whole conversation::

    Record(id, namespace, owner, parent, response body, new input items, output items,
           spliced, text delta, prompt ids delta, output ids)

    chain(r) = chain(parent) + parent's output items + r's new items    (a root: its own items)
    prompt(r) = (prompt(parent) + parent's output ids)[:spliced] + r's ids delta
                (spliced None: the prompt is r's own, a re-rendered or truncated one)

``ResponseStore.chain(id, namespaces)`` returns the records from the root to ``id``;
``conversation`` rebuilds the response with its whole conversation from them (``StoredResponse``).
So a 50-turn conversation holds each turn once, and ``nbytes`` counts exactly the bytes records
hold (their JSON, text and 4 bytes per token id).

Invariants:
- A record is visible only in its ``namespace`` (a tenant's store namespace, or a WebSocket
  connection's own for ``store: false``): no tenant reads, continues or deletes another's.
- After every ``put``: each owner (an API key's tenant) holds at most ``tenant_max_entries`` and
  ``tenant_max_bytes`` (its least recently used records go first), and the store at most
  ``max_entries`` and ``max_bytes``. Past a global bound, the owner furthest over its fair share
  of that bound (the bound over the owners holding records) loses its least recently used
  records: for ``max_entries`` the owner holding the most records, for ``max_bytes`` the most
  bytes. So a tenant within its share of a bound never loses records to another.
  A record is kept with its ancestors: reading a chain refreshes every record in it, and evicting
  a record evicts its descendants. A record past ``max_age_s`` (counted from its creation) is
  evicted at the next ``put`` or ``chain`` and never returned; nor is a chain whose root expired.
- ``evictions`` counts records dropped for a bound or their age; ``delete``, a closed
  connection's release and a failed write are not evictions (``write_failures``).
- Persistence (``path``, SQLite, ``store_file``; ``":memory:"`` keeps nothing on disk): ``put``
  of a record with ``persist`` returns once the record and its unwritten ancestors are committed
  to the file (on its writer thread, never on the event loop); a failed write drops the record
  and ``put`` says False. Evicted and deleted records are deleted from the file (``delete``
  returns once that is committed; evictions do not wait). A restarted
  server loads the records (bodies and items, not token ids): a continuation then renders its
  conversation again. Rows that do not decode are skipped (``skipped_rows``); a damaged file is
  moved aside.
"""

from __future__ import annotations

import asyncio
import json
import time
from array import array
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from prefixserve.api.openai.responses.continuation import output_text
from prefixserve.api.openai.responses.store_file import StoreFile
from prefixserve.core.errors import InvalidArgumentError

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
        self._created: dict[str, float] = {}  # the same records, oldest first
        self._children: defaultdict[str, set[str]] = defaultdict(set)
        self._owner_bytes: defaultdict[str, int] = defaultdict(int)
        self._owner_count: defaultdict[str, int] = defaultdict(int)
        self.nbytes = 0
        self.evictions = 0
        self.skipped_rows = 0
        self.write_failures = 0
        self._file = None if path == IN_MEMORY else StoreFile(path)
        if self._file is not None:
            rows, self.skipped_rows = self._file.load(clock() - max_age_s)
            for row in rows:
                record = Record(row.id, row.namespace, row.owner, row.parent, row.response,
                                row.new_items, row.output_items, prompt_known=False,
                                persist=True, created=row.created)  # fmt: skip
                record.nbytes = record.measure()
                self._insert(record)
            for owner in list(self._owner_count):
                self._bound(owner)

    def __len__(self) -> int:
        return len(self._records)

    def owner_usage(self, owner: str) -> tuple[int, int]:
        """(records, bytes) ``owner`` holds."""
        return self._owner_count[owner], self._owner_bytes[owner]

    async def put(self, record: Record, items: list[dict[str, Any]]) -> bool:
        """Keep ``record``: True once it is kept and, with ``persist``, committed to the file
        (with its unwritten ancestors, in one transaction); False when a bound left it out or
        the write failed (then it is not kept either). ``items``: its whole conversation's input
        items, kept instead of its delta when its parent was evicted meanwhile."""
        if not self._keep(record, items):
            return False
        if not record.persist or self._file is None:
            return True
        chain = [record]  # the record and its ancestors not written yet, the record first
        while chain[-1].parent is not None and not self._records[chain[-1].parent].persist:
            chain.append(self._records[chain[-1].parent])
        for r in chain:
            r.persist = True  # an eviction meanwhile deletes its row after the write
        written = asyncio.wrap_future(self._file.write(chain[::-1], self._clock() - self.max_age_s))
        written.add_done_callback(partial(self._written, chain))
        return await asyncio.shield(written)  # a reply cancelled meanwhile: the same outcome

    def chain(self, response_id: str, namespaces: tuple[str, ...]) -> list[Record] | None:
        """The records from the root to ``response_id`` (refreshed), or None when it is not
        visible in ``namespaces`` or has expired."""
        self._expire()
        record = self._records.get(response_id)
        if record is None or record.namespace not in namespaces:
            return None
        chain = [record]
        while chain[-1].parent is not None:
            chain.append(self._records[chain[-1].parent])
        for r in chain:
            self._records.move_to_end(r.id)
        return chain[::-1]

    def conversation(self, response_id: str, namespaces: tuple[str, ...],
                     tokenizer: Any) -> StoredResponse | None:  # fmt: skip
        """``response_id`` with its whole conversation, rebuilt from its ``chain`` (None when
        ``chain`` is); ``tokenizer`` spells the output ids a continuation spliced
        (``continuation.output_text``). Walking the records root first::

            items(r) = r's new items                                    (a root)
                     = items(parent) + parent's output items + r's new items
            text(r)  = None                        (r's prompt not known: loaded after a restart)
                     = r's text delta                                   (spliced None)
                     = text(parent) + output_text(kept) + r's text delta  (None if text(parent))
            ids(r)   = r's ids delta                                    (spliced None)
                     = ids(parent) + kept + r's ids delta
            kept     = parent's output ids[:spliced - len(ids(parent))]

        Invariant: a ``prompt_text`` spells its ``prompt_token_ids`` as the template wrote them
        (the ids mean nothing when it is None: the next turn renders again)."""
        chain = self.chain(response_id, namespaces)
        if chain is None:
            return None
        items: list[dict[str, Any]] = []
        outputs: list[dict[str, Any]] = []
        text: str | None = None
        ids, out_ids = array("i"), array("i")
        for r in chain:
            items = r.new_items if r.parent is None else items + outputs + r.new_items
            if not r.prompt_known:
                text = None
            elif r.spliced is None:
                text, ids = r.text_delta, r.ids_delta
            elif text is not None:
                kept = out_ids[: r.spliced - len(ids)]
                text = text + output_text(tokenizer, kept) + r.text_delta
                ids = ids + kept + r.ids_delta
            outputs, out_ids = r.output_items, r.output_ids
        body = {**chain[-1].response, "output": outputs}
        return StoredResponse(body, items, outputs, text, ids, out_ids)

    async def delete(self, response_id: str, namespace: str) -> bool:
        """Delete a record and its descendants: True once done (and, with a file, once their
        rows' deletes are committed); False when ``namespace`` holds no such record."""
        record = self._records.get(response_id)
        if record is None or record.namespace != namespace:
            return False
        self._drop(response_id)
        if self._file is not None:
            await asyncio.shield(asyncio.wrap_future(self._file.flush()))
        return True

    def release(self, namespace: str) -> None:
        """Drop a closed connection's records, but those that records elsewhere continue."""
        mine = [r for r in self._records.values() if r.namespace == namespace]
        for record in sorted(mine, key=lambda r: r.created, reverse=True):  # children first
            if not self._children.get(record.id):
                self._drop(record.id)

    def close(self) -> None:
        """Close the file once every write and delete submitted before is done."""
        if self._file is not None:
            self._file.close()

    # -- bookkeeping ----------------------------------------------------------------------------

    def _keep(self, record: Record, items: list[dict[str, Any]]) -> bool:
        """Hold ``record`` in memory within the bounds: whether it is held."""
        self._expire()
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
        return record.id in self._records

    def _written(self, chain: list[Record], done: asyncio.Future[bool]) -> None:
        """After ``put``'s write (on the event loop): when it failed, its records are not in the
        file and the record (``chain[0]``) is not kept."""
        if done.result():
            return
        self.write_failures += 1
        for r in chain:
            r.persist = False
        self._drop(chain[0].id)

    def _insert(self, record: Record) -> None:
        self._records[record.id] = record
        self._created[record.id] = record.created
        if record.parent is not None:
            self._children[record.parent].add(record.id)
        self.nbytes += record.nbytes
        self._owner_bytes[record.owner] += record.nbytes
        self._owner_count[record.owner] += 1

    def _expire(self) -> None:
        """Evict the records past ``max_age_s``, oldest first (with the records continuing them,
        which are younger)."""
        deadline = self._clock() - self.max_age_s
        while self._created:
            oldest, created = next(iter(self._created.items()))
            if created >= deadline:
                break
            self._evict(oldest)

    def _bound(self, owner: str) -> None:
        """``owner`` within its quotas, then the store within its bounds: past a global bound,
        the owner furthest over its share of that bound (the bound over the owners holding
        records, equal for all: so the owner holding the most of it) loses its least recently
        used record, one at a time."""
        while (self._owner_count[owner] > self.tenant_max_entries
               or self._owner_bytes[owner] > self.tenant_max_bytes):  # fmt: skip
            self._evict(self._least_recent(owner))
        while len(self._records) > self.max_entries:
            self._evict(self._least_recent(_furthest_over(self._owner_count)))
        while self.nbytes > self.max_bytes:
            self._evict(self._least_recent(_furthest_over(self._owner_bytes)))

    def _least_recent(self, owner: str) -> str:
        return next(r.id for r in self._records.values() if r.owner == owner)

    def _evict(self, response_id: str) -> None:
        self.evictions += self._drop(response_id)

    def _drop(self, response_id: str) -> int:
        """Remove a record and its descendants; how many were removed."""
        record = self._records.pop(response_id, None)
        if record is None:
            return 0
        del self._created[response_id]
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
        if record.persist and self._file is not None:
            self._file.delete(record.id)
        return dropped


def _furthest_over(usage: dict[str, int]) -> str:
    """The owner whose ``usage`` of a bound is furthest over its fair share (bound / owners)."""
    return max(usage, key=usage.__getitem__)
