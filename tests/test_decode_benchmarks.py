"""Smoke tests of the decode benchmarks on a tiny random checkpoint: they run end to end and
report what they claim to (no speed is checked; the figures live in the README)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from prefixserve.models import llama
from tests.checkpoints import make_checkpoint

BENCH_DIR = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH_DIR))

import decode_ab  # noqa: E402
import decode_profile  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("decode-bench"), seed=5)


def test_decode_profile_reports_each_piece_and_restores_the_model(tiny_model, capsys):
    forward = llama.LlamaForCausalLM.forward
    decode_profile.main(["--model", str(tiny_model), "--streams", "2", "--steps", "2"])
    out = capsys.readouterr().out
    for piece in ("model forward", "MLP", "RMSNorm", "apply_rope", "lm_head", "sample"):
        assert piece in out
    assert "aten ops per step" in out
    assert llama.LlamaForCausalLM.forward is forward  # the labels are gone


def test_decode_ab_compares_two_checkouts_in_turn(tiny_model, tmp_path):
    argv = ["--baseline", str(decode_ab.THIS_CHECKOUT), "--model", str(tiny_model),
            "--streams", "1", "2", "--rounds", "1", "--steps", "3", "--out-dir", str(tmp_path)]  # fmt: skip
    result = decode_ab.main(argv)
    for n in ("1", "2"):
        for name in ("baseline", "new"):
            assert len(result["steps"][name][n]["wall"]) == 3  # every decode step is timed
            assert len(result["steps"][name][n]["cpu"]) == 3
        assert result["summary"][n]["cpu_ratio"] > 0
    assert json.loads((tmp_path / "decode_ab.json").read_text())["summary"].keys() == {"1", "2"}
