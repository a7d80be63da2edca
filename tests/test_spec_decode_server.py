"""``prefixserve serve --speculative-config``: the server speculates, /metrics and /stats show the
same counters, and beam search is refused with a 400."""

from __future__ import annotations

import json

import httpx
from servers import MODEL, launch_server, metric, scrape

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}


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


def test_server_without_the_flag_does_not_speculate():
    with launch_server() as base:
        samples = scrape(base)
        assert httpx.get(f"{base}/stats").json()["spec_decode"] is None
    assert not any(key.startswith("prefixserve_spec_decode") for key in samples)
