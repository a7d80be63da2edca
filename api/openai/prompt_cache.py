"""OpenAI's prompt-cache fields, on chat completions and Responses.

``prompt_cache_retention``::

    None, "in_memory"   the prefix cache as always: every full block cached, least recently used
                        evicted first (to the KV tiers where they are configured)
    "24h"               the prompt's and the reply's full blocks are retained for 24 hours (capped
                        by --kv-retention-max-ttl, within the retention budget) and written
                        through to the disk tier at once (--kv-cache-dir), so they outlive
                        eviction and a restart; named ``<namespace>/<response id>``, which
                        deleting the stored response releases. It counts against the tenant's
                        share of the budget; the same prefix again refreshes one engine session
                        (``kv.retention``), each response id a name that releases it
    anything else       a 400 naming the field

``prompt_cache_key`` is a routing hint (``scale_out.router.with_affinity``, scoped to the
tenant): where the prompt's cached blocks do not decide, a request goes to the replica its key's
earlier requests went to. It is never part of a block hash, so sessions with different keys keep
sharing their common prefix (a system prompt, say). The router gets a fixed-size digest of the
namespace and the key (``routing_key``), never the key itself: a key of any length costs the
same few bytes in the router's bounded table.
"""

from __future__ import annotations

import hashlib

from prefixserve.api.frontend.protocol import APIError
from prefixserve.kv.retention import KVRetention

RETENTIONS = ("in_memory", "24h")
DAY_S = 24 * 3600.0


def retention_of(value: str | None, session: str, tenant: str = "") -> tuple[KVRetention, ...]:
    """The engine retention ``prompt_cache_retention`` asks for (a 400 on an unknown value),
    named ``session``, counted against ``tenant``'s share of the budget (``Tenant.owner``)."""
    if value not in (None, *RETENTIONS):
        raise APIError(
            f"prompt_cache_retention: must be one of {list(RETENTIONS)}, got {value!r}",
            400,
            "prompt_cache_retention",
        )
    if value != "24h":
        return ()
    return (KVRetention(ttl_s=DAY_S, include_output=True, write_through=True, session=session,
                        tenant=tenant),)  # fmt: skip


def retention_session(namespace: str, response_id: str) -> str:
    return f"{namespace}/{response_id}"


def routing_key(namespace: str, prompt_cache_key: str | None) -> str | None:
    """The router's affinity key: a 32-hex-digit digest of the namespace and the key."""
    if prompt_cache_key is None:
        return None
    return hashlib.blake2b(f"{namespace}\0{prompt_cache_key}".encode(), digest_size=16).hexdigest()
