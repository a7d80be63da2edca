"""The reference a quantized model is tested against: transformers on the same checkpoint, with
every matrix prefixserve quantizes replaced by what its kernel multiplies by (the scheme's
``dequantize()``), and, for the integer kernels, every input of those matrices rounded as they
round it (``int8_activations``); only summation order differs."""

from __future__ import annotations

from unittest import mock

import torch
import torch.nn.functional as F
from qlinear_reference import quantize_activations

from prefixserve.models.linear import VOCAB_SCHEME
from prefixserve.models.quantization import GROUP_SIZE, quantize

# On int8 activations a value at a rounding boundary of its block can round to the next code when
# the reference's float32 input differs in its last bits (summation order): one activation step
# (1/127 of the block's largest value) moves downstream logprobs by up to a few 1e-3.
LOGPROB_ATOL_INT8_ACTIVATIONS = 1e-2
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


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` (any leading dims) as the integer kernels see it: each row's blocks of 32 quantized
    to int8 and dequantized."""
    rows = x.reshape(-1, x.shape[-1]).float()
    codes, d, _ = quantize_activations(rows)
    return (codes.float() * d[..., None]).view(x.shape).to(x.dtype)


def _rounding_linear_inputs(forward):
    """``forward`` with every ``F.linear`` it calls taking its input rounded (stacked MoE experts,
    which multiply by slices of their parameters)."""
    linear = F.linear

    def rounded(x, weight, bias=None):
        return linear(rounded_activations(x), weight, bias)

    def wrapped(*args, **kwargs):
        with mock.patch.object(F, "linear", rounded):
            return forward(*args, **kwargs)

    return wrapped


def int8_activations(hf: torch.nn.Module) -> torch.nn.Module:
    """``hf`` (a ``dequantized_reference``) with the input of every matrix it quantized rounded
    to int8 in blocks of 32 first, as ``activation_quantization="int8"`` multiplies them. Stacked
    MoE experts run transformers' eager loop (one ``F.linear`` per expert and matrix)."""
    if any(n.endswith("experts.down_proj") for n, _ in hf.named_parameters()):
        hf.set_experts_implementation("eager")
    for name, module in hf.named_modules():
        decoder = name.rpartition(".")[2] in _LINEARS and ".layers." in f".{name}."
        head = module is hf.get_output_embeddings()
        if (decoder or head) and module.weight.shape[1] % GROUP_SIZE == 0:
            module.register_forward_pre_hook(lambda _, a: (rounded_activations(a[0]), *a[1:]))
        experts = dict(module.named_parameters(recurse=False))
        stacked = {"gate_up_proj", "down_proj"} <= experts.keys()
        if stacked and all(w.dim() == 3 and w.shape[2] % GROUP_SIZE == 0 for w in experts.values()):
            module.forward = _rounding_linear_inputs(module.forward)
    return hf
