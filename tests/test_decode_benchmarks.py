"""Smoke tests of the decode benchmark's modes (``benchmarks/decode``) on a tiny random
checkpoint: they run end to end and report what they claim to (no speed is checked; the figures
live in docs/cpu-decode.md and docs/benchmarks.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.checkpoints import make_checkpoint

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

from decode import ab, offline  # noqa: E402
from decode import profile as decode_profile  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("decode-bench"), seed=5)


def test_offline_compares_variants_and_reports_memory(tiny_model, tmp_path, capsys):
    argv = ["--model", str(tiny_model), "--schemes", "float32", "int8", "--variants", "compiled",
            "eager", "--streams", "1", "2", "--max-tokens", "4", "--rounds", "2",
            "--out-dir", str(tmp_path)]  # fmt: skip
    result = offline.main(argv)
    assert {(r["engine"], r["streams"]) for r in result["rows"]} == {
        (f"{s}/{v}", n) for s in ("float32", "int8") for v in ("compiled", "eager") for n in (1, 2)
    }
    assert all(len(r["rounds"]) == 2 and r["tokens_per_s"] > 0 for r in result["rows"])
    memory = result["memory"]
    assert memory["float32/compiled"]["compile_seconds"].keys() == {"1", "2-256"}
    assert memory["float32/eager"]["compile_seconds"] == {}
    assert memory["int8/eager"]["weight_bytes"] < memory["float32/eager"]["weight_bytes"]
    assert "x float32's" in capsys.readouterr().out
    assert json.loads((tmp_path / "decode_offline.json").read_text())["rows"]


def test_profile_sorts_the_step_into_its_pieces(tiny_model, capsys):
    result = decode_profile.main(["--model", str(tiny_model), "--streams", "2", "--steps", "2"])
    rows = result[2]["ms_per_step"]
    assert {"linear kernels", "attention kernel", "compiled graph (wrapper, fused kernels)"} <= set(
        rows
    )
    assert result[2]["unprofiled_ms"]["min"] > 0
    assert "ms per profiled step" in capsys.readouterr().out


def test_ab_compares_two_checkouts_in_turn(tiny_model, tmp_path):
    argv = ["--baseline", str(ab.THIS_CHECKOUT), "--model", str(tiny_model),
            "--streams", "1", "2", "--rounds", "1", "--steps", "3", "--out-dir", str(tmp_path),
            "--keep-gguf"]  # fmt: skip
    result = ab.main(argv)
    assert result["keep_gguf"]
    for n in ("1", "2"):
        for name in ("baseline", "new"):
            assert len(result["steps"][name][n]["wall"]) == 3  # every decode step is timed
            assert len(result["steps"][name][n]["cpu"]) == 3
        assert result["summary"][n]["cpu_ratio"] > 0
    assert json.loads((tmp_path / "decode_ab.json").read_text())["summary"].keys() == {"1", "2"}
