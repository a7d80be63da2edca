"""Smoke test of benchmarks/kv_tiers.py: the whole run (tiers off, host, disk, shared, optimum,
restart, two replicas, a flood with and without retention) on a tiny checkpoint with ``--quick``; no speed is checked, but every
system must give the tokens the engine without tiers gives."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import kv_tiers


def test_kv_tiers_benchmark_runs_and_is_exact(tmp_path):
    model = make_checkpoint("llama", tmp_path / "model", seed=3)
    out = tmp_path / "out"
    kv_tiers.main(["--quick", "--model-dir", str(model), "--out-dir", str(out), "--threads", "1"])
    results = json.loads((out / "kv_tiers.json").read_text())
    for name in ("off", "host", "disk", "shared", "optimum"):
        assert results[name]["wrong_turns"] == 0
    assert results["host"]["hit_rate"] > results["off"]["hit_rate"]
    assert results["restart"]["wrong_turns"] == 0
    assert results["restart"]["share_of_hits_after_restart"] >= 0.95
    replicas = results["replicas"]
    assert replicas["round_robin_shared"]["hit_rate"] > replicas["round_robin"]["hit_rate"]
    flood = results["flood"]
    assert flood["retained"]["wrong_turns"] == 0
    assert flood["retained"]["hit_rate"] > flood["without"]["hit_rate"]


@pytest.mark.slow
def test_kv_tiers_benchmark_over_http(tmp_path):
    model = make_checkpoint("llama", tmp_path / "model", seed=3)
    out = tmp_path / "out"
    kv_tiers.main(
        ["--quick", "--http", "--no-shared", "--model-dir", str(model), "--out-dir", str(out),
         "--threads", "1"]
    )  # fmt: skip
    results = json.loads((out / "kv_tiers_http.json").read_text())
    assert all(results[name]["wrong_turns"] == 0 for name in ("off", "host", "disk", "optimum"))
    assert results["host"]["hit_rate"] > results["off"]["hit_rate"]
    assert results["restart"]["wrong_turns"] == 0
    assert results["restart"]["share_of_prompt_served_after_restart"] > results["off"]["hit_rate"]
