"""The ingress's view of the cluster: /metrics, /stats and /dashboard over every replica.

Each replica reports, through Ray Serve's ``record_routing_stats`` (every
``request_routing_stats_period_s``), its ``/stats`` figures and its Prometheus text; the engine
deployment's router in the ingress process holds the latest reports and its own decisions (the
ingress passes a function that finds it: ``ray_private.request_router_of`` on its handle).
Nothing here calls a replica, so a scrape costs no replica time.

- /metrics: every replica's prefixserve metrics with a ``replica`` label, then the router's
  ``prefixserve_router_requests_total{replica, reason}``,
  ``prefixserve_router_predicted_hit_tokens_total{replica}`` and gauges of its load and mirror.
- /stats: the keys of one server's /stats, summed over the replicas (hit rate and TTFT mean
  recomputed), plus ``replicas`` (each one's figures and the router's decisions for it) and
  ``router``.
- /dashboard: a page that polls /stats and shows both.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from prefixserve.scale_out.protocol import ReplicaReport
from prefixserve.scale_out.reporting_router import ReportingRouter

_PAGE = Path(__file__).parent / "cluster_dashboard.html"
_SUMMED = (
    "prefix_cache_queries", "prefix_cache_hits", "num_blocks", "free_blocks", "cached_blocks",
    "used_blocks", "evictions", "cow_copies", "num_requests_running", "num_requests_waiting",
    "num_preemptions", "prompt_tokens", "generation_tokens", "ttft_count",
)  # fmt: skip
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


class ClusterView:
    """Reads the engine deployment's router in this process: ``router()`` returns it, or None
    until it exists (then every figure is empty)."""

    def __init__(
        self,
        router: Callable[[], ReportingRouter | None],
        model_name: str,
        router_name: str,
    ) -> None:
        self.router = router
        self.model_name, self.router_name = model_name, router_name

    def reports(self) -> dict[str, ReplicaReport]:
        router = self.router()
        if router is None:
            return {}
        return {k: r for k, r in sorted(router.replica_reports().items()) if r is not None}

    def replica_ids(self) -> list[str]:
        """The ids of the replicas running now (none before the router exists)."""
        router = self.router()
        return [] if router is None else sorted(router.replica_reports())

    def decisions(self) -> dict[str, dict[str, Any]]:
        router = self.router()
        return router.decisions() if router is not None else {}

    def stats(self) -> dict[str, Any]:
        reports, decisions = self.reports(), self.decisions()
        totals = {key: sum(r.stats.get(key, 0) for r in reports.values()) for key in _SUMMED}
        queries = totals["prefix_cache_queries"]
        totals["hit_rate"] = totals["prefix_cache_hits"] / queries if queries else 0.0
        ttft_sum = sum(r.stats.get("ttft_mean_s", 0.0) * r.stats.get("ttft_count", 0)
                       for r in reports.values())  # fmt: skip
        totals["ttft_mean_s"] = ttft_sum / totals["ttft_count"] if totals["ttft_count"] else 0.0
        recent = [r.stats.get("ttft_recent_s", 0.0) for r in reports.values()]
        totals["ttft_recent_s"] = max(recent, default=0.0)
        replicas = [
            {"replica": key, "pid": r.pid, "node_ip": r.node_ip, **r.stats,
             "router": decisions.get(key, {})}
            for key, r in reports.items()
        ]  # fmt: skip
        return {
            "time": time.time(),
            "model": self.model_name,
            **totals,
            "router": self.router_name,
            "replicas": replicas,
            "decisions": decisions,
        }

    def render_metrics(self) -> bytes:
        registry = CollectorRegistry()
        registry.register(_ClusterCollector(self))
        return generate_latest(registry)


class _ClusterCollector(Collector):
    def __init__(self, view: ClusterView) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for replica, report in self.view.reports().items():
            for family in text_string_to_metric_families(report.metrics):
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(
                        family.name, family.documentation, family.type, family.unit
                    )
                for s in family.samples:
                    merged.add_sample(s.name, {**s.labels, "replica": replica}, s.value,
                                      s.timestamp, s.exemplar)  # fmt: skip
        yield from families.values()
        yield from self._router_metrics()

    def _router_metrics(self) -> Iterator[Metric]:
        model = self.view.model_name
        requests = CounterMetricFamily(
            "prefixserve_router_requests",
            "Requests the router sent to each replica, by reason (prefix|load|cold, or the "
            "baseline router's name).",
            labels=["model_name", "replica", "reason"],
        )
        hits = CounterMetricFamily(
            "prefixserve_router_predicted_hit_tokens",
            "Prompt tokens the router expected the chosen replica to hold.",
            labels=["model_name", "replica"],
        )
        load = GaugeMetricFamily(
            "prefixserve_router_load_tokens",
            "Tokens of work the router sent to each replica that have not finished.",
            labels=["model_name", "replica"],
        )
        mirrored = GaugeMetricFamily(
            "prefixserve_router_mirrored_blocks",
            "Blocks the router believes each replica holds (KV events plus predictions).",
            labels=["model_name", "replica"],
        )
        for replica, entry in sorted(self.view.decisions().items()):
            for reason, count in sorted(entry["requests"].items()):
                requests.add_metric([model, replica, reason], count)
            hits.add_metric([model, replica], entry.get("predicted_hit_tokens", 0))
            load.add_metric([model, replica], entry.get("load_tokens", 0))
            mirrored.add_metric([model, replica], entry.get("mirrored_blocks", 0))
        yield from (requests, hits, load, mirrored)


def cluster_router(view: ClusterView) -> APIRouter:
    router = APIRouter()
    page = _PAGE.read_text(encoding="utf-8")

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(view.render_metrics(), media_type=PROMETHEUS_TEXT)

    @router.get("/stats")
    async def stats() -> dict:
        return view.stats()

    @router.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> str:
        return page

    return router
