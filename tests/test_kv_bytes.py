"""benchmarks/kv_memory/reads.py (``python benchmarks/kv_memory reads``): K/V bytes per decode step from the engine's plan, against hand counts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

pytest.importorskip("triton")

from kv_memory import reads as kv_bytes


def test_small_case_by_hand() -> None:
    """4 sequences, a 64-token prefix (4 blocks of 16), 16 tokens each (the decoded one last).

    Without cascade each reads 80 tokens: 320. With it the group reads the 64 shared tokens once
    and each member its 16: 64 + 4 * 16 = 128. One token is 2 (K, V) x 2 heads x 8 dims x 2
    bytes = 64 bytes a layer, 3 layers: 192 bytes.
    """
    r = kv_bytes.step_bytes(4, 64, 16, block_size=16, cascade=True, num_layers=3,
                            kv_bytes_per_token=64)  # fmt: skip
    assert r.cascade_groups == 1
    assert (r.bytes_plain, r.bytes_cascade) == (320 * 192, 128 * 192)
    assert r.ratio == r.analytic_ratio == 2.5


def test_heuristic_can_decline() -> None:
    """The Triton backend's rule: 4 members over 64 shared tokens save too little to pay."""
    r = kv_bytes.step_bytes(4, 64, 16, block_size=16)
    assert (r.cascade_groups, r.ratio) == (0, 1.0)


def test_qwen3_shape_ratios() -> None:
    """64 sequences x 1k shared x 128 own: 64 * 1152 / (1024 + 64 * 128) = 8 exactly; bytes in
    full: 73,728 tokens x 28 layers x 4 KiB."""
    r = kv_bytes.step_bytes(64, 1024, 128)
    assert r.cascade_groups == 1 and r.ratio == 8.0
    assert r.bytes_plain == 64 * 1152 * 28 * 4096
    assert r.bytes_cascade == (1024 + 64 * 128) * 28 * 4096
    # a suffix that does not end on a block boundary: the shared part is still whole blocks
    r = kv_bytes.step_bytes(16, 1024, 100)
    assert r.ratio == pytest.approx(16 * 1124 / (1024 + 16 * 100))


def test_quick_main_writes_json(tmp_path) -> None:
    rows = kv_bytes.main(["--quick", "--out-dir", str(tmp_path)])
    assert len(rows) == len(kv_bytes.QUICK_SEQS) * len(kv_bytes.QUICK_SHARED)
    assert all(r.ratio == pytest.approx(r.analytic_ratio) for r in rows)
    report = json.loads((tmp_path / "kv_bytes.json").read_text())
    assert [r["ratio"] for r in report["rows"]] == [r.ratio for r in rows]
