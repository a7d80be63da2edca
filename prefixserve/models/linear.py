"""``Linear``: every weight matrix of the model, and the kernels that hold and multiply it.

A ``Linear`` computes ``y = x W^T + b``; ``rows(ids)`` reads rows of ``W``, which is how the
vocabulary matrix (``embed_tokens``) serves as the embedding table and, when tied, as the lm_head.
It is created with an uninitialized float ``weight`` that the model's ``load_weights`` fills;
``finalize_linears`` then gives every one its kernel for the device and scheme and drops the
float weight wherever the kernel keeps its own form, so memory holds each matrix once:

    device          weights                 kernel          holds
    cpu (float32)   float                   PackedFloat     [N/16, K, 16] float32
    cpu (float32)   int8 / int4, int8 acts  PackedW8A8/W4A8 codes, float16 group scales (shifts,
                                                            none for int4_sym)
    cpu (float32)   int8 / int4, float acts PackedInt8/4    codes, float16 group scales, shifts
    cuda            float                   Dense           the weight (F.linear)
    cuda            int4                    TritonInt4      codes [N, K/2], scales, shifts
    elsewhere       int8 / int4             Portable        the codes, dequantized at each call
    cpu (float32)   a GGUF BlockWeight      PackedBlock     the file's codes and parameters
    elsewhere       a GGUF BlockWeight      Portable        the same, dequantized at each call
    anywhere        parts in several types  Stacked         one kernel per part

The CPU kernels are ``prefixserve.kernels.cpu_linear`` (float activations), ``cpu_qlinear``
(``activations="int8"``: each activation row quantized to int8 in blocks of 32, integer dot
products) and ``cpu_klinear`` (GGUF's block types, on either), built by ``cpu_ops``; one family
for every row count: a row's result is bit-identical alone or in any batch. Where they cannot be
built, CPU weights take the Dense and Portable kernels. Before ``finalize_linears`` a ``Linear``
multiplies by its float weight (models built by hand in tests).

Which matrices are quantized (``quantization`` int8 / int4 / int4_sym): the decoder layers' linears in the
scheme (not an MoE router), and the vocabulary matrix (embedding and lm_head) in int8 under
either scheme, as
llama.cpp keeps GGUF's token embedding in Q8_0 beside Q4 layers; a GGUF file's own quantized
tensors (``prequantized``) are kept as they are. Matrices whose ``in_features`` is not a multiple
of the group stay in float (logged).
"""

from __future__ import annotations

import dataclasses
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from prefixserve.kernels import cpu_klinear, cpu_linear, cpu_ops, cpu_qlinear
from prefixserve.models.quantization import (
    GROUP_SIZE,
    QUANTIZATION_METHODS,
    BlockWeight,
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
    concat_rows,
    in_scheme,
    quantize,
    scheme_of,
)

logger = logging.getLogger(__name__)

VOCAB_SCHEME = "int8"  # the vocabulary matrix's scheme whenever the layers are quantized


class LinearKernel(nn.Module, ABC):
    """How one ``[N, K]`` weight is held and multiplied. ``forward(x, bias)`` is ``x W^T + b``
    over the last dim of ``x``; ``rows(index)`` is ``W[index]`` in ``dtype``. Every tensor it
    holds is a buffer (``.to()`` moves it; memory counts it)."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.out_features, self.in_features, self.dtype = out_features, in_features, dtype

    @abstractmethod
    def forward(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    @abstractmethod
    def rows(self, index: torch.Tensor) -> torch.Tensor: ...

    def _flat(self, x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``fn`` over ``x`` as a contiguous ``[M, K]`` matrix, reshaped back."""
        lead = x.shape[:-1]
        return fn(x.reshape(-1, self.in_features).contiguous()).view(*lead, self.out_features)


def _nibbles(pairs: torch.Tensor) -> torch.Tensor:
    """``[..., K / 2]`` bytes (k even low nibble, k odd high) -> ``[..., K]`` codes."""
    return torch.stack([pairs & 15, pairs >> 4], dim=-1).flatten(-2)


class Dense(LinearKernel):
    """The float weight as it is: ``F.linear``."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(*weight.shape, weight.dtype)
        self.register_buffer("weight", weight.detach())

    def forward(self, x, bias):
        return F.linear(x, self.weight, bias)

    def rows(self, index):
        return F.embedding(index, self.weight)


class PackedFloat(LinearKernel):
    """A float32 weight in ``cpu_linear``'s block layout."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(*weight.shape, torch.float32)
        self.register_buffer("packed", cpu_linear.pack_f32(weight.detach()))

    def forward(self, x, bias):
        n = self.out_features
        return self._flat(x, lambda x2: cpu_linear.linear_f32(x2, self.packed, bias, n))

    def rows(self, index):
        return cpu_linear.block_rows(self.packed, index)


