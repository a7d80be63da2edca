"""``LLM(quantization=...)`` against transformers running the same dequantized weights.

The reference is the checkpoint loaded in transformers with every decoder linear replaced by
``KernelLinear``: the weight prefixserve's quantized linear multiplies by (``kernel_weight``:
the quantize -> dequantize round trip, scales rounded to bfloat16 on the packed CPU kernels),
and, where the packed kernels run, their rounding of input and output to bfloat16. What remains
is float summation order, so greedy tokens are equal and logprobs within ``LOGPROB_ATOL``.
Against the same weights without the activation rounding, logprobs stay within
``WEIGHTS_ONLY_LOGPROB_ATOL`` (teacher-forced on prefixserve's tokens).
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import load_hf_model, make_checkpoint
from quant_reference import KernelLinear

from prefixserve import LLM, SamplingParams
from prefixserve.models.quantization import (
    concat_rows,
    kernel_weight,
    quantize,
    uses_packed_kernel,
)

LOGPROB_ATOL = 1e-4  # measured at most 3e-5 (qwen2 int8)
WEIGHTS_ONLY_LOGPROB_ATOL = 0.1  # measured at most 0.03 (qwen2 int8)
CPU = torch.device("cpu")
_FUSED = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))
_SINGLE = (("self_attn", ("o_proj",)), ("mlp", ("down_proj",)))


@torch.no_grad()
def dequantized_reference(folder, method: str, round_activations: bool = True) -> torch.nn.Module:
    """transformers' model of ``folder`` computing each linear as prefixserve's quantized one
    (``round_activations=False``: the same weights, activations left in float32)."""
    hf = load_hf_model(folder)
    for layer in hf.model.layers:
        for block, names in _FUSED + _SINGLE:  # quantized fused in prefixserve: split rows back
            parent = getattr(layer, block)
            mods = [getattr(parent, n) for n in names]
            fused = concat_rows([quantize(m.weight, method) for m in mods])
            packed = round_activations and uses_packed_kernel(fused, CPU)
            rows = kernel_weight(fused, CPU).split([m.weight.shape[0] for m in mods])
            for name, m, w in zip(names, mods, rows):
                setattr(parent, name, KernelLinear(w, m.bias, packed))
    return hf


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_equals_transformers_on_dequantized_weights(tmp_path, arch, method):
    folder = make_checkpoint(arch, tmp_path / arch)
    hf = dequantized_reference(folder, method)
    llm = LLM(str(folder), quantization=method, num_kv_blocks=64)
    prompts = [[5, 17, 99, 3, 250, 41, 7], list(range(40, 73))]
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True)
    worst = 0.0
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
        ref = torch.log_softmax(logits.float(), dim=-1)
        assert tokens == ref.argmax(-1).tolist(), (arch, method)
        for pos, (tok, lp) in enumerate(zip(tokens, out.outputs[0].logprobs)):
            worst = max(worst, abs(lp[tok] - float(ref[pos, tok])))
    print(f"{arch} {method}: max |logprob - reference| = {worst:.2e}")
    assert worst < LOGPROB_ATOL, worst


def test_quantized_model_differs_from_float_but_not_by_much(tmp_path):
    """The quantized linears are really in use: logprobs move, by far less than a token's."""
    folder = make_checkpoint("llama", tmp_path / "llama")
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=0)
    prompt = [[5, 17, 99, 3, 250, 41, 7]]
    lps = {}
    for method in (None, "int4"):
        out = (
            LLM(str(folder), quantization=method, num_kv_blocks=16)
            .generate(prompt, params, use_tqdm=False)[0]
            .outputs[0]
        )
        lps[method] = out.logprobs[0][out.token_ids[0]]
    assert lps[None] != lps["int4"]
    assert abs(lps[None] - lps["int4"]) < 1.0


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_logprobs_near_the_weights_only_reference(tmp_path, method):
    """The bfloat16 rounding of activations moves logprobs by a few hundredths at most."""
    folder = make_checkpoint("qwen2", tmp_path / "qwen2")
    hf = dequantized_reference(folder, method, round_activations=False)
    llm = LLM(str(folder), quantization=method, num_kv_blocks=64)
    prompt = list(range(40, 73))
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1 :]
    ref = torch.log_softmax(logits.float(), dim=-1)
    diffs = [abs(lp[t] - float(ref[i, t])) for i, (t, lp) in enumerate(zip(out.token_ids, out.logprobs))]  # fmt: skip
    assert 0 < max(diffs) < WEIGHTS_ONLY_LOGPROB_ATOL
