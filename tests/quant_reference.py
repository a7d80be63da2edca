"""The reference a quantized model is tested against: transformers on the same checkpoint, with
every matrix prefixserve quantizes replaced by what its kernel multiplies by (the scheme's
``dequantize()``: the kernels keep activations in float32, so only summation order differs)."""

from __future__ import annotations

import torch

from prefixserve.models.linear import VOCAB_SCHEME
from prefixserve.models.quantization import GROUP_SIZE, quantize

_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@torch.no_grad()
def dequantized_reference(hf: torch.nn.Module, method: str) -> torch.nn.Module:
    """``hf`` (a transformers causal LM) with its decoder linears (MoE experts included)
    quantized by ``method`` and its
    vocabulary (embedding and lm_head) by ``VOCAB_SCHEME``, as ``LLM(quantization=method)``
    holds them; matrices whose width is not whole groups stay as they are."""

    def requantize(w: torch.Tensor, scheme: str) -> None:
        if w.shape[1] % GROUP_SIZE == 0:
            w.copy_(quantize(w, scheme).dequantize())

    for name, module in hf.named_modules():
        if name.rpartition(".")[2] in _LINEARS and ".layers." in f".{name}.":
            requantize(module.weight, method)
    for name, param in hf.named_parameters():  # MoE experts, stacked [E, N, K]
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            for expert in param:
                requantize(expert, method)
    requantize(hf.get_input_embeddings().weight, VOCAB_SCHEME)
    head = hf.get_output_embeddings().weight
    if head.data_ptr() != hf.get_input_embeddings().weight.data_ptr():
        requantize(head, VOCAB_SCHEME)
    return hf
