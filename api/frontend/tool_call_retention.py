"""An agent paused on a tool call keeps its KV: the front end's half of the retention.

A reply that ends in a tool call means the client runs the tool and comes back with its result,
resending the whole conversation. The retention rides on the requests; the front end only names
or releases a session. Every protocol uses it the same way::

    pause(request_id, tenant, salt)  a request offered tools carries a provisional pause:
                                  KVRetention(ttl_s=None, include_output), session
                                  ``<salt>/~<request id>``; the engine applies it when the
                                  request retires, if its reply stopped (the blocks' hashes
                                  are the engine's own: nothing is sent back to be hashed)
    paused(inputs, reason, call)  the reply ended: with a call, the session is named
                                  ``<salt>/<call id>`` and holds for the TTL the engine learned
                                  from earlier pauses (``kv.retention``); without, released
    resumes(tenant, salt, calls)  a request carrying the results of those calls names their
                                  sessions in ``kv_resume``: the engine samples each gap for
                                  the TTL and releases the session as it takes the request

Sessions are named by the engine's cache salt (already the tenant's, ``frontend.tenancy``) and
the call id, so only a request of the same tenant carrying that call's result resumes one; the
retention counts against the tenant's share of the budget (``Tenant.owner``, ``kv.retention``).
Only a request's first reply (choice 0) is retained. Naming and releasing are fire-and-forget:
a reply is never delayed by them, and a failure is logged, not raised (retention is a
preference, never a correctness matter). Off with ``enabled=False``
(``--no-retain-tool-call-kv``), and where the engine client cannot name sessions
(``EngineClient.names_kv_sessions``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable
from typing import TYPE_CHECKING, Any

from prefixserve.api.frontend.tenancy import Tenant
from prefixserve.kv.retention import KVRetention

if TYPE_CHECKING:
    from prefixserve.api.engine_client import EngineClient
    from prefixserve.api.frontend.inputs import EngineInputs

logger = logging.getLogger(__name__)


def session_of(cache_salt: str | None, call_id: str) -> str:
    return f"{cache_salt or ''}/{call_id}"


class ToolCallRetention:
    def __init__(self, engine: EngineClient, enabled: bool = True) -> None:
        self.engine = engine
        self.enabled = enabled and engine.names_kv_sessions
        self._tasks: set[asyncio.Task] = set()  # held until done (the loop keeps weak refs)

    def pause(self, request_id: str, tenant: Tenant, cache_salt: str | None
              ) -> tuple[KVRetention, ...]:  # fmt: skip
        """The provisional pause a request offered tools carries (``cache_salt``: the
        request's own, before the tenant salts it)."""
        if not self.enabled:
            return ()
        session = session_of(tenant.cache_salt(cache_salt), f"~{request_id}")
        return (KVRetention(ttl_s=None, include_output=True, session=session,
                            tenant=tenant.owner),)  # fmt: skip

    def paused(self, inputs: EngineInputs, finish_reason: str | None, call_id: str | None) -> None:
        """The reply to ``inputs`` finished with ``finish_reason`` and its first call ``call_id``
        (None: no call): its provisional pause is named after the call, or released."""
        pauses = [r.session for r in getattr(inputs.params, "kv_retention", ())
                  if r.ttl_s is None and r.session is not None]  # fmt: skip
        if not pauses:
            return
        (provisional,) = pauses
        if call_id is not None and finish_reason == "stop":
            salt = getattr(inputs.params, "cache_salt", None)
            self._spawn(self.engine.rename_kv(provisional, session_of(salt, call_id)))
        else:
            self._spawn(self.engine.release_kv(provisional))

    def resumes(self, tenant: Tenant, cache_salt: str | None, call_ids: Iterable[Any]
                ) -> tuple[str, ...]:  # fmt: skip
        """The sessions a request carrying the results of ``call_ids`` continues."""
        if not self.enabled:
            return ()
        salt = tenant.cache_salt(cache_salt)
        return tuple(session_of(salt, i) for i in dict.fromkeys(call_ids) if isinstance(i, str))

    def _spawn(self, call: Coroutine) -> None:
        task = asyncio.get_running_loop().create_task(call)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("KV retention call failed: %r", task.exception())
