"""Smoke tests of the benchmark scripts: each ``main`` runs with ``--quick`` on a tiny checkpoint.

They check that every script runs end to end and writes its JSON and PNG, not any speed: performance
claims live in the benchmarks' own output. The HTTP load generator runs against a real
``python -m prefixserve serve`` on the built-in model when the subcommand exists.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint
from tests.servers import server_process

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import bench_model  # noqa: E402
import hf_baselines  # noqa: E402
import multi_turn_agents  # noqa: E402
import rag  # noqa: E402
import report  # noqa: E402
import shared_prefix  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A 2-layer random Llama (256 positions): stands in for the 25M bench model."""
    return make_checkpoint("llama", tmp_path_factory.mktemp("bench-model"), seed=3)


def _common(model: Path, out: Path) -> list[str]:
    return ["--quick", "--model-dir", str(model), "--out-dir", str(out), "--threads", "1"]


def test_optimal_hit_tokens_counts_earlier_prompts_and_finished_outputs() -> None:
    a = bench_model.BenchRequest("a", list(range(40)), 4, submit_time=0.0, finish_time=1.0)
    a.output = [90, 91, 92, 93]
    # shares 32 tokens with a's prompt; its own prompt is 48 tokens long, so up to 32 cached.
    b = bench_model.BenchRequest("b", list(range(32)) + [7] * 16, 4, submit_time=0.5)
    # submitted after a finished: a's prompt + output[:-1] (43 tokens) is there, 2 full blocks
    # and a partial tail of 11 tokens
    c = bench_model.BenchRequest(
        "c", list(range(40)) + [90, 91, 92, 93] + [5] * 20, 4, submit_time=2.0
    )
    # also after a finished, diverging inside a's tail: 2 blocks + 4 tokens; b's prompt left no tail
    d = bench_model.BenchRequest("d", list(range(36)) + [6] * 20, 4, submit_time=2.5)
    for r in (b, c, d):
        r.finish_time = 3.0
    assert report.optimal_hit_tokens([a, b, c, d], block_size=16) == 0 + 32 + 43 + 36
    # capped: one prompt token is always computed
    e = bench_model.BenchRequest("e", list(range(40)), 4, submit_time=4.0, finish_time=5.0)
    assert report.optimal_hit_tokens([a, e], block_size=16) == 0 + 39


def test_bench_model_main_reports_parameters(tiny_model: Path, capsys) -> None:
    info = bench_model.main(["--model-dir", str(tiny_model)])
    assert info["parameters"] > 0
    assert "parameters" in capsys.readouterr().out


def test_hf_baselines_agree_with_prefixserve(tiny_model: Path) -> None:
    result = hf_baselines.main(["--quick", "--model-dir", str(tiny_model), "--threads", "1"])
    for name in ("hf-no-reuse", "hf-prefix-cache"):
        assert result[name]["requests_pct"] == 100.0


@pytest.mark.parametrize(
    ("module", "stem"),
    [(shared_prefix, "shared_prefix"), (multi_turn_agents, "multi_turn_agents"), (rag, "rag")],
)
def test_side_by_side_workloads(module, stem: str, tiny_model: Path, tmp_path: Path) -> None:
    result = module.main(_common(tiny_model, tmp_path))
    assert set(result["systems"]) == {"prefixserve", "hf-no-reuse", "hf-prefix-cache"}
    assert (tmp_path / f"{stem}.png").stat().st_size > 0
    saved = json.loads((tmp_path / f"{stem}.json").read_text())
    assert saved["quick"] is True
    pc = saved["prefix_cache"]
    assert 0 < pc["hit_tokens"] <= pc["optimal_hit_tokens"]
    assert saved["ratios"]["prefixserve/hf-no-reuse"] > 0
    if stem == "shared_prefix":
        assert saved["cached_vs_uncached_ttft"]["ttft_ms_cached"] > 0
    table = report.main(["--results-dir", str(tmp_path)])
    assert "| prefixserve |" in table


def test_hf_prefix_cache_server_starts_every_run_cold(tiny_model: Path) -> None:
    """A second run of the prefix-cache baseline prefills its prefixes again (no reuse across
    runs, as prefixserve's cache is reset between rounds)."""
    model = bench_model.load_hf_model(tiny_model)
    server = hf_baselines.HFServer(model, 2, hf_baselines.pad_token_id(model), {"g": 16})
    prefills = []
    forward = model.forward

    def counting_forward(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None and ids.shape[1] == 16:
            prefills.append(1)
        return forward(*args, **kwargs)

    model.forward = counting_forward
    prompt = list(range(20, 36)) + [40, 41]
    for _ in range(2):
        server.run([bench_model.BenchRequest("r", prompt, 2, group="g")])
    assert len(prefills) == 2


def test_rounds_start_cold_and_report_the_median(tiny_model: Path, tmp_path: Path) -> None:
    """--repeats 3: every round runs every system; prefixserve's cache is reset between rounds,
    so each round hits exactly as much; the quoted figures are the median-time run's."""
    result = shared_prefix.main([*_common(tiny_model, tmp_path), "--repeats", "3"])
    walls = result["wall_s_per_round"]
    assert all(len(w) == 3 for w in walls.values())
    hits = result["hit_tokens_per_round"]
    assert hits == [result["prefix_cache"]["hit_tokens"]] * 3
    for name, w in walls.items():
        assert result["systems"][name]["wall_s"] == sorted(w)[1]
    ratio = result["ratios"]["prefixserve/hf-no-reuse"]
    per_round = result["ratios_per_round"]["prefixserve/hf-no-reuse"]
    assert min(per_round) <= ratio * (1 + 1e-9) and ratio <= max(per_round) * (1 + 1e-9)


@pytest.fixture(scope="module")
def server_url():
    """``python -m prefixserve serve`` on the built-in model, on a free port."""
    with server_process() as (_, url):
        yield url


@pytest.mark.parametrize(
    "extra", [["--workload", "shared_prefix"], ["--workload", "agents", "--concurrency", "2"]]
)
def test_http_load(server_url: str, extra: list[str], tmp_path: Path) -> None:
    import http_load

    result = http_load.main(
        ["--quick", "--base-url", server_url, "--out-dir", str(tmp_path), *extra]
    )
    summary = result["summary"]
    assert summary["requests_failed"] == 0 and summary["requests_ok"] == 4
    assert summary["ttft_ms"]["p50"] > 0
    assert summary["metrics_prefix_cache"]["hits"] > 0
    assert (tmp_path / "http_load.png").exists()


def test_structured_quick(tmp_path: Path) -> None:
    import structured

    model = make_checkpoint("llama", tmp_path / "model", seed=3, max_position_embeddings=4096)
    result = structured.main(_common(model, tmp_path))
    (row,) = result["overhead"]
    assert row["ms_per_step"]["free"] > 0 and row["ms_per_step"]["constrained"] > 0
    assert result["compile"]["cached_ms"] < result["compile"]["first_ms"]
    jump = result["jump_forward"]
    assert jump["on"]["all_parse"] and jump["off"]["all_parse"]
    assert jump["on"]["steps"] < jump["off"]["steps"]
    for r in result["cache_reach"]:  # each turn reaches at least through the previous prompt
        assert r["optimum"] >= r["cached_tokens"] >= r["previous_prompt_tokens"] // 16 * 16
    assert (tmp_path / "structured.json").exists()
