"""Smoke test of benchmarks/rag_reuse.py on the built-in model: two servers (prefix caching alone
and segment reuse) run the whole workload over HTTP and the report says what was reused. No
speed is checked here; the figures live in docs/segment-reuse.md."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import rag_reuse  # noqa: E402


def test_the_benchmark_runs_and_reports_reuse(tmp_path):
    result = rag_reuse.main([
        "--model", "prefixserve/tiny-random", "--docs", "3", "--per-question", "2",
        "--questions", "3", "--max-tokens", "2", "--ratios", "0.15", "--threads", "1", "--out-dir", str(tmp_path),
    ])  # fmt: skip
    summary = json.loads((tmp_path / "rag_reuse.json").read_text())["summary"]
    assert set(summary) == {"exact", "segments-0.15"} == set(result["summary"])
    assert summary["exact"]["segment_share_of_doc_tokens"] == 0
    assert summary["segments-0.15"]["segment_share_of_doc_tokens"] > 0.2  # some by prefix hits
    assert 0 <= summary["segments-0.15"]["identical_to_exact"] <= 1
