"""The Responses store: what ``previous_response_id``, ``GET`` and ``DELETE /v1/responses/{id}``
read, bounded and isolated per tenant.

An entry is one stored response: its body, the conversation items that led to it (without
``instructions``, which OpenAI does not carry over), and the exact token ids of its prompt and
output with the prompt's rendered text, from which a continuation is spliced
(``responses_continuation``).

Invariants:
- Every key is ``(tenant, response id)``: a lookup with another tenant's key finds nothing, so
  one tenant can never read, continue or delete another's responses.
- After every ``put``: ``len <= max_entries`` and ``nbytes <= max_bytes``, reached by evicting
  least recently used entries first (``get`` refreshes an entry); an entry larger than
  ``max_bytes`` on its own is not kept. An entry older than ``max_age_s`` is never returned
  (dropped when looked up, or when a ``put`` passes it in LRU order).
- ``evictions`` counts entries dropped for a limit (size or age), never ``delete``.
"""

from __future__ import annotations

import hashlib
import json
import time
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prefixserve.errors import InvalidArgumentError

DEFAULT_MAX_ENTRIES = 10_000
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_MAX_AGE_S = 24 * 3600.0


@dataclass(slots=True)
class StoredResponse:
    """One response as the store keeps it. ``prompt_text`` is the chat-template text that
    ``prompt_token_ids`` spell; ``items`` are the input items of the whole chain so far (for
    ``input_items`` and the next render); ``output_items`` are this response's output items."""

    response: dict[str, Any]
    items: list[dict[str, Any]]
    output_items: list[dict[str, Any]]
    prompt_text: str
    prompt_token_ids: array = field(default_factory=lambda: array("i"))
    output_token_ids: array = field(default_factory=lambda: array("i"))
    created: float = 0.0
    nbytes: int = 0

    def measure(self) -> int:
        """Bytes this entry holds: its JSON bodies, its text and 4 bytes per token id."""
        bodies = json.dumps([self.response, self.items, self.output_items], ensure_ascii=False)
        text = len(bodies.encode()) + len(self.prompt_text.encode())
        return text + self.prompt_token_ids.itemsize * (
            len(self.prompt_token_ids) + len(self.output_token_ids)
        )


Chain = dict[str, StoredResponse]
"""The responses of one WebSocket connection, by id (kept while it lives, ``store`` or not)."""


def tenant_of(authorization: str | None, cache_salt: str | None) -> str:
    """A tenant's store namespace: a digest of its ``Authorization`` header and ``cache_salt``
    (the key itself is not kept)."""
    raw = f"{authorization or ''}\0{cache_salt or ''}".encode()
    return hashlib.sha256(raw).hexdigest()


class ResponseStore:
    """An LRU map ``(tenant, id) -> StoredResponse`` bounded in entries, bytes and age."""

    def __init__(
        self,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_age_s: float = DEFAULT_MAX_AGE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value in (("max_entries", max_entries), ("max_bytes", max_bytes),
                            ("max_age_s", max_age_s)):  # fmt: skip
            if value <= 0:
                raise InvalidArgumentError(
                    f"responses_store_{name}: must be > 0, got {value}", f"responses_store_{name}"
                )
        self.max_entries, self.max_bytes, self.max_age_s = max_entries, max_bytes, max_age_s
        self._clock = clock
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self.nbytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tenant: str, response_id: str, entry: StoredResponse) -> None:
        entry.created = self._clock()
        entry.nbytes = entry.measure()
        self._drop((tenant, response_id))
        if entry.nbytes > self.max_bytes:
            self.evictions += 1
            return
        self._entries[(tenant, response_id)] = entry
        self.nbytes += entry.nbytes
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            self._evict(next(iter(self._entries)))
        self._expire()

    def get(self, tenant: str, response_id: str) -> StoredResponse | None:
        key = (tenant, response_id)
        entry = self._entries.get(key)
        if entry is None:
            return None
        if self._expired(entry):
            self._evict(key)
            return None
        self._entries.move_to_end(key)
        return entry

    def delete(self, tenant: str, response_id: str) -> bool:
        return self._drop((tenant, response_id)) is not None

    def _expired(self, entry: StoredResponse) -> bool:
        return self._clock() - entry.created > self.max_age_s

    def _expire(self) -> None:
        """Drop expired entries from the LRU end (a refreshed old entry stops the sweep; ``get``
        still refuses it)."""
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if not self._expired(entry):
                return
            self._evict(key)

    def _evict(self, key: tuple[str, str]) -> None:
        self._drop(key)
        self.evictions += 1

    def _drop(self, key: tuple[str, str]) -> StoredResponse | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
        return entry