class PackedInt8(LinearKernel):
    """An ``Int8Weight`` in ``cpu_linear``'s block layout."""

    def __init__(self, weight: Int8Weight) -> None:
        super().__init__(*weight.shape, torch.float32)
        self.group_size = weight.group_size
        codes, scales = cpu_linear.pack_int8(weight.qweight, weight.scales)
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)

    def forward(self, x, bias):
        n, g = self.out_features, self.group_size
        return self._flat(
            x, lambda x2: cpu_linear.linear_int8(x2, self.codes, self.scales, g, bias, n)
        )

    def rows(self, index):
        codes = cpu_linear.block_rows(self.codes, index).float()  # (T, K)
        scales = cpu_linear.block_rows(self.scales, index).float()  # (T, K / g)
        return (codes.unflatten(-1, (-1, self.group_size)) * scales[..., None]).flatten(-2)


class PackedInt4(LinearKernel):
    """An ``Int4Weight`` in ``cpu_linear``'s block layout."""

    def __init__(self, weight: Int4Weight) -> None:
        super().__init__(*weight.shape, torch.float32)
        self.group_size = weight.group_size
        codes, scales, shifts = cpu_linear.pack_int4(
            weight.qvalues, weight.scales, weight.shift_values()
        )
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("shifts", shifts)

    def forward(self, x, bias):
        n, g = self.out_features, self.group_size
        return self._flat(
            x,
            lambda x2: cpu_linear.linear_int4(x2, self.codes, self.scales, self.shifts, g, bias, n),
        )

    def rows(self, index):
        codes = _nibbles(cpu_linear.block_rows(self.codes, index)).float()  # (T, K)
        scales = cpu_linear.block_rows(self.scales, index).float()[..., None]
        shifts = cpu_linear.block_rows(self.shifts, index).float()[..., None]
        return (codes.unflatten(-1, (-1, self.group_size)) * scales + shifts).flatten(-2)


class PackedW8A8(LinearKernel):
    """An ``Int8Weight`` (groups of 32) in ``cpu_qlinear``'s layout, multiplied on activations
    quantized to int8 in blocks of 32."""

    def __init__(self, weight: Int8Weight) -> None:
        super().__init__(*weight.shape, torch.float32)
        codes, scales = cpu_qlinear.pack_w8a8(weight.qweight, weight.scales)
        self.register_buffer("codes", codes)
        self.register_buffer("scales", scales)

    def forward(self, x, bias):
        n = self.out_features
        return self._flat(
            x, lambda x2: cpu_qlinear.linear_w8a8(x2, self.codes, self.scales, bias, n)
        )

    def rows(self, index):
        flat = index.flatten()
        codes = cpu_qlinear.w8a8_rows(self.codes, flat)
        weight = Int8Weight(codes, cpu_linear.block_rows(self.scales, flat).float())
        return weight.dequantize().view(*index.shape, -1)


class PackedW4A8(LinearKernel):
    """An ``Int4Weight`` (groups of 32) in ``cpu_qlinear``'s layout, multiplied on activations
    quantized to int8 in blocks of 32; the scale-only form holds no shifts (``shifts`` None)."""

    def __init__(self, weight: Int4Weight) -> None:
        super().__init__(*weight.shape, torch.float32)
        packed = cpu_qlinear.pack_w4a8(weight.qvalues, weight.scales, weight.shifts)
        for name, t in zip(("codes", "scales", "shifts"), packed):
            self.register_buffer(name, t)

    def forward(self, x, bias):
        n = self.out_features
        return self._flat(
            x,
            lambda x2: cpu_qlinear.linear_w4a8(x2, self.codes, self.scales, self.shifts, bias, n),
        )

    def rows(self, index):
        flat = index.flatten()
        codes = cpu_qlinear.w4a8_rows(self.codes, flat)
        scales, shifts = (None if t is None else cpu_linear.block_rows(t, flat).float()
                          for t in (self.scales, self.shifts))  # fmt: skip
        weight = Int4Weight(codes, scales, shifts, cpu_qlinear.BLOCK)
        return weight.dequantize().view(*index.shape, -1)


