"""The KV tiers through the server: the flags, /metrics (per ``medium``) and /stats."""

from __future__ import annotations

import httpx
from servers import MODEL, launch_server, metric, scrape


def test_tier_flags_metrics_and_stats(tmp_path):
    prompts = [
        f"session {i}: " + "a long shared system prompt for one agent " * 12 for i in range(6)
    ]
    with launch_server(
        "--num-kv-blocks", "24", "--kv-offloading-size", "0.05",
        "--kv-cache-dir", str(tmp_path), "--kv-cache-dir-size", "1",
    ) as base:  # fmt: skip
        for _ in range(2):
            for prompt in prompts:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
                assert (
                    httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 200
                )
        samples = scrape(base)
        stats = httpx.get(f"{base}/stats").json()
    hits = {m: metric(samples, "prefixserve_kv_tier_hits_total", medium=m)
            for m in ("CPU_TIER", "DISK")}  # fmt: skip
    assert sum(hits.values()) > 0
    assert metric(samples, "prefixserve_kv_tier_blocks", medium="DISK") > 0
    assert metric(samples, "prefixserve_kv_tier_available", medium="DISK") == 1
    assert metric(samples, "prefixserve_kv_tier_promotions_total") == sum(hits.values())
    assert metric(samples, "prefixserve_kv_retained_blocks") == 0
    tiers = stats["kv_tiers"]["tiers"]
    assert set(tiers) == {"CPU_TIER", "DISK"} and tiers["DISK"]["hits"] == hits["DISK"]
    assert list(tmp_path.rglob("*.kvb"))
