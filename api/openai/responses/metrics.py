"""Prometheus figures of the Responses front, read at scrape time from its live objects:
continuations by how their prompt was built, truncations, tools not offered, and the store's
size, evictions, rows skipped at start-up and failed writes."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from prefixserve.api.openai.responses.serving import ResponsesServing


class ResponsesCollector(Collector):
    def __init__(self, model_name: str, serving: ResponsesServing) -> None:
        self.model_name = model_name
        self.serving = serving

    def collect(self) -> Iterator[Metric]:
        label, store = [self.model_name], self.serving.store
        continuations = CounterMetricFamily(
            "prefixserve_responses_continuations",
            "Responses requests with previous_response_id, by prompt: token_exact (the stored "
            "ids spliced), rerendered (the template rewrote history) or truncated (truncation "
            "'auto' dropped old turns: a full rendering).",
            labels=["model_name", "kind"],
        )
        for kind, count in self.serving.continuations.items():
            continuations.add_metric([*label, kind], count)
        yield continuations
        for name, doc, value in (
            ("prefixserve_responses_store_entries", "Responses held in the store.", len(store)),
            ("prefixserve_responses_store_bytes", "Bytes the Responses store holds.", store.nbytes),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric(label, value)
            yield gauge
        truncations = CounterMetricFamily(
            "prefixserve_responses_truncations",
            "Responses requests whose input lost its oldest turns to truncation 'auto'.",
            labels=["model_name"],
        )
        truncations.add_metric(label, self.serving.truncations)
        yield truncations
        not_offered = CounterMetricFamily(
            "prefixserve_responses_tools_not_offered",
            "Tools of Responses requests not offered to the model, by type: hosted ones nothing "
            "here can run, and tool_search (every tool is offered up front).",
            labels=["model_name", "type"],
        )
        for kind, count in sorted(self.serving.tools_not_offered.items()):
            not_offered.add_metric([*label, kind], count)
        yield not_offered
        for name, doc, value in (
            ("prefixserve_responses_store_evictions",
             "Stored responses dropped for the store's entry, byte or age limit.", store.evictions),
            ("prefixserve_responses_store_skipped_rows",
             "Rows of the store's file skipped at start-up because they did not decode.",
             store.skipped_rows),
            ("prefixserve_responses_store_write_failures",
             "store: true responses the store's file could not commit (sent with store: false).",
             store.write_failures),
        ):  # fmt: skip
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric(label, value)
            yield counter
