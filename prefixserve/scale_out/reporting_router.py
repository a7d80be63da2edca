"""The part every engine request router shares: replica reports, per-replica request counts, and
``SessionCall`` s pinned to their replica.

The ingress reads a router through ``ClusterView`` (its deployment handle's router, see
``ray_private.request_router_of``) to serve the cluster's /stats and /metrics without calling a
replica. Ray-free apart from the ``PendingRequest`` it is handed, so any router may mix it in.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from prefixserve.scale_out.protocol import EngineRequest, ReplicaReport, SessionCall


def engine_request(pending_request: Any | None) -> EngineRequest | None:
    """The ``EngineRequest`` a Ray ``PendingRequest`` carries; None for the replicas' control
    calls (``describe``, health) and for a missing request."""
    if pending_request is None or not pending_request.args:
        return None
    arg = pending_request.args[0]
    return arg if isinstance(arg, EngineRequest) else None


class ReportingRouter:
    """Mixin of every engine router (first in the bases, before Ray's router class).

    ``reason`` labels the requests a baseline router sends (it gives none of its own).
    Needs the Ray router's ``curr_replicas``; ``initialize_state`` passes its kwargs on.
    """

    reason = "other"

    def initialize_state(self, **kwargs: Any) -> None:
        self._routed: dict[str, Counter[str]] = {}
        super().initialize_state(**kwargs)

    async def choose_replicas(
        self, candidate_replicas: list[Any], pending_request: Any | None = None
    ) -> list[list[Any]]:
        """A ``SessionCall`` to its replica (``pinned``); anything else as the router decides."""
        pin = self.pinned(candidate_replicas, pending_request)
        if pin is not None:
            return pin
        return await super().choose_replicas(candidate_replicas, pending_request)

    def pinned(self, candidates: list[Any], pending_request: Any | None) -> list[list[Any]] | None:
        """Where a ``SessionCall`` goes: its replica alone; none while that replica is running
        but not a candidate (busy: Serve asks again); any candidate once it has left the
        deployment (its sessions went with it, and the call is a no-op elsewhere). None for any
        other request."""
        if pending_request is None or not pending_request.args:
            return None
        call = pending_request.args[0]
        if not isinstance(call, SessionCall):
            return None
        chosen = [r for r in candidates if r.replica_id.unique_id == call.replica]
        if chosen:
            return [chosen]
        running = {rid.unique_id for rid in self.curr_replicas}
        return [] if call.replica in running else [candidates]

    def replica_reports(self) -> dict[str, ReplicaReport | None]:
        """The latest report of every running replica, by replica id (None before its first)."""
        return {
            rid.unique_id: ReplicaReport.from_dict(replica.routing_stats)
            for rid, replica in self.curr_replicas.items()
        }

    def decisions(self) -> dict[str, dict[str, Any]]:
        """Per replica: requests by reason (and, for the prefix router, load and predicted hits)."""
        return {
            replica: {"requests": dict(counts), "load_tokens": 0, "predicted_hit_tokens": 0}
            for replica, counts in self._routed.items()
        }

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        if engine_request(pending_request) is not None:
            self._routed.setdefault(replica_id.unique_id, Counter())[self.reason] += 1
        super().on_request_routed(pending_request, replica_id, result)
