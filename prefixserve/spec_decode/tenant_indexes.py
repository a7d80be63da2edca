"""Every tenant's suffix index, bounded in tenants and in bytes across all of them.

One ``OutputIndex`` per tenant (``Request.extra_keys``), each under its own bounds (outputs and
``tenant_max_bytes``); across them at most ``max_tenants`` tenants and ``max_bytes`` bytes
(``nbytes``, the sum of the indexes' estimates). Adding to a tenant's index or looking it up makes
that tenant the most recently used. Past the global byte bound the least recently used tenant
loses its oldest outputs, one at a time, and is dropped once it holds none; then the next. A
tenant is held only while its index holds an output::

    LRU  a: [a0 a1]   b: [b0 b1]   c: [c0 c1 c2]  MRU      c just added c2; 2 outputs too many
      -> a0, a1 forgotten, a dropped; b and c keep everything

Any client can create a tenant (a new ``cache_salt``), so without the global bound the index
could hold ``max_tenants * tenant_max_bytes``. Invariant: no index's own bound exceeds the global
one, so the output just added is never forgotten to make room (its tenant is the most recent, and
it alone fits).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

from prefixserve.spec_decode.output_index import OutputIndex

MAX_TENANTS = 256


class TenantIndexes:
    def __init__(
        self,
        max_outputs: int,
        min_n: int,
        max_n: int,
        tenant_max_bytes: int,
        max_bytes: int,
        max_tenants: int = MAX_TENANTS,
    ) -> None:
        # a new tenant's index; no index's own bound exceeds the global one (module doc)
        self._new_index = functools.partial(
            OutputIndex, max_outputs, min_n, max_n, min(tenant_max_bytes, max_bytes)
        )
        self.max_bytes = max_bytes
        self.max_tenants = max_tenants
        self.nbytes = 0
        self._tenants: OrderedDict[Hashable, OutputIndex] = OrderedDict()

    def __len__(self) -> int:
        return len(self._tenants)

    def lookup(self, tenant: Hashable, tail: Sequence[int], k: int) -> tuple[int, list[int]]:
        """``OutputIndex.lookup`` in ``tenant``'s index ((0, []) when it has none)."""
        index = self._tenants.get(tenant)
        if index is None:
            return 0, []
        self._tenants.move_to_end(tenant)
        return index.lookup(tail, k)

    def add(self, tenant: Hashable, outputs: Iterable[Sequence[int]]) -> None:
        """Remember ``tenant``'s outputs, then restore the bounds (module doc)."""
        index = self._tenants.get(tenant)
        if index is None:
            index = self._new_index()
            self._tenants[tenant] = index
        self._tenants.move_to_end(tenant)
        before = index.nbytes
        for token_ids in outputs:
            index.add(token_ids)
        self.nbytes += index.nbytes - before
        if not len(index):  # nothing indexable (outputs too short): hold no tenant for it
            del self._tenants[tenant]
        while len(self._tenants) > self.max_tenants:
            self.nbytes -= self._tenants.popitem(last=False)[1].nbytes
        while self.nbytes > self.max_bytes:
            lru_tenant, lru = next(iter(self._tenants.items()))
            self.nbytes -= lru.forget_oldest()
            if not len(lru):
                del self._tenants[lru_tenant]

    def stats(self) -> dict[str, int]:
        """The index's memory: bytes (estimated), outputs held, tenants."""
        return {
            "suffix_index_bytes": self.nbytes,
            "suffix_index_entries": sum(len(index) for index in self._tenants.values()),
            "suffix_index_tenants": len(self._tenants),
        }
