"""The quantization / GGUF options on the command line and in ``EngineConfig``, and a smoke run of
``benchmarks/quant_ppl.py`` and ``benchmarks/decode offline`` on a tiny GGUF file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from checkpoints import make_checkpoint
from gguf import GGMLQuantizationType as Q
from gguf_files import write_gguf

from prefixserve.core.config import EngineConfig
from prefixserve.core.errors import InvalidArgumentError
from prefixserve.entrypoints.cli import build_parser, engine_kwargs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import quant_ppl
from decode import offline


def test_serve_takes_a_gguf_file_and_the_quantization_flags():
    args = build_parser().parse_args(["serve", "m.gguf", "--quantization", "int4", "--gguf-dequantize"])  # fmt: skip
    kwargs = engine_kwargs(args)
    assert (kwargs["model"], kwargs["quantization"], kwargs["gguf_dequantize"]) == ("m.gguf", "int4", True)  # fmt: skip
    kwargs = engine_kwargs(build_parser().parse_args(["serve", "smollm2"]))
    assert (kwargs["model"], kwargs["quantization"], kwargs["gguf_dequantize"]) == ("smollm2", None, False)  # fmt: skip
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "int3"])


def test_int4_sym_is_a_scheme_of_the_cli_and_the_config():
    kwargs = engine_kwargs(build_parser().parse_args(["serve", "m", "--quantization", "int4_sym"]))
    assert kwargs["quantization"] == "int4_sym"
    assert EngineConfig(quantization="int4_sym").quantization == "int4_sym"
    for bad in ("int4sym", "INT4_SYM", "q4_0"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "m", "--quantization", bad])
        with pytest.raises(InvalidArgumentError, match="quantization"):
            EngineConfig(quantization=bad)


def test_engine_config_refuses_an_unknown_scheme():
    with pytest.raises(InvalidArgumentError, match="quantization"):
        EngineConfig(quantization="fp8")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench-gguf")
    folder = make_checkpoint("mistral", root / "ckpt")
    types = {"attn_q": Q.Q4_1, "attn_k": Q.Q4_1, "attn_v": Q.Q4_1, "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_1}  # fmt: skip
    return write_gguf(folder, root / "tiny.gguf", types)


def test_quant_ppl_runs_every_scheme(tiny_gguf, tmp_path):
    result = quant_ppl.main(["--model", str(tiny_gguf), "--threads", "1", "--out-dir", str(tmp_path)])  # fmt: skip
    assert set(result["perplexity"]) == {"float32", "int8", "int4", "int4_sym", "gguf"}
    assert result["change_vs_float32"]["float32"] == 0
    assert json.loads((tmp_path / "quant_ppl.json").read_text())["tokens"] == result["tokens"] > 100
    assert all(abs(c) < 0.05 for c in result["change_vs_float32"].values())


def test_decode_benchmark_runs_a_gguf_file(tiny_gguf, tmp_path):
    result = offline.main(
        ["--model", str(tiny_gguf), "--schemes", "float32", "int4", "--variants", "eager",
         "--streams", "1", "2", "--max-tokens", "3", "--rounds", "1", "--threads", "1",
         "--no-memory", "--out-dir", str(tmp_path)]
    )  # fmt: skip
    assert {(r["engine"], r["streams"]) for r in result["rows"]} == {
        (f"{s}/eager", n) for s in ("float32", "int4") for n in (1, 2)
    }
    assert all(r["tokens_per_s"] > 0 for r in result["rows"])
    assert (tmp_path / "decode_offline.json").is_file()