class PackedBlock(LinearKernel):
    """A ``BlockWeight`` (a GGUF type kept as the file holds it) in ``cpu_klinear``'s layout,
    multiplied on int8 activations (``activations="int8"``) or on float activations."""

    def __init__(self, weight: BlockWeight, activations: str | None) -> None:
        super().__init__(*weight.shape, torch.float32)
        self.kind, self.bits, self.offset, self.span = (
            weight.kind, weight.bits, weight.offset, weight.span
        )  # fmt: skip
        self.int8 = activations == "int8"
        packed = cpu_klinear.pack_block(
            weight.codes, weight.bits, weight.scales, weight.sub, weight.shifts, weight.mins
        )
        for name, t in packed.items():
            self.register_buffer(name, t)

    def packed(self) -> dict[str, torch.Tensor | None]:
        return {n: getattr(self, n) for n in ("low", "high", "scales", "sub", "shifts", "mins")}

    def forward(self, x, bias):
        fn = cpu_klinear.linear_kq8 if self.int8 else cpu_klinear.linear_kf32
        args = (self.packed(), self.bits, self.offset, self.span, bias, self.out_features)
        return self._flat(x, lambda x2: fn(x2, *args))

    def rows(self, index):
        flat = index.flatten()
        params = {n: cpu_klinear.param_rows(getattr(self, n), flat)
                  for n in ("scales", "sub", "shifts", "mins")}  # fmt: skip
        weight = BlockWeight(
            self.kind, cpu_klinear.block_codes(self.low, self.high, flat), self.bits,
            self.offset, params["scales"].float(), params["sub"],
            None if params["shifts"] is None else params["shifts"].float(), params["mins"],
            self.span,
        )  # fmt: skip
        return weight.dequantize().view(*index.shape, -1)


class Portable(LinearKernel):
    """A quantized weight held as its codes and parameters and dequantized, in the model dtype,
    at every call: correct anywhere, fast nowhere."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__(*weight.shape, dtype)
        self.weight_type = type(weight)
        self.fields = {f.name: getattr(weight, f.name) for f in dataclasses.fields(weight)}
        for name, value in self.fields.items():
            if isinstance(value, torch.Tensor):
                self.register_buffer(name, value)

    def quantized(self) -> QuantizedWeight:
        held = {n: getattr(self, n) if isinstance(v, torch.Tensor) else v
                for n, v in self.fields.items()}  # fmt: skip
        return self.weight_type(**held)

    def forward(self, x, bias):
        return F.linear(x, self.quantized().dequantize().to(x.dtype), bias)

    def rows(self, index):
        rows = self.quantized().index_rows(index.flatten()).dequantize()
        return rows.view(*index.shape, -1).to(self.dtype)


class TritonInt4(LinearKernel):
    """An ``Int4Weight`` on CUDA: ``kernels/int4_matmul.py`` dequantizes tile by tile."""

    def __init__(self, weight: Int4Weight, dtype: torch.dtype) -> None:
        super().__init__(*weight.shape, dtype)
        self.group_size = weight.group_size
        q = weight.qvalues
        self.register_buffer("codes", (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous())
        self.register_buffer("scales", weight.scales.to(dtype))
        self.register_buffer("shifts", weight.shift_values().to(dtype))

    def forward(self, x, bias):
        from prefixserve.kernels.int4_matmul import int4_matmul

        y = self._flat(
            x,
            lambda x2: int4_matmul(x2, self.codes, self.scales, self.shifts, self.group_size),
        )
        return y if bias is None else y + bias

    def rows(self, index):
        codes = _nibbles(self.codes[index]).to(self.dtype)
        g = self.group_size
        w = codes.unflatten(-1, (-1, g)) * self.scales[index][..., None]
        return (w + self.shifts[index][..., None]).flatten(-2)


class Stacked(LinearKernel):
    """A fused matrix (q/k/v, gate/up) whose parts are held by kernels of their own (GGUF
    parts in different types): each part multiplies ``x`` and the outputs are concatenated, so
    every output is exactly its part's."""

    def __init__(self, parts: list[LinearKernel]) -> None:
        super().__init__(sum(p.out_features for p in parts), parts[0].in_features, parts[0].dtype)
        self.parts = nn.ModuleList(parts)
        self.bounds = [0]
        for part in parts:
            self.bounds.append(self.bounds[-1] + part.out_features)

    def forward(self, x, bias):
        outs = []
        for part, lo, hi in zip(self.parts, self.bounds, self.bounds[1:]):
            outs.append(part(x, None if bias is None else bias[lo:hi]))
        return torch.cat(outs, dim=-1)

    def rows(self, index):
        out = torch.empty(*index.shape, self.in_features, dtype=self.dtype, device=index.device)
        for part, lo, hi in zip(self.parts, self.bounds, self.bounds[1:]):
            mine = (index >= lo) & (index < hi)
            out[mine] = part.rows(index[mine] - lo)
        return out


# cpu_linear's and cpu_qlinear's: batch-invariant (a Stacked kernel's parts are checked apart)
PACKED_KERNELS = (PackedFloat, PackedInt8, PackedInt4, PackedW8A8, PackedW4A8, PackedBlock, Stacked)


