"""GET /dashboard (a self-contained HTML page) and GET /stats (the JSON it polls every second).

/stats reads the same engine snapshot as /metrics, so the figures on the page equal the scraped
ones at the same moment. Rates over time (tokens/s, windowed hit rate) are computed in the page
from successive polls.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse

from prefixserve.api.async_engine import AsyncEngine
from prefixserve.api.metrics import ServerMetrics

_PAGE = Path(__file__).parent / "static" / "dashboard.html"


def stats(engine: AsyncEngine, metrics: ServerMetrics) -> dict:
    """Current engine figures: cache counters in tokens, blocks by state, queues, token totals, TTFT,
    the engine's steps with their cumulative seconds by phase (``EngineStats.step_times``), and
    how decode steps replay (``EngineStats.decode_replay``: compile or capture seconds)."""
    snap = engine.snapshot()
    ttft_sum, ttft_count = metrics.ttft_totals()
    recent = metrics.recent_ttft()
    return {
        "time": time.time(),
        "model": metrics.model_name,
        **snap.kv_cache,
        "num_requests_running": snap.num_running,
        "num_requests_waiting": snap.num_waiting,
        "num_preemptions": snap.num_preemptions,
        "prompt_tokens": snap.prompt_tokens,
        "generation_tokens": snap.generation_tokens,
        "ttft_count": int(ttft_count),
        "ttft_mean_s": ttft_sum / ttft_count if ttft_count else 0.0,
        "ttft_recent_s": sum(recent) / len(recent) if recent else 0.0,
        "spec_decode": snap.spec_decode,  # None when speculative decoding is off
        "kv_tiers": snap.kv_tiers,  # None without tiers under the KV pool
        "num_steps": snap.num_steps,
        "step_times": dataclasses.asdict(snap.step_times),
        "decode_replay": snap.decode_replay,  # None when decode steps run eagerly
    }


def dashboard_router(
    engine: AsyncEngine, metrics: ServerMetrics, *extras: Callable[[], dict]
) -> APIRouter:
    """``extras``: more figures for /stats, each a callable giving a dict (a protocol front's
    own figures, shown in its card on the page)."""
    router = APIRouter()
    page = _PAGE.read_text(encoding="utf-8")

    @router.get("/dashboard", response_class=HTMLResponse)
    async def dashboard() -> str:
        return page

    @router.get("/stats")
    async def get_stats() -> dict:
        out = stats(engine, metrics)
        for extra in extras:
            out.update(extra())
        return out

    return router
