"""What the ingress, the engine replicas and the router exchange (all plain, picklable data).

::

    ingress ── EngineRequest ──▶ router (reads it in the ingress process) ──▶ replica.generate
    ingress ◀── ACCEPTED, then RequestOutput ... (the last one finished) ◀──┘
    replica.record_routing_stats() ── ReplicaReport (as a dict) ──▶ Serve ──▶ router, every period
    ingress ── SessionCall per replica ──▶ router (pins it to its replica) ──▶ replica.kv_session

A replica answers ``generate`` with ``ACCEPTED`` once its engine took the request, then the
request's ``RequestOutput`` s in its output kind (DELTA when streamed: each only what is new)
up to the finished one, their ``prompt_token_ids`` left
empty when they are the ids the ingress sent (a prompt is never empty), to keep each message small. An exception in the stream is its last
item: the error the engine refused the request with (before ``ACCEPTED``: a 4xx or 503) or failed
it with. An exception *raised* by the stream means the replica itself, or the way to it, failed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from prefixserve.core.sampling_params import BeamSearchParams, SamplingParams

ACCEPTED = "accepted"
"""First item of every ``generate`` stream: the replica's engine accepted the request."""


@dataclass(slots=True)
class EngineRequest:
    """One engine request, prepared once by the ingress (chat template and truncation included:
    ``prompt_token_ids`` are the ids the engine keeps).

    ``prompt`` is for routers that match text (Ray's ``PrefixCacheAffinityRouter`` reads a
    ``prompt`` attribute): one character per token id, so its character prefixes are exactly the
    token prefixes and nothing is detokenized.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    routing_key: str | None = None  # the router's affinity key (``router.with_affinity``)

    @property
    def prompt(self) -> str:
        return "".join(map(chr, self.prompt_token_ids))

    @property
    def uses_prefix_cache(self) -> bool:
        """False for a request that scores its prompt (``prompt_logprobs``): the engine computes
        every prompt position, so no replica's cache saves it anything."""
        return getattr(self.params, "prompt_logprobs", None) is None

    @property
    def cache_salt(self) -> str | None:
        return self.params.cache_salt

    @property
    def num_output_tokens(self) -> int:
        """Tokens the request may generate in all (``max_tokens`` per sequence), or 0 if unset."""
        width = getattr(self.params, "beam_width", None) or getattr(self.params, "n", 1)
        return (self.params.max_tokens or 0) * width


@dataclass(frozen=True, slots=True)
class SessionCall:
    """Release (``op`` "release") or rename to ``name`` (``op`` "rename") the retention session
    ``session`` on replica ``replica`` (its id); the router sends it to that replica only. A
    replica that holds no such session does nothing, so the ingress sends one to every replica
    rather than track which holds what. ``kv_session`` answers the blocks released (0 for a
    rename)."""

    replica: str
    op: str
    session: str
    name: str | None = None


@dataclass(frozen=True, slots=True)
class KVEventsEndpoint:
    """Where one replica publishes its KV events (ZMQ PUB, and the replay ROUTER)."""

    endpoint: str
    replay_endpoint: str | None
    block_size: int


@dataclass(slots=True)
class ReplicaReport:
    """What a replica returns from ``record_routing_stats``: its KV-event endpoint, its stats
    (``/stats`` keys of one engine) and its Prometheus exposition text. Sent as a dict."""

    replica: str
    pid: int
    node_ip: str
    kv_events: KVEventsEndpoint | None
    stats: dict[str, Any] = field(default_factory=dict)
    metrics: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> ReplicaReport | None:
        """The report in a replica's ``routing_stats``; None before its first report."""
        if not data or "replica" not in data:
            return None
        events = data.get("kv_events")
        return cls(
            replica=data["replica"],
            pid=data["pid"],
            node_ip=data["node_ip"],
            kv_events=KVEventsEndpoint(**events) if events else None,
            stats=data.get("stats") or {},
            metrics=data.get("metrics") or "",
        )
