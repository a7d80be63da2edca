"""The Ray Serve request routers of the engine deployment: ``prefix`` (ours), ``pow2`` (Ray's
default power-of-two choices) and ``ray-prefix`` (Ray's ``PrefixCacheAffinityRouter``).

A request router lives in the process that holds the deployment handle, here the ingress. Ray
builds it (``initialize_state(**request_router_kwargs)``), tells it the running replicas and
their ``routing_stats`` (``update_replicas``, about every ``request_routing_stats_period_s``),
asks it to rank candidates (``choose_replicas``) and reports where each request went and when it
ended (``on_request_routed``, ``on_request_completed``)::

    update_replicas ──▶ one EventFollower per replica (its KV events ──▶ its HashMirror)
    choose_replicas ──▶ PrefixRouterState.route (ranks, reserves the first) ──▶ [[best], ...]
    on_request_routed / on_request_completed ──▶ predicted blocks, load, decision counters

All three mix in ``ReportingRouter``, so the ingress, which holds the deployment handle that
built its router (``ray_private.request_router_of``), reads the replicas' reports (stats,
metrics) and the routing decisions without a call to any replica.

Ray pickles a router class with its whole module by value (``RequestRouterConfig``), so this
module keeps no state of its own and reaches shared things through imported modules.
"""

from __future__ import annotations

import logging
from typing import Any

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from prefixserve.core.errors import InvalidArgumentError
from prefixserve.scale_out.event_follower import EventFollower
from prefixserve.scale_out.protocol import ReplicaReport
from prefixserve.scale_out.ray_private import PowerOfTwoChoicesRequestRouter
from prefixserve.scale_out.reporting_router import ReportingRouter, engine_request
from prefixserve.scale_out.router import (
    REASONS,
    ROUTERS,
    PrefixRouterState,
    RouterConfig,
    request_block_hashes,
)

logger = logging.getLogger(__name__)


class PrefixAwareRequestRouter(ReportingRouter, RequestRouter):
    """Routes by the exact block hashes each replica holds (its KV events), against its load.

    A ``SessionCall`` goes to its replica (``ReportingRouter.pinned``); other requests that are
    not an ``EngineRequest`` (the replicas' control calls) go to any replica.
    """

    def initialize_state(
        self,
        block_size: int = 16,
        imbalance_threshold: int = 8192,
        load_weight: float = 0.25,
        predict_ttl_s: float = 30.0,
    ) -> None:
        self.block_size = block_size
        self.state = PrefixRouterState(
            RouterConfig(imbalance_threshold, load_weight, predict_ttl_s)
        )
        self._followers: dict[str, EventFollower] = {}
        super().initialize_state()

    # ---- replicas ------------------------------------------------------------------------------

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {}
        for replica in replicas:
            key = replica.replica_id.unique_id
            self.state.mirror(key)
            report = ReplicaReport.from_dict(replica.routing_stats)
            if report is not None and report.kv_events is not None:
                live[key] = report.kv_events
        for key, follower in list(self._followers.items()):
            if live.get(key) != follower.source:
                self._drop_follower(key)
        for key, source in live.items():
            if key not in self._followers:
                self._followers[key] = EventFollower(source, self.state.mirror(key), key)
        for key in set(self.state.replicas()) - {r.replica_id.unique_id for r in replicas}:
            self._forget(key)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        logger.warning("replica %s died; dropping its prefix-cache mirror", replica_id.unique_id)
        self._forget(replica_id.unique_id)

    def _forget(self, key: str) -> None:
        self._drop_follower(key)
        self.state.remove_replica(key)

    def _drop_follower(self, key: str) -> None:
        follower = self._followers.pop(key, None)
        if follower is not None:
            follower.close()

    # ---- routing -------------------------------------------------------------------------------

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        pin = self.pinned(candidate_replicas, pending_request)
        if pin is not None:
            return pin
        request = engine_request(pending_request)
        if request is None:
            return [candidate_replicas]
        prompt = request.prompt_token_ids
        hashes = request_block_hashes(prompt, self.block_size, request.cache_salt)
        by_key = {r.replica_id.unique_id: r for r in candidate_replicas}
        decision = self.state.route(
            pending_request.metadata.internal_request_id,
            list(by_key),
            hashes,
            self.block_size,
            len(prompt),
            request.num_output_tokens,
            request.uses_prefix_cache,
            request.routing_key,
        )
        return [[by_key[c.replica]] for c in decision.ranking]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any
    ) -> None:
        self.state.on_routed(pending_request.metadata.internal_request_id, replica_id.unique_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self.state.on_completed(internal_request_id)

    def decisions(self) -> dict[str, dict[str, Any]]:
        return self.state.snapshot()


class MeasuredPow2Router(ReportingRouter, PowerOfTwoChoicesRequestRouter):
    """Ray's default router, unchanged, registered for the ingress's metrics."""

    reason = "pow2"


def request_router_config(
    router: str,
    block_size: int,
    stats_period_s: float = 1.0,
    router_config: RouterConfig | None = None,
) -> RequestRouterConfig:
    """The engine deployment's ``request_router_config`` for ``router`` (one of ``ROUTERS``)."""
    if router == "prefix":
        config = router_config or RouterConfig()
        cls: type = PrefixAwareRequestRouter
        kwargs = {
            "block_size": block_size,
            "imbalance_threshold": config.imbalance_threshold,
            "load_weight": config.load_weight,
            "predict_ttl_s": config.predict_ttl_s,
        }
    elif router == "pow2":
        cls, kwargs = MeasuredPow2Router, {}
    elif router == "ray-prefix":
        from prefixserve.scale_out.ray_prefix_router import MeasuredPrefixCacheAffinityRouter

        cls, kwargs = MeasuredPrefixCacheAffinityRouter, {}
    else:
        raise InvalidArgumentError(f"router: must be one of {ROUTERS}, got {router!r}", "router")
    return RequestRouterConfig(
        request_router_class=cls,
        request_router_kwargs=kwargs,
        request_routing_stats_period_s=stats_period_s,
    )


__all__ = [
    "REASONS",
    "ROUTERS",
    "MeasuredPow2Router",
    "PrefixAwareRequestRouter",
    "request_router_config",
]
