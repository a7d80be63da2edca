"""Smoke test of the KV-memory benchmarks: their ``--quick`` runs end to end on the built-in model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import workloads  # noqa: E402
from kv_memory import sharing as sharing_savings  # noqa: E402
from kv_memory import waste as kv_waste  # noqa: E402


def test_length_distributions_are_seeded_clipped_and_keep_their_means():
    for dist in workloads.DISTRIBUTIONS.values():
        pairs = workloads.sample_lengths(dist, 4000, seed=1, max_model_len=4096)
        assert pairs == workloads.sample_lengths(dist, 4000, seed=1, max_model_len=4096)
        assert all(n_in >= 1 and n_out >= 1 and n_in + n_out <= 4096 for n_in, n_out in pairs)
        mean_in = sum(p[0] for p in pairs) / len(pairs)
        mean_out = sum(p[1] for p in pairs) / len(pairs)
        assert abs(mean_in / dist.input_mean - 1) < 0.1
        assert abs(mean_out / dist.output_mean - 1) < 0.1


def test_sharing_savings_quick(tmp_path):
    results = sharing_savings.main(["--quick", "--out-dir", str(tmp_path)])
    assert len(results) == len(workloads.DISTRIBUTIONS) * 2 * len(sharing_savings.WIDTHS)
    for r in results:
        assert 0 < r.peak_with <= r.peak_without
        assert r.avg_saving_pct > 0  # the prompt's blocks are shared by every fork
    report = json.loads((tmp_path / "sharing_savings.json").read_text())
    assert len(report["results"]) == len(results)
    assert (tmp_path / "sharing_savings.png").stat().st_size > 0


def test_kv_waste_quick(tmp_path):
    rows = kv_waste.main(["--quick", "--out-dir", str(tmp_path)])
    paged = {r.scheme: r for r in rows if r.scheme.startswith("paged")}
    assert len(paged) == len(kv_waste.BLOCK_SIZES)
    contiguous_max_len = rows[-2]
    for r in paged.values():
        assert 0 <= r.avg_waste_pct < contiguous_max_len.avg_waste_pct
    report = json.loads((tmp_path / "kv_waste.json").read_text())
    assert len(report["rows"]) == len(rows)
    assert (tmp_path / "kv_waste.png").stat().st_size > 0


def test_parse_sizes_adds_each_size_and_quick_replaces_them_all():
    def parse(argv):
        parser = argparse.ArgumentParser()
        parser.add_argument("--quick", action="store_true")
        return workloads.parse_sizes(
            parser, argv, {"system_len": (1024, 128), "batch_sizes": ([32], [4])}
        )

    args = parse(["--system-len", "7", "--batch-sizes", "1", "2"])
    assert args.system_len == 7 and args.batch_sizes == [1, 2]
    assert parse([]).system_len == 1024 and parse([]).batch_sizes == [32]
    quick = parse(["--quick", "--system-len", "7"])
    assert quick.system_len == 128 and quick.batch_sizes == [4]  # quick wins, as documented
