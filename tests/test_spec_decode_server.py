"""``prefixserve serve --speculative-config``: the server speculates, /metrics and /stats show the
same counters and the suffix index's memory, and beam search is refused with a 400."""

from __future__ import annotations

import json

import httpx
from servers import MODEL, launch_server, metric, scrape

from prefixserve.spec_decode.output_index import BYTES_PER_NGRAM, BYTES_PER_TOKEN

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "draft_row_price": 0.0}  # fmt: skip


def test_server_speculates_and_reports_it():
    with launch_server("--speculative-config", json.dumps(SPEC)) as base:
        prompt = "one two three four five one two three four five one two three"
        r = httpx.post(
            f"{base}/v1/completions",
            timeout=60,
            json={"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0},
        )
        assert r.status_code == 200, r.text
        beam = httpx.post(
            f"{base}/v1/completions",
            timeout=60,
            json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "n": 2,
                  "use_beam_search": True},
        )  # fmt: skip
        assert beam.status_code == 400 and "speculative" in beam.json()["error"]["message"]
        samples = scrape(base)
        stats = httpx.get(f"{base}/stats").json()["spec_decode"]
    drafted = metric(samples, "prefixserve_spec_decode_num_draft_tokens_total", method="ngram")
    assert drafted > 0 and drafted == stats["num_draft_tokens"]
    accepted = metric(samples, "prefixserve_spec_decode_num_accepted_tokens_total", method="ngram")
    assert accepted == stats["num_accepted_tokens"]
    rate = metric(samples, "prefixserve_spec_decode_acceptance_rate", method="ngram")
    assert rate == stats["acceptance_rate"] == accepted / drafted


def test_suffix_index_memory_is_in_metrics_and_stats():
    """Issue 30: the suffix index's global byte bound holds over HTTP (two tenants by
    ``cache_salt``; room for one output), and /metrics reports what it holds."""
    tokens, min_n, max_n = 24, 1, 5
    one_output = tokens * BYTES_PER_TOKEN + sum(tokens - n for n in range(min_n, max_n + 1)) * (
        BYTES_PER_NGRAM
    )
    spec = {"method": "suffix", "num_speculative_tokens": 3, "prompt_lookup_min": min_n,
            "prompt_lookup_max": max_n, "draft_row_price": 0.0,
            "suffix_decoding_max_cached_bytes": one_output + 1000}  # fmt: skip
    with launch_server("--speculative-config", json.dumps(spec)) as base:
        for salt in ("tenant-a", "tenant-b"):
            r = httpx.post(f"{base}/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": "one two three", "max_tokens": tokens,
                "ignore_eos": True, "temperature": 0, "cache_salt": salt})  # fmt: skip
            assert r.status_code == 200, r.text
        samples = scrape(base)
        stats = httpx.get(f"{base}/stats").json()["spec_decode"]
    for key, expected in (("bytes", one_output), ("entries", 1), ("tenants", 1)):
        name = f"prefixserve_spec_decode_suffix_index_{key}"
        assert metric(samples, name, method="suffix") == stats[f"suffix_index_{key}"] == expected


def test_server_without_the_flag_does_not_speculate():
    with launch_server() as base:
        samples = scrape(base)
        assert httpx.get(f"{base}/stats").json()["spec_decode"] is None
    assert not any(key.startswith("prefixserve_spec_decode") for key in samples)
