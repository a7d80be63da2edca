"""Prometheus metrics of one server (one registry per app; nothing module-global).

Engine totals (prefix-cache tokens, blocks, evictions, copies, queue sizes, token counts) are
rendered at scrape time from the engine thread's latest ``EngineStats`` by a custom collector, so
they equal the engine's own figures exactly. Latency histograms and per-finish-reason successes are observed on
the engine thread as outputs come out of ``step()``.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from prefixserve.core.outputs import RequestProgress
from prefixserve.engine.llm_engine import EngineStats

STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar", "tool_calls")
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
RECENT_TTFT = 64


class _EngineCollector(Collector):
    def __init__(self, model_name: str, stats: EngineStats) -> None:
        self.model_name = model_name
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        cache, label = s.kv_cache, [self.model_name]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(label, value)
            return family

        yield counter(
            "prefixserve_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            cache["prefix_cache_queries"],
        )
        yield counter(
            "prefixserve_prefix_cache_hits",
            "Prompt tokens served from the prefix cache.",
            cache["prefix_cache_hits"],
        )
        used_ratio = cache["used_blocks"] / cache["num_blocks"] if cache["num_blocks"] else 0.0
        yield gauge(
            "prefixserve_kv_cache_usage_ratio",
            "Fraction of KV blocks referenced by requests.",
            used_ratio,
        )
        blocks = GaugeMetricFamily(
            "prefixserve_kv_blocks", "KV blocks by state.", labels=["model_name", "state"]
        )
        for state in ("free", "cached", "used"):
            blocks.add_metric([self.model_name, state], cache[f"{state}_blocks"])
        yield blocks
        yield counter(
            "prefixserve_kv_evictions", "Cached KV blocks evicted for reuse.", cache["evictions"]
        )
        yield counter(
            "prefixserve_kv_cow_copies", "Copy-on-write block copies.", cache["cow_copies"]
        )
        yield counter(
            "prefixserve_prefix_cache_tail_hits",
            "Admissions whose cached prefix ended in a partial tail block (copied, not recomputed).",
            cache["tail_hits"],
        )
        yield counter(
            "prefixserve_prefix_cache_tail_hit_tokens",
            "Prompt tokens served from partial tail blocks (part of prefix_cache_hits).",
            cache["tail_hit_tokens"],
        )
        yield gauge(
            "prefixserve_num_requests_running", "Requests in the running batch.", s.num_running
        )
        yield gauge(
            "prefixserve_num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting
        )
        yield counter("prefixserve_num_preemptions", "Preemptions (recompute).", s.num_preemptions)
        yield counter("prefixserve_prompt_tokens", "Prompt tokens received.", s.prompt_tokens)
        yield counter("prefixserve_generation_tokens", "Tokens generated.", s.generation_tokens)
        yield from self._structured_outputs()
        yield from self._spec_decode()
        yield from self._kv_tiers()
        yield from self._segments()

    def _segments(self) -> Iterator[Metric]:
        """Segment reuse (``--segment-reuse``): none when it is off."""
        yield from self._kv_cache_families((
            ("prefixserve_segment_lookups", "Prompt segments looked up in the segment index.",
             "segment_lookups", CounterMetricFamily),
            ("prefixserve_segment_hits", "Prompt segments found (their K/V reused).",
             "segment_hits", CounterMetricFamily),
            ("prefixserve_segment_reused_tokens", "Prompt tokens whose K/V was copied from a "
             "reused segment instead of computed.", "segment_reused_tokens", CounterMetricFamily),
            ("prefixserve_segment_entries", "Segments in the segment index now.",
             "segment_entries", GaugeMetricFamily),
        ))  # fmt: skip

    def _kv_cache_families(self, rows) -> Iterator[Metric]:
        """One family per ``(name, doc, kv_cache key, kind)`` row whose key the stats have."""
        cache = self.stats.kv_cache
        for name, doc, key, kind in rows:
            if key in cache:
                family = kind(name, doc, labels=["model_name"])
                family.add_metric([self.model_name], cache[key])
                yield family

    def _kv_tiers(self) -> Iterator[Metric]:
        """Per tier under the KV pool (label ``medium``: CPU_TIER, DISK, SHARED), retention, and
        promotions/demotions; none without tiers (retention figures always)."""
        label = self.model_name
        yield from self._kv_cache_families((
            ("prefixserve_kv_retained_blocks", "Block hashes retained now (soft priority).",
             "retained_blocks", GaugeMetricFamily),
            ("prefixserve_kv_retention_expiries", "Retentions that expired.",
             "retention_expiries", CounterMetricFamily),
            ("prefixserve_kv_retention_released", "Retained blocks released by their session.",
             "retention_released", CounterMetricFamily),
            ("prefixserve_kv_retention_sessions", "Retention sessions (tenant and prefix) now.",
             "retention_sessions", GaugeMetricFamily),
            ("prefixserve_kv_retention_refused", "Retentions refused past the tenant's share.",
             "retention_refused", CounterMetricFamily),
            ("prefixserve_kv_retention_revoked", "Retained blocks taken back for another "
             "tenant's share.", "retention_revoked", CounterMetricFamily),
            ("prefixserve_kv_retention_dropped", "Retained blocks that left the pool and every "
             "tier.", "retention_dropped", CounterMetricFamily),
        ))  # fmt: skip
        tiers = self.stats.kv_tiers
        if tiers is None:
            return
        for name, doc, key, kind in (
            ("prefixserve_kv_tier_hits", "Blocks loaded from a tier into the pool.", "hits",
             CounterMetricFamily),
            ("prefixserve_kv_tier_misses", "Tier lookups that found no block (or a bad one).",
             "misses", CounterMetricFamily),
            ("prefixserve_kv_tier_blocks", "Blocks a tier holds (SHARED: written by this engine).",
             "blocks", GaugeMetricFamily),
            ("prefixserve_kv_tier_bytes", "Bytes a tier holds (SHARED: written by this engine).",
             "bytes", GaugeMetricFamily),
            ("prefixserve_kv_tier_stores", "Blocks stored in a tier.", "stores",
             CounterMetricFamily),
            ("prefixserve_kv_tier_store_errors", "Stores a tier refused (full, unreachable).",
             "store_errors", CounterMetricFamily),
            ("prefixserve_kv_tier_corrupt", "Stored blocks that failed a check and were deleted.",
             "corrupt", CounterMetricFamily),
            ("prefixserve_kv_tier_evictions", "Blocks a tier dropped for room.", "evictions",
             CounterMetricFamily),
            ("prefixserve_kv_tier_load_seconds", "Time spent loading blocks from a tier.",
             "load_seconds", CounterMetricFamily),
            ("prefixserve_kv_tier_store_seconds", "Time spent storing blocks in a tier.",
             "store_seconds", CounterMetricFamily),
            ("prefixserve_kv_tier_available", "1 while the tier answers, 0 while it is skipped.",
             "available", GaugeMetricFamily),
        ):  # fmt: skip
            family = kind(name, doc, labels=["model_name", "medium"])
            for medium, counters in tiers["tiers"].items():
                family.add_metric([label, medium], float(counters[key]))
            yield family
        for name, doc, key in (
            ("prefixserve_kv_tier_promotions", "Blocks loaded from the tiers into the pool.",
             "promotions"),
            ("prefixserve_kv_tier_demotions", "Blocks a tier evicted into the tier below.",
             "demotions"),
            ("prefixserve_kv_tier_stores_dropped", "Stores dropped: the tier worker was behind.",
             "stores_dropped"),
        ):  # fmt: skip
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([label], tiers[key])
            yield family

    def _spec_decode(self) -> Iterator[Metric]:
        """Speculative decoding counters and ratios and the suffix index's memory, labelled by
        method (none when it is off)."""
        spec = self.stats.spec_decode
        if spec is None:
            return
        labels = [self.model_name, spec["method"]]
        for name, doc, key, kind in (
            ("prefixserve_spec_decode_num_drafts", "Verifications with draft tokens.",
             "num_drafts", CounterMetricFamily),
            ("prefixserve_spec_decode_num_draft_tokens", "Draft tokens scored.",
             "num_draft_tokens", CounterMetricFamily),
            ("prefixserve_spec_decode_num_accepted_tokens", "Draft tokens accepted.",
             "num_accepted_tokens", CounterMetricFamily),
            ("prefixserve_spec_decode_acceptance_rate", "Accepted / draft tokens.",
             "acceptance_rate", GaugeMetricFamily),
            ("prefixserve_spec_decode_mean_acceptance_length",
             "Tokens per speculating step: 1 + accepted / drafts.", "mean_acceptance_length",
             GaugeMetricFamily),
            ("prefixserve_spec_decode_suffix_index_bytes",
             "Bytes the suffix index holds (an estimate), all tenants.", "suffix_index_bytes",
             GaugeMetricFamily),
            ("prefixserve_spec_decode_suffix_index_entries", "Outputs the suffix index holds.",
             "suffix_index_entries", GaugeMetricFamily),
            ("prefixserve_spec_decode_suffix_index_tenants", "Tenants the suffix index holds.",
             "suffix_index_tenants", GaugeMetricFamily),
        ):  # fmt: skip
            family = kind(name, doc, labels=["model_name", "method"])
            family.add_metric(labels, spec[key])
            yield family

    def _structured_outputs(self) -> Iterator[Metric]:
        so, label = self.stats.structured_outputs, self.model_name
        kinds = CounterMetricFamily(
            "prefixserve_structured_output_requests",
            "Requests with a constrained output, by kind.",
            labels=["model_name", "kind"],
        )
        for kind in STRUCTURED_OUTPUT_KINDS:
            kinds.add_metric([label, kind], so["requests"].get(kind, 0))
        yield kinds
        histogram = so["compile_seconds"]
        compile_seconds = HistogramMetricFamily(
            "prefixserve_grammar_compile_seconds",
            "Time to compile a grammar (cache misses only).",
            labels=["model_name"],
        )
        buckets = [("+Inf" if le == float("inf") else str(le), n) for le, n in histogram["buckets"]]
        compile_seconds.add_metric([label], buckets, histogram["sum"])
        yield compile_seconds
        for name, doc, key in (
            ("prefixserve_grammar_compiles", "Grammars compiled.", "num_compiles"),
            ("prefixserve_grammar_cache_hits",
             "Requests whose grammar was already compiled (one lookup per request, when it "
             "is prepared).", "num_cache_hits"),
        ):  # fmt: skip
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([label], so[key])
            yield family


class ServerMetrics:
    """Per-app metrics. ``observe_step`` runs on the engine thread; the rest on the event loop."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.success = Counter(
            "prefixserve_request_success",
            "Finished requests by finish reason.",
            ["model_name", "finish_reason"],
            registry=self.registry,
        )

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry)

        self.ttft = histogram(
            "prefixserve_time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS
        )
        self.itl = histogram(
            "prefixserve_inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS
        )
        self.e2e = histogram(
            "prefixserve_e2e_request_latency_seconds", "Request latency.", _LATENCY_BUCKETS
        )
        self._lock = threading.Lock()
        self._recent_ttft: deque[float] = deque(maxlen=RECENT_TTFT)
        self._last_token: dict[str, tuple[float, int]] = {}  # request id -> (time, tokens so far)

    def observe_step(self, progress: list[RequestProgress], now: float) -> None:
        """Latencies from the requests a step touched (``OutputProcessor.observer``): time to
        the first output token, between tokens, and of finished requests."""
        for p in progress:
            rid = p.request_id
            last = self._last_token.get(rid)
            if last is None and p.num_output_tokens > 0:
                self.ttft.labels(self.model_name).observe(now - p.arrival_time)
                with self._lock:
                    self._recent_ttft.append(now - p.arrival_time)
            elif last is not None and p.num_output_tokens > last[1]:
                self.itl.labels(self.model_name).observe(now - last[0])
            if p.num_output_tokens > 0:
                self._last_token[rid] = (now, p.num_output_tokens)
            if p.finished:
                self._last_token.pop(rid, None)
                if p.finish_reason is not None and p.finish_reason != "abort":
                    self.success.labels(self.model_name, p.finish_reason).inc()
                    self.e2e.labels(self.model_name).observe(now - p.arrival_time)

    def recent_ttft(self) -> list[float]:
        with self._lock:
            return list(self._recent_ttft)

    def ttft_totals(self) -> tuple[float, float]:
        """(sum of seconds, count) of every time to first token observed."""
        sample_sum = sample_count = 0.0
        for metric in self.ttft.collect():
            for sample in metric.samples:
                if sample.name.endswith("_sum"):
                    sample_sum = sample.value
                elif sample.name.endswith("_count"):
                    sample_count = sample.value
        return sample_sum, sample_count

    def render(self, stats: EngineStats) -> bytes:
        """The exposition text: the engine's figures from ``stats``, then this server's own."""
        engine = CollectorRegistry()
        engine.register(_EngineCollector(self.model_name, stats))
        return generate_latest(engine) + generate_latest(self.registry)
