"""ReportingRouter (counts and reports, over any Ray router base), the cluster view that reads
it, and ``ray_private.request_router_of`` on a handle that has not routed yet. No Ray cluster:
a stand-in base plays Ray's ``RequestRouter`` (``curr_replicas``, the hooks it calls)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from prefixserve.core.sampling_params import SamplingParams
from prefixserve.scale_out.cluster import ClusterView
from prefixserve.scale_out.protocol import EngineRequest, ReplicaReport
from prefixserve.scale_out.reporting_router import ReportingRouter, engine_request


@dataclass
class _Pending:
    args: list[Any]


@dataclass(frozen=True)
class _ReplicaID:
    unique_id: str


@dataclass
class _Replica:
    routing_stats: dict[str, Any]


@dataclass
class _RayRouterStandIn:
    curr_replicas: dict[_ReplicaID, _Replica] = field(default_factory=dict)
    state_kwargs: dict[str, Any] | None = None
    routed: list[str] = field(default_factory=list)

    def initialize_state(self, **kwargs: Any) -> None:
        self.state_kwargs = kwargs

    def on_request_routed(self, pending: Any, replica_id: _ReplicaID, result: Any) -> None:
        self.routed.append(replica_id.unique_id)


class _Baseline(ReportingRouter, _RayRouterStandIn):
    reason = "baseline"


def _request(request_id: str = "r") -> EngineRequest:
    return EngineRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=4))


def _report(replica: str, **stats: Any) -> dict[str, Any]:
    return ReplicaReport(replica, pid=1, node_ip="10.0.0.1", kv_events=None, stats=stats).to_dict()


def test_engine_request_is_found_only_in_a_generate_call() -> None:
    request = _request()
    assert engine_request(_Pending([request])) is request
    assert engine_request(_Pending([])) is None  # describe(), health checks
    assert engine_request(_Pending(["not a request"])) is None
    assert engine_request(None) is None


def test_requests_are_counted_by_replica_and_reason_and_passed_on() -> None:
    router = _Baseline()
    router.initialize_state(threshold=3)
    assert router.state_kwargs == {"threshold": 3}  # the Ray base still gets its kwargs
    a, b = _ReplicaID("a"), _ReplicaID("b")
    for replica in (a, a, b):
        router.on_request_routed(_Pending([_request()]), replica, None)
    router.on_request_routed(_Pending([]), b, None)  # a control call: passed on, not counted
    assert router.routed == ["a", "a", "b", "b"]
    assert router.decisions() == {
        "a": {"requests": {"baseline": 2}, "load_tokens": 0, "predicted_hit_tokens": 0},
        "b": {"requests": {"baseline": 1}, "load_tokens": 0, "predicted_hit_tokens": 0},
    }


def test_replica_reports_are_read_from_routing_stats() -> None:
    router = _Baseline()
    router.initialize_state()
    router.curr_replicas = {_ReplicaID("a"): _Replica(_report("a", prompt_tokens=7)),
                            _ReplicaID("b"): _Replica({})}  # fmt: skip
    reports = router.replica_reports()
    assert reports["b"] is None  # no report yet
    assert reports["a"].stats == {"prompt_tokens": 7}


def test_the_cluster_view_sums_the_routers_reports_and_is_empty_without_one() -> None:
    router = _Baseline()
    router.initialize_state()
    found: list[ReportingRouter | None] = [None]
    view = ClusterView(lambda: found[0], "m", "baseline")
    empty = view.stats()
    assert empty["replicas"] == [] and empty["prompt_tokens"] == 0 and empty["hit_rate"] == 0.0
    router.curr_replicas = {
        _ReplicaID("a"): _Replica(_report("a", prompt_tokens=7, prefix_cache_queries=4,
                                          prefix_cache_hits=1)),
        _ReplicaID("b"): _Replica(_report("b", prompt_tokens=5, prefix_cache_queries=4,
                                          prefix_cache_hits=3)),
    }  # fmt: skip
    router.on_request_routed(_Pending([_request()]), _ReplicaID("b"), None)
    found[0] = router
    stats = view.stats()
    assert stats["prompt_tokens"] == 12 and stats["hit_rate"] == 0.5
    assert [r["replica"] for r in stats["replicas"]] == ["a", "b"]
    assert stats["replicas"][1]["router"]["requests"] == {"baseline": 1}
    assert b'prefixserve_router_requests_total{model_name="m",reason="baseline",replica="b"}' in (
        view.render_metrics()
    )


def test_a_handle_that_has_not_routed_has_no_router_yet() -> None:
    pytest.importorskip("ray.serve")
    from ray.serve.handle import DeploymentHandle

    from prefixserve.scale_out.ray_private import request_router_of

    assert request_router_of(DeploymentHandle("EngineReplica", "prefixserve")) is None
