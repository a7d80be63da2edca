"""Segment reuse over HTTP (``prefixserve serve --segment-reuse``), with the clients RAG pipelines
use, unchanged: documents stuffed into one user turn (LangChain's stuff chain: blank lines
between them) come back in another order and reuse their K/V; usage says so on every protocol
(``cached_tokens`` with its ``reused_segment_tokens`` part; Anthropic's cache reads); a request
opts out with ``"segment_reuse": false`` and anything but a boolean there is a 400; the metrics
and /stats count segment hits."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from servers import MODEL, launch_server, metric, scrape
from test_dashboard import CHROMIUM, chromium, figure

DOCS = [
    f"Report {i}: the station at Vel{i}ra logged {300 + 17 * i} quakes in {1900 + 7 * i}. "
    + "Its keepers wrote long letters about the weather and the supply ships. " * 3
    for i in range(4)
]


def stuffed(order: list[int], question: str) -> str:
    context = "\n\n".join(DOCS[i] for i in order)
    return f"Use the documents.\n\n{context}\n\nQuestion: {question}"


@pytest.fixture(scope="module")
def base():
    with launch_server("--segment-reuse", "--max-model-len", "4096") as url:
        yield url


def test_a_reordered_rag_prompt_reuses_its_documents_on_every_protocol(base):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x")
    first = client.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": stuffed([0, 1, 2], "How many quakes?")}],
    )  # fmt: skip
    assert first.usage.prompt_tokens_details.model_extra["reused_segment_tokens"] == 0
    again = client.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": stuffed([2, 0, 3], "Which year?")}],
    )  # fmt: skip
    details = again.usage.prompt_tokens_details
    reused = details.model_extra["reused_segment_tokens"]
    assert reused > 0 and details.cached_tokens >= reused
    out = again.choices[0].message.content
    assert isinstance(out, str)

    response = client.responses.create(
        model=MODEL, max_output_tokens=4, temperature=0, input=stuffed([1, 0], "When?")
    )
    assert response.usage.input_tokens_details.model_extra["reused_segment_tokens"] > 0

    claude = anthropic.Anthropic(base_url=base, api_key="x")
    message = claude.messages.create(
        model=MODEL, max_tokens=4,
        messages=[{"role": "user", "content": stuffed([3, 2], "Who wrote letters?")}],
    )  # fmt: skip
    assert message.usage.cache_read_input_tokens > 0

    stats = httpx.get(f"{base}/stats").json()
    assert stats["segment_hits"] >= 5 and stats["segment_reused_tokens"] > 0
    samples = scrape(base)
    assert metric(samples, "prefixserve_segment_hits_total") == stats["segment_hits"]
    assert metric(samples, "prefixserve_segment_reused_tokens_total") > 0


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_the_dashboard_shows_segment_hits(base, tmp_path):
    for order in ([1, 3], [3, 1]):
        body = {"model": MODEL, "max_tokens": 1,
                "messages": [{"role": "user", "content": stuffed(order, "Which?")}]}  # fmt: skip
        assert httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).is_success
    dom = chromium(tmp_path, f"{base}/dashboard", "--dump-dom").stdout
    stats = httpx.get(f"{base}/stats").json()
    assert 'data-ready="true"' in dom
    assert float(figure(dom, "segment-hits")) == stats["segment_hits"] > 0
    assert float(figure(dom, "segment-reused-tokens")) == stats["segment_reused_tokens"]


def test_a_request_opts_out_and_a_non_boolean_is_a_400(base):
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0, "segment_reuse": False,
            "messages": [{"role": "user", "content": stuffed([0, 2, 1], "Again?")}]}  # fmt: skip
    r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens_details"]["reused_segment_tokens"] == 0
    routes = {
        "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        "/v1/completions": {"model": MODEL, "prompt": "hi"},
        "/v1/responses": {"model": MODEL, "input": "hi"},
        "/v1/messages": {"model": MODEL, "max_tokens": 2,
                         "messages": [{"role": "user", "content": "hi"}]},
    }  # fmt: skip
    for path, body in routes.items():
        for value in ("no", 1, [], {"on": True}):
            r = httpx.post(f"{base}{path}", json={**body, "segment_reuse": value}, timeout=60)
            assert r.status_code == 400, (path, value, r.text)
            assert "segment_reuse" in r.text
