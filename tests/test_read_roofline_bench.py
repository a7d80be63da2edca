"""benchmarks/read_roofline: the C++ reader builds, runs the variants asked for, and reports each
as one JSON line whose figures agree with one another (GB/s from the best pass over 538 MB)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import read_roofline

WEIGHT_BYTES = 538  # MB a pass reads: SmolLM2-135M's float32 weights, as the C++ file lays out


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_the_reader_runs_the_variants_asked_for_and_reports_consistent_figures(tmp_path):
    binary = read_roofline.build(tmp_path)
    rows = read_roofline.roofline(binary, "2M", 2, "flat-sum,halves-sum-sticky")
    names = {r["name"] for r in rows}  # the variants whose names contain one of those asked
    assert "flat-sum" in names and any(n.startswith("halves-sum-sticky") for n in names)
    assert all("flat-sum" in n or "halves-sum-sticky" in n for n in names)
    for row in rows:
        assert row["pages"] == "2M" and 0 < row["best_ms"] <= row["median_ms"]
        assert row["best_gbs"] == pytest.approx(WEIGHT_BYTES / row["best_ms"], rel=0.05)
