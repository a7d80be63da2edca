"""An agent paused on a tool call keeps its KV: the front end's half of the retention.

A reply that ends in a tool call means the client runs the tool and comes back with its result,
resending the whole conversation. Every protocol reports it here the same way::

    paused(inputs, token_ids,     the reply (its generated ``token_ids``) stopped on the call
           reason, call_id)       ``call_id``: the engine retains the prompt's and the
                                  reply's full blocks, session ``<salt>/<call id>``, for
                                  the TTL it learned from earlier pauses (``kv.retention``)
    resumed(inputs, call_ids)     a request carries the results of those calls: each session's
                                  gap is a TTL sample and its retention ends (the new request
                                  reads the blocks; its own reply retains them if it pauses)

Sessions are named by the engine's cache salt (already the tenant's, ``frontend.tenancy``) and
the call id, so only a request of the same tenant carrying that call's result resumes one; the
retention counts against the tenant's share of the budget (``inputs.tenant``, ``kv.retention``).
Both are fire-and-forget: a reply is never delayed by them, and a failure is logged, not raised
(retention is a preference, never a correctness matter). Off with ``enabled=False``
(``--no-retain-tool-call-kv``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterable
from typing import TYPE_CHECKING, Any

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
        self.enabled = enabled
        self._tasks: set[asyncio.Task] = set()  # held until done (the loop keeps weak refs)

    def paused(self, inputs: EngineInputs, token_ids: list[int], finish_reason: str | None,
               call_id: str | None) -> None:  # fmt: skip
        """A reply to ``inputs`` (its generated ``token_ids``) finished with ``finish_reason``
        and the call ``call_id`` (None: no call)."""
        salt = getattr(inputs.params, "cache_salt", None)
        if not self.enabled or call_id is None or finish_reason != "stop":
            return
        retention = KVRetention(
            ttl_s=None, session=session_of(salt, call_id), tenant=inputs.tenant.owner
        )
        self._spawn(self.engine.retain_kv([*inputs.prompt_token_ids, *token_ids], retention, salt))

    def resumed(self, inputs: EngineInputs, call_ids: Iterable[Any]) -> None:
        """The request of ``inputs`` carries the results of ``call_ids``."""
        salt = getattr(inputs.params, "cache_salt", None)
        sessions = [session_of(salt, i) for i in dict.fromkeys(call_ids) if isinstance(i, str)]
        if self.enabled and sessions:
            self._spawn(self.engine.resume_kv(sessions))

    def _spawn(self, call: Coroutine) -> None:
        task = asyncio.get_running_loop().create_task(call)
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("KV retention call failed: %r", task.exception())
