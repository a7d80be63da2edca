"""The /dashboard page in a real headless browser: it polls /stats and shows figures equal to
/metrics. Skipped when Debian's chromium is not installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from servers import MODEL, launch_server, metric, scrape

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)"
)


def chromium(tmp_path, url: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--virtual-time-budget=3000",
        *extra,
        url,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=90)


def figure(dom: str, element_id: str) -> str:
    match = re.search(rf'id="{element_id}" data-value="([^"]*)"', dom)
    assert match, f"#{element_id} not found in the page"
    return match.group(1)


def test_dashboard_shows_the_metrics(tmp_path):
    with launch_server() as base:
        shared = "A long shared system prompt for the dashboard test. " * 4
        for i in range(3):
            r = httpx.post(
                f"{base}/v1/completions",
                timeout=60,
                json={"model": MODEL, "prompt": shared + f"question {i}", "max_tokens": 4},
            )
            assert r.status_code == 200
        page = httpx.get(f"{base}/dashboard")
        assert (
            page.status_code == 200
            and "<canvas" in page.text
            and "http" not in page.text.split("<script>")[1]
        )
        samples = scrape(base)
        dom = chromium(tmp_path, f"{base}/dashboard", "--dump-dom").stdout
        shot = tmp_path / "dashboard.png"
        chromium(tmp_path, f"{base}/dashboard", f"--screenshot={shot}", "--window-size=1280,1000")
    assert 'data-ready="true"' in dom, dom[:2000]
    hits = metric(samples, "prefixserve_prefix_cache_hits_total")
    assert hits > 0
    assert float(figure(dom, "prefix-cache-hits")) == hits
    assert float(figure(dom, "prefix-cache-queries")) == metric(
        samples, "prefixserve_prefix_cache_queries_total"
    )
    assert float(figure(dom, "generation-tokens")) == metric(
        samples, "prefixserve_generation_tokens_total"
    )
    for state in ("free", "cached", "used"):
        assert float(figure(dom, f"{state}-blocks")) == metric(
            samples, "prefixserve_kv_blocks", state=state
        )
    assert float(figure(dom, "running")) == 0
    assert float(figure(dom, "ttft")) > 0
    assert shot.exists() and shot.stat().st_size > 1000
    grafana = (
        Path(__file__).resolve().parent.parent / "examples" / "grafana" / "prefixserve.json"
    ).read_text()
    exposed = {key.split("{")[0] for key in samples}
    referenced = set(
        re.findall(
            r"prefixserve_[a-z0-9_]+",
            "".join(t["expr"] for p in json.loads(grafana)["panels"] for t in p["targets"]),
        )
    )
    assert referenced and referenced <= exposed, referenced - exposed
