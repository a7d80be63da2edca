"""Weight-only quantization of the decoder's linear layers: ``int8`` and ``int4``.

Schemes (only weights are stored quantized; activations stay in the model dtype, except that
the CPU kernels round them to bfloat16, see below):

- ``int8``: per output channel, symmetric. ``w[n, k] = q[n, k] * scale[n]``, ``q`` in [-127, 127].
- ``int4``: group-wise along the input dim (``INT4_GROUP_SIZE`` columns a group), asymmetric.
  ``w[n, k] = (q[n, k] - 8) * scale[n, g] + zero[n, g]`` with ``g = k // group_size`` and ``q`` in
  [0, 15]; ``zero`` is the value the code 8 stands for. This is the layout of torch's packed
  int4 CPU kernel, and GGUF's Q4_0 / Q4_1 / Q4_K blocks map onto it exactly (``gguf_blocks``).

Which kernel runs:

- CPU: torch's packed kernels, ``aten._weight_int8pack_mm`` and ``aten._weight_int4pack_mm_for_cpu``
  (weights packed once at load by ``aten._convert_weight_to_int4pack_for_cpu``; int4 needs
  ``out_features % 16 == 0``). They run with bfloat16 activations, scales and zeros (their
  float32 variants are a scalar loop, 10x slower than a float32 matmul on an AVX-512 machine),
  so each quantized linear's input and output are rounded to bfloat16, as llama.cpp rounds
  activations to 8 bits for its quantized dot products. ``kernel_weight`` is the exact weight
  they multiply by (scales and zeros rounded to bfloat16).
- CUDA, int4: the Triton kernel ``kernels/int4_matmul.py``, which dequantizes tile by tile in
  registers (tested through Triton's interpreter; not yet run on a GPU).
- Elsewhere (CUDA int8, a CPU int4 layer the packed kernel cannot take, ``portable=True``): the
  portable path, which dequantizes in torch ops at each call in the model dtype (int8:
  ``(x @ q^T) * scale``; int4: rebuild the weight from its codes, then ``F.linear``).
Memory holds only the quantized form.

Only the linear layers inside decoder layers are quantized; embeddings, ``lm_head`` and norms stay
in the model dtype. A layer whose ``in_features`` is not a multiple of the int4 group size stays
unquantized (logged).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from prefixserve.errors import InvalidArgumentError
from prefixserve.models.llama import Linear

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("int8", "int4")
INT4_GROUP_SIZE = 32
_INT4_PACK_ROWS = 16  # the packed CPU int4 kernel needs out_features divisible by this


@dataclass(frozen=True)
class Int8Weight:
    """``qweight`` int8 ``[N, K]`` in [-127, 127], ``scales`` float32 ``[N]``."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None]

    def to(self, device: torch.device) -> Int8Weight:
        return Int8Weight(self.qweight.to(device), self.scales.to(device))

    def index_rows(self, index: torch.Tensor) -> Int8Weight:
        return Int8Weight(self.qweight[index], self.scales[index])


