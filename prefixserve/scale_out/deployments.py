"""The Ray Serve application: one ingress deployment and N engine replicas.

::

    HTTP ─▶ Serve proxy ─▶ Ingress (build_app: the same OpenAI API, handlers, errors as one server;
                           tokenizes and renders chat templates once; /metrics, /stats, /dashboard
                           of the cluster)
                             │ RemoteEngine: handle.generate(EngineRequest) — the engine
                             │ deployment's request router (``ray_router``) picks the replica
                             ▼
                           EngineReplica × N (LLMEngine + AsyncEngine; KV events on
                           tcp://<node-ip>:*, advertised with its stats through
                           ``record_routing_stats``)

Each replica streams ``ACCEPTED`` and then the request's outputs (``protocol.py``); closing the
stream (client gone, timeout, drain) cancels the replica's generator, which aborts the request.
Naming or releasing a retention session goes to every replica (``SessionCall``, pinned by the
router), since any of them may hold it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from prefixserve.api.async_engine import AsyncEngine
from prefixserve.api.dashboard import stats as engine_stats
from prefixserve.api.frontend.gate import drain
from prefixserve.api.frontend.protocol import APIError
from prefixserve.api.metrics import ServerMetrics
from prefixserve.api.server import ServerConfig, build_app
from prefixserve.core.errors import InvalidArgumentError, PrefixServeError, require
from prefixserve.engine.preprocessor import StepLimits
from prefixserve.kv.tiers.secret import new_secret
from prefixserve.scale_out.cluster import ClusterView, cluster_router
from prefixserve.scale_out.protocol import (
    ACCEPTED,
    EngineRequest,
    KVEventsEndpoint,
    ReplicaReport,
    SessionCall,
)
from prefixserve.scale_out.ray_private import request_router_of
from prefixserve.scale_out.ray_router import request_router_config
from prefixserve.scale_out.remote_engine import EngineInfo, RemoteEngine
from prefixserve.scale_out.router import ROUTERS, RouterConfig

logger = logging.getLogger(__name__)

ENGINE_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "Ingress"
MAX_INGRESS_REQUESTS = 10_000  # HTTP requests one ingress replica handles at once (all async)


@dataclass(frozen=True)
class ScaleOutConfig:
    """How the cluster is laid out. ``replica_num_cpus``: Ray CPUs per engine replica (also its
    torch threads, at least 1). ``stats_period_s``: how often replicas report stats and their
    KV-event endpoint (the router follows the events themselves as they come)."""

    replicas: int = 2
    router: str = "prefix"
    ray_address: str | None = None
    replica_num_cpus: float = 1.0
    router_config: RouterConfig = field(default_factory=RouterConfig)
    stats_period_s: float = 1.0
    app_name: str = "prefixserve"

    def __post_init__(self) -> None:
        require(self.replicas >= 1, "replicas", f"must be >= 1, got {self.replicas}")
        require(self.router in ROUTERS, "router", f"must be one of {ROUTERS}, got {self.router!r}")
        require(self.replica_num_cpus > 0, "replica_num_cpus", "must be > 0")
        require(self.stats_period_s > 0, "stats_period_s", "must be > 0 seconds")

    @property
    def torch_threads(self) -> int:
        return max(1, int(self.replica_num_cpus))


class EngineReplica:
    """One engine behind a Serve replica: ``generate`` streams a request, ``describe`` tells the
    ingress about the model, ``record_routing_stats`` reports stats and the KV-event endpoint."""

    async def __init__(
        self, engine_kwargs: dict[str, Any], server_config: ServerConfig, scale: ScaleOutConfig
    ) -> None:
        import ray
        import torch

        from prefixserve.core.config import EngineConfig
        from prefixserve.engine.llm_engine import LLMEngine

        torch.set_num_threads(scale.torch_threads)
        self.node_ip = ray.util.get_node_ip_address()
        local = f"tcp://{self.node_ip}:*"
        config = EngineConfig(
            **{**engine_kwargs, "kv_events_endpoint": local, "kv_events_replay_endpoint": local}
        )
        # built on the thread that will step it (AsyncEngine.launch: one OpenMP team)
        self.engine = AsyncEngine.launch(lambda: LLMEngine(config))
        llm_engine = self.engine.engine
        publisher = llm_engine.kv_event_publisher
        self.kv_events = KVEventsEndpoint(
            publisher.endpoint, publisher.replay_endpoint, config.block_size
        )
        names = server_config.served_model_names or [llm_engine.model_name]
        self.metrics = ServerMetrics(names[0])
        self.engine.observer = self.metrics.observe_step
        self.engine.max_waiting = server_config.max_waiting_requests
        self.engine.start()
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.info = EngineInfo(
            model_name=llm_engine.model_name,
            max_model_len=llm_engine.max_model_len,
            vocab_size=llm_engine.model_config.vocab_size,
            eos_token_ids=llm_engine.eos_token_ids,
            block_size=config.block_size,
            limits=StepLimits.of(config),
        )
        logger.info("replica %s: KV events on %s", self.replica, self.kv_events.endpoint)

    async def generate(self, request: EngineRequest) -> AsyncIterator[Any]:
        """``ACCEPTED`` and the request's outputs (``protocol.py``), or the error the engine
        refused or failed it with as the last item (yielded, not raised: a refusal is the
        client's 4xx, not a replica fault for Serve to log)."""
        try:
            self.engine.admit(1)
            stream = await self.engine.add(
                request.request_id, request.prompt_token_ids, request.params
            )
        except (PrefixServeError, APIError) as exc:
            yield exc
            return
        yield ACCEPTED
        num_sent = len(request.prompt_token_ids)
        try:
            async for output in stream:
                if len(output.prompt_token_ids) == num_sent:  # else truncated: send them
                    output = replace(output, prompt_token_ids=[])
                yield output
        except APIError as exc:  # the engine failed this request alone
            yield exc
        finally:
            if not stream.finished:
                self.engine.abort(request.request_id)

    async def kv_session(self, call: SessionCall) -> int:
        """Release or rename a retention session of this replica's engine (``SessionCall``);
        the blocks released."""
        if call.op == "release":
            return await self.engine.release_kv(call.session)
        await self.engine.rename_kv(call.session, call.name)
        return 0

    def describe(self) -> EngineInfo:
        return self.info

    def record_routing_stats(self) -> dict[str, Any]:
        report = ReplicaReport(
            replica=self.replica,
            pid=os.getpid(),
            node_ip=self.node_ip,
            kv_events=self.kv_events,
            stats=engine_stats(self.engine, self.metrics),
            metrics=self.metrics.render(self.engine.snapshot()).decode(),
        )
        return report.to_dict()

    def check_health(self) -> None:
        if self.engine.dead is not None:
            raise RuntimeError(f"the engine loop died: {self.engine.dead!r}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()


@serve.ingress()
class Ingress:
    """The HTTP front: ``build_app`` over a ``RemoteEngine``, plus the cluster's /metrics,
    /stats and /dashboard. ``drain`` is the launcher's SIGTERM path."""

    async def __init__(
        self,
        replicas: DeploymentHandle,
        engine_kwargs: dict[str, Any],
        server_config: ServerConfig,
        scale: ScaleOutConfig,
    ) -> None:
        from prefixserve.models.loader import load_tokenizer

        info: EngineInfo = await replicas.describe.remote()  # also builds the router here
        model = engine_kwargs.get("tokenizer") or engine_kwargs.get("model")
        tokenizer = load_tokenizer(model, revision=engine_kwargs.get("revision"))
        self.config = server_config
        names = server_config.served_model_names or [info.model_name]
        self.view = ClusterView(lambda: request_router_of(replicas), names[0], scale.router)
        self.engine = RemoteEngine(replicas, tokenizer, info, server_config.max_waiting_requests,
                                   replica_ids=self.view.replica_ids)  # fmt: skip
        self.fastapi_app = None

    def __serve_build_asgi_app__(self):
        self.fastapi_app = build_app(self.engine, self.config)
        self.fastapi_app.include_router(cluster_router(self.view))
        return self.fastapi_app

    async def drain(self, grace_seconds: float) -> None:
        """Refuse new requests (503), give those in flight ``grace_seconds``, abort the rest."""
        await drain(self.fastapi_app, grace_seconds)


def build_application(
    engine_kwargs: dict[str, Any], server_config: ServerConfig, scale: ScaleOutConfig
) -> serve.Application:
    """The Serve application of ``scale.replicas`` engine replicas behind one ingress."""
    if engine_kwargs.get("kv_events_endpoint") or engine_kwargs.get("kv_events_replay_endpoint"):
        raise InvalidArgumentError(
            "kv_events_endpoint: with replicas each engine publishes on tcp://<its node IP>:* "
            "and advertises the port to the router; drop --kv-events-endpoint",
            "kv_events_endpoint",
        )
    if engine_kwargs.get("kv_shared_url") and not engine_kwargs.get("kv_tier_secret"):
        # the replicas read each other's blocks only under one secret (kv/tiers/secret.py)
        engine_kwargs = {**engine_kwargs, "kv_tier_secret": new_secret()}
    grace = server_config.shutdown_grace_seconds + 5.0
    replica = serve.deployment(EngineReplica, name=ENGINE_DEPLOYMENT).options(
        num_replicas=scale.replicas,
        ray_actor_options={"num_cpus": scale.replica_num_cpus},
        max_ongoing_requests=server_config.max_waiting_requests
        + engine_kwargs.get("max_num_seqs", 256),
        request_router_config=request_router_config(
            scale.router,
            engine_kwargs.get("block_size", 16),
            scale.stats_period_s,
            scale.router_config,
        ),
        graceful_shutdown_timeout_s=grace,
    )
    ingress = serve.deployment(Ingress, name=INGRESS_DEPLOYMENT).options(
        num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=MAX_INGRESS_REQUESTS,
        graceful_shutdown_timeout_s=grace,
    )
    return ingress.bind(
        replica.bind(engine_kwargs, server_config, scale), engine_kwargs, server_config, scale
    )