class Linear(nn.Module):
    """``y = x W^T + b`` (see the module docstring); parameters uninitialized until loaded."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight: nn.Parameter | None = nn.Parameter(
            torch.empty(out_features, in_features), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.kernel: LinearKernel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is None:
            return F.linear(x, self.weight, self.bias)
        return self.kernel(x, self.bias)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """``W[index]``: ``[*index.shape, in_features]`` (the embedding lookup)."""
        if self.kernel is None:
            return F.embedding(index, self.weight)
        return self.kernel.rows(index)

    def set_kernel(self, kernel: LinearKernel) -> None:
        """Use ``kernel`` from now on; the float weight is dropped (a ``Dense`` kernel holds it)."""
        self.kernel = kernel
        self.weight = None


def cpu_kernels_apply(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether weights on ``device`` in ``dtype`` take ``cpu_linear``'s kernels."""
    return device.type == "cpu" and dtype == torch.float32 and cpu_ops.available()


def make_kernel(
    weight: torch.Tensor | QuantizedWeight, dtype: torch.dtype, activations: str | None = None
) -> LinearKernel:
    """The kernel for ``weight`` (already on its device) in a model of ``dtype``; on CPU a
    quantized weight in groups of 32 is multiplied on int8 activations where ``activations`` is
    "int8" (``PackedW8A8`` / ``PackedW4A8``), else on float activations."""
    device = weight.device if isinstance(weight, torch.Tensor) else _device_of(weight)
    cpu = cpu_kernels_apply(device, dtype)
    if isinstance(weight, torch.Tensor):
        return PackedFloat(weight) if cpu else Dense(weight)
    if isinstance(weight, BlockWeight):
        return PackedBlock(weight, activations) if cpu else Portable(weight, dtype)
    int8 = isinstance(weight, Int8Weight)
    if cpu and activations == "int8" and weight.group_size == cpu_qlinear.BLOCK:
        return PackedW8A8(weight) if int8 else PackedW4A8(weight)
    if cpu:
        return PackedInt8(weight) if int8 else PackedInt4(weight)
    if device.type == "cuda" and isinstance(weight, Int4Weight):
        return TritonInt4(weight, dtype)
    return Portable(weight, dtype)


def _device_of(weight: QuantizedWeight) -> torch.device:
    return weight.scales.device


def finalize_linears(
    model: nn.Module,
    method: str | None,
    prequantized: Mapping[str, QuantizedWeight] | None = None,
    source_names: Callable[[str], list[str]] | None = None,
    activations: str | None = None,
) -> dict[str, str]:
    """Give every ``Linear`` of ``model`` its kernel (see the module docstring); returns
    {module name: scheme} of the quantized ones.

    ``prequantized`` maps Hugging Face weight names to quantized weights (a GGUF file's); a
    module whose parts (``source_names(module name)``) are all there, in one scheme, uses them
    stacked, in ``method``'s scheme where they convert to it exactly (``in_scheme``). Other decoder-layer linears are quantized
    by ``method``, the vocabulary matrix by ``VOCAB_SCHEME`` when ``method`` is set. Quantized
    matrices are multiplied on ``activations`` (``make_kernel``).
    """
    if method is not None and method not in QUANTIZATION_METHODS:
        quantize(torch.empty(0, 0), method)  # raises the one error message for a bad method
    prequantized = prequantized or {}
    source_names = source_names or (lambda name: [f"{name}.weight"])
    done: dict[str, str] = {}
    for name, module in list(model.named_modules()):
        if not isinstance(module, Linear) or module.kernel is not None:
            continue
        weight, scheme = module.weight, _scheme_for(name, method)
        parts = [prequantized.get(n) for n in source_names(name)]
        given = concat_rows(parts)
        if given is None and scheme is None and None not in parts:  # parts in several types
            kernels = [make_kernel(p.to(weight.device), weight.dtype, activations) for p in parts]
            done[name] = "+".join(scheme_of(p) for p in parts)
            module.set_kernel(Stacked(kernels))
            continue
        kept = given if given is None or scheme is None else in_scheme(given, scheme)
        chosen = kept if kept is not None else _quantized(name, weight, scheme)
        if chosen is not None:
            done[name] = scheme_of(chosen)
            chosen = chosen.to(weight.device)
        held = chosen if chosen is not None else weight
        module.set_kernel(make_kernel(held, weight.dtype, activations))
    return done


def _scheme_for(name: str, method: str | None) -> str | None:
    if method is None or name.endswith(".mlp.gate"):  # MoE routers stay float, as llama.cpp's
        return None
    if ".layers." in f".{name}.":
        return method
    return VOCAB_SCHEME  # embed_tokens, lm_head


def _quantized(name: str, weight: torch.Tensor, scheme: str | None) -> QuantizedWeight | None:
    if scheme is None:
        return None
    if weight.shape[1] % GROUP_SIZE:
        logger.warning(
            "%s: in_features %d is not a multiple of %d; left unquantized",
            name, weight.shape[1], GROUP_SIZE,
        )  # fmt: skip
        return None
    return quantize(weight.detach(), scheme)