@dataclass(frozen=True)
class Int4Weight:
    """``qvalues`` uint8 ``[N, K]`` in [0, 15]; ``scales`` and ``zeros`` float32 ``[N, K / group]``."""

    qvalues: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int = INT4_GROUP_SIZE

    def dequantize(self) -> torch.Tensor:
        n, k = self.qvalues.shape
        q = self.qvalues.float().view(n, k // self.group_size, self.group_size)
        return ((q - 8) * self.scales[..., None] + self.zeros[..., None]).view(n, k)

    def to(self, device: torch.device) -> Int4Weight:
        q, s, z = (t.to(device) for t in (self.qvalues, self.scales, self.zeros))
        return Int4Weight(q, s, z, self.group_size)

    def index_rows(self, index: torch.Tensor) -> Int4Weight:
        q, s, z = (t[index] for t in (self.qvalues, self.scales, self.zeros))
        return Int4Weight(q, s, z, self.group_size)


QuantizedWeight = Int8Weight | Int4Weight


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Per-row symmetric int8: ``scale = max|w_row| / 127`` (1 for an all-zero row)."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q, scales)


def quantize_int4(w: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> Int4Weight:
    """Group-wise asymmetric int4 over min..max of each group: ``scale = (max - min) / 15``.

    A constant group gets scale 0 and every code stands for its value exactly.
    """
    n, k = w.shape
    if k % group_size:
        raise InvalidArgumentError(
            f"int4 needs in_features divisible by {group_size}, got {k}", param="quantization"
        )
    g = w.float().view(n, k // group_size, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    scales = (hi - lo) / 15
    step = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((g - lo[..., None]) / step[..., None]).clamp(0, 15)
    return Int4Weight(q.to(torch.uint8).view(n, k), scales, lo + 8 * scales, group_size)


def quantize(w: torch.Tensor, method: str) -> QuantizedWeight:
    return quantize_int8(w) if method == "int8" else quantize_int4(w)


def concat_rows(parts: list[QuantizedWeight | None]) -> QuantizedWeight | None:
    """Stack weights along the output dim (a fused qkv or gate_up); None unless every part is
    given and all share one scheme (and group size)."""
    first = parts[0]
    if first is None or any(type(p) is not type(first) for p in parts):
        return None
    if isinstance(first, Int8Weight):
        return Int8Weight(
            torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts])
        )
    if any(p.group_size != first.group_size for p in parts):
        return None
    return Int4Weight(
        torch.cat([p.qvalues for p in parts]),
        torch.cat([p.scales for p in parts]),
        torch.cat([p.zeros for p in parts]),
        first.group_size,
    )


def uses_packed_kernel(weight: QuantizedWeight, device: torch.device) -> bool:
    """Whether a linear built from ``weight`` on ``device`` runs torch's packed CPU kernel."""
    if torch.device(device).type != "cpu":
        return False
    return isinstance(weight, Int8Weight) or weight.qvalues.shape[0] % _INT4_PACK_ROWS == 0


def kernel_weight(weight: QuantizedWeight, device: torch.device) -> torch.Tensor:
    """The float32 weight ``[N, K]`` a linear built from ``weight`` multiplies by on ``device``:
    the dequantized weight, with scales (and zeros) rounded to bfloat16 where the packed CPU
    kernels run. The reference that quantized models are tested against."""
    if not uses_packed_kernel(weight, device):
        return weight.dequantize()
    bf16 = {f: getattr(weight, f).to(torch.bfloat16).float() for f in ("scales", "zeros")
            if hasattr(weight, f)}  # fmt: skip
    return replace(weight, **bf16).dequantize()


class Int8Linear(nn.Module):
    """``y = x (q * scale)^T + b`` from int8 weights; see the module docstring for kernels.
    ``portable`` forces the portable path (tests; torch builds without the packed kernels)."""

    def __init__(
        self,
        weight: Int8Weight,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        portable: bool = False,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.qweight.shape
        self.packed = not portable and uses_packed_kernel(weight, weight.qweight.device)
        self.register_buffer("qweight", weight.qweight.contiguous())
        self.register_buffer("scales", weight.scales.to(torch.bfloat16 if self.packed else dtype))
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, x2 = x.shape[:-1], x.reshape(-1, self.in_features)
        if self.packed:
            x16 = x2.to(torch.bfloat16).contiguous()
            y = torch.ops.aten._weight_int8pack_mm(x16, self.qweight, self.scales).to(x.dtype)
        else:
            y = F.linear(x2, self.qweight.to(x.dtype)) * self.scales
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)


class Int4Linear(nn.Module):
    """``y = x W^T + b`` with ``W`` held as int4 codes plus per-group scale and zero.
    ``portable`` forces the portable path, as for ``Int8Linear``."""

    def __init__(
        self,
        weight: Int4Weight,
        bias: torch.Tensor | None,
        dtype: torch.dtype,
        portable: bool = False,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.qvalues.shape
        self.group_size = weight.group_size
        self.packed = not portable and uses_packed_kernel(weight, weight.qvalues.device)
        if self.packed:  # the kernel's own layout; scales_and_zeros [K/g, N, 2] bfloat16
            codes = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                weight.qvalues.to(torch.int32), 1
            )
            self.register_buffer("codes", codes)
            sz = torch.stack([weight.scales, weight.zeros], dim=-1).transpose(0, 1)
            self.register_buffer("scales_and_zeros", sz.contiguous().to(torch.bfloat16))
        else:  # two codes a byte, low nibble first: [N, K/2]
            q = weight.qvalues
            self.register_buffer("codes", (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous())
            self.register_buffer("scales", weight.scales.to(dtype))
            self.register_buffer("zeros", weight.zeros.to(dtype))
        self.bias = bias

    def _portable_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The portable path's weight ``[N, K]``: codes unpacked, then scaled per group."""
        n, k, g = self.out_features, self.in_features, self.group_size
        q = torch.stack([self.codes & 0xF, self.codes >> 4], dim=-1).view(n, k // g, g)
        w = (q.to(dtype) - 8) * self.scales[..., None] + self.zeros[..., None]
        return w.view(n, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, x2 = x.shape[:-1], x.reshape(-1, self.in_features)
        if self.packed:
            x16 = x2.to(torch.bfloat16).contiguous()
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x16, self.codes, self.group_size, self.scales_and_zeros
            ).to(x.dtype)
        elif x.is_cuda:
            from prefixserve.kernels.int4_matmul import int4_matmul

            y = int4_matmul(x2, self.codes, self.scales, self.zeros, self.group_size)
        else:
            y = F.linear(x2, self._portable_weight(x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)


def quantize_linears(
    model: nn.Module,
    method: str | None,
    prequantized: Mapping[str, QuantizedWeight] | None = None,
) -> dict[str, str]:
    """Replace the decoder layers' linears of ``model`` by quantized ones, in place.

    ``prequantized`` holds weights already quantized, by Hugging Face weight name; a linear
    whose parts (``model.source_weight_names``) are all there, in one scheme, uses them as
    given (stacked) when ``method`` is that scheme or None. Every other linear is quantized by
    ``method`` from its loaded weight, or left as is when ``method`` is None. Returns
    {module name: scheme} for every replaced module.
    """
    if method is not None and method not in QUANTIZATION_METHODS:
        raise InvalidArgumentError(
            f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None, "
            f"got {method!r}",
            param="quantization",
        )
    prequantized = prequantized or {}
    done: dict[str, str] = {}
    for name, module in list(model.named_modules()):
        if ".layers." not in f".{name}" or not isinstance(module, Linear):
            continue
        given = concat_rows([prequantized.get(n) for n in model.source_weight_names(name)])
        weight = _choose_weight(name, module, method, given)
        if weight is None:
            continue
        cls = Int8Linear if isinstance(weight, Int8Weight) else Int4Linear
        weight = weight.to(module.weight.device)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, cls(weight, module.bias, module.weight.dtype))
        done[name] = "int8" if cls is Int8Linear else "int4"
    return done


def _choose_weight(
    name: str, module: nn.Module, method: str | None, given: QuantizedWeight | None
) -> QuantizedWeight | None:
    scheme = None if given is None else ("int8" if isinstance(given, Int8Weight) else "int4")
    if given is not None and (method is None or method == scheme):
        return given
    if method is None:
        return None
    if method == "int4" and module.weight.shape[1] % INT4_GROUP_SIZE:
        logger.warning(
            "%s: in_features %d is not a multiple of %d; left unquantized",
            name, module.weight.shape[1], INT4_GROUP_SIZE,
        )  # fmt: skip
        return None
    return quantize(module.weight.detach(), method)
