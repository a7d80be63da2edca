"""Weight-only quantization schemes, ``int8``, ``int4`` and ``int4_sym``, and GGUF's other block
types (``BlockWeight``): the quantized forms of a weight matrix and how a float matrix is
quantized.

The schemes work in groups of ``GROUP_SIZE`` consecutive input columns of one output row, with
float16 parameters (GGUF's blocks in the same shape, ``gguf_blocks``):

- ``int8``: symmetric, ``w[n, k] = q[n, k] * scale[n, g]``, ``q`` in [-127, 127] (GGUF's Q8_0).
- ``int4``: asymmetric, ``w[n, k] = q[n, k] * scale[n, g] + shift[n, g]``, ``q`` in [0, 15]
  (GGUF's Q4_1): 5 bits a weight.
- ``int4_sym``: scale only, ``w[n, k] = scale[n, g] * (q[n, k] - 8)``, ``q`` in [0, 15]
  (GGUF's Q4_0): 4.5 bits a weight. An ``Int4Weight`` without shifts.

with ``g = k // group``. The parameters are float16 values kept as float32 tensors, so
``dequantize()`` is exactly the matrix the kernels multiply by (``prefixserve.models.linear``),
which is what quantized models are tested against.

``quantize_int8`` / ``quantize_int4`` choose the float16 parameters first and then the codes
against them. A matrix whose ``in_features`` is not a multiple of the group stays in float.

``BlockWeight`` is read from GGUF files only (``gguf_blocks``): codes of 4 to 6 bits with the
file's own parameters, group ``g = k // 32``,

    w[n, k] = scale[n, g // span] * (sub[n, k // 16] * (code[n, k] - offset))
              + shift[n, g // span] * mins[n, g]

(``sub`` 1 and ``mins`` 1 where absent, ``shift`` 0). Every product there is exact in float32
(at most 24 significant bits), so ``dequantize()`` rounds once, at the shift's addition, and
equals ``gguf.quants.dequantize`` of the same blocks bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from prefixserve.core.errors import InvalidArgumentError

SYMMETRIC_INT4_ZERO = 8  # the code of 0 in ``int4_sym``
GROUP_SIZE = 32


def _f16(t: torch.Tensor) -> torch.Tensor:
    """``t`` rounded to float16, kept as float32."""
    return t.to(torch.float16).float()


class _RowTensors:
    """What the quantized forms share: the tensors named in ``ROW_FIELDS`` (the codes first)
    have one entry per output row, so a device move, a row selection and a stacking map each of
    them alike and leave the other fields as they are."""

    ROW_FIELDS: ClassVar[tuple[str, ...]]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(getattr(self, self.ROW_FIELDS[0]).shape)

    def tensors(self) -> dict[str, torch.Tensor | None]:
        """The per-row tensors by field name (None where a field is absent)."""
        return {name: getattr(self, name) for name in self.ROW_FIELDS}

    def _map(self, fn):
        return replace(self, **{k: None if t is None else fn(t) for k, t in self.tensors().items()})

    def to(self, device: torch.device | str):
        return self._map(lambda t: t.to(device))

    def index_rows(self, index: torch.Tensor):
        return self._map(lambda t: t[index])


def _dequantize_groups(
    codes: torch.Tensor, scales: torch.Tensor, shifts: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    n, k = codes.shape
    w = codes.float().view(n, k // group_size, group_size) * scales[..., None]
    return (w if shifts is None else w + shifts[..., None]).view(n, k)


@dataclass(frozen=True)
class Int8Weight(_RowTensors):
    """``qweight`` int8 ``[N, K]``; ``scales`` ``[N, K / group]`` (float16 values, float32)."""

    ROW_FIELDS: ClassVar = ("qweight", "scales")
    qweight: torch.Tensor
    scales: torch.Tensor
    group_size: int = GROUP_SIZE

    def dequantize(self) -> torch.Tensor:
        return _dequantize_groups(self.qweight, self.scales, None, self.group_size)


@dataclass(frozen=True)
class Int4Weight(_RowTensors):
    """``qvalues`` uint8 ``[N, K]`` in [0, 15]; ``scales``, ``shifts`` ``[N, K / group]``
    (float16 values, float32), or ``shifts`` None: the scale-only form (``int4_sym``), whose
    shift is ``-8 * scale``.

    Invariant: ``shift_values()`` of the scale-only form is exact (a float16 times a power of
    two), and so is ``q * scale + shift`` there: ``q * scale`` and ``-8 * scale`` are exact in
    float32 and their sum ``(q - 8) * scale`` is representable. So ``dequantize()``, every kernel
    that adds a stored shift and every kernel that computes ``-8 * scale`` itself give the same
    values, bit for bit.
    """

    ROW_FIELDS: ClassVar = ("qvalues", "scales", "shifts")
    qvalues: torch.Tensor
    scales: torch.Tensor
    shifts: torch.Tensor | None = None
    group_size: int = GROUP_SIZE

    def shift_values(self) -> torch.Tensor:
        """The shifts, stored or (scale-only form) ``-8 * scales``, for the paths that add one."""
        if self.shifts is not None:
            return self.shifts
        return self.scales * -SYMMETRIC_INT4_ZERO

    def dequantize(self) -> torch.Tensor:
        return _dequantize_groups(self.qvalues, self.scales, self.shift_values(), self.group_size)


@dataclass(frozen=True)
class BlockWeight(_RowTensors):
    """One GGUF type's blocks as the file holds them (the formula in the module docstring).

    ``kind``: the GGUF type (``Q5_0``, ``Q5_1``, ``Q4_K``, ``Q5_K``, ``Q6_K``); ``codes`` uint8
    ``[N, K]`` in ``[0, 2**bits)``; ``scales`` and ``shifts`` ``[N, K / (32 * span)]``
    (float16 values, float32); ``sub`` int8 ``[N, K / 16]``; ``mins`` uint8 ``[N, K / 32]``.
    Weights of one ``kind`` have the same fields set and the same ``bits``, ``offset``, ``span``.
    """

    ROW_FIELDS: ClassVar = ("codes", "scales", "sub", "shifts", "mins")
    kind: str
    codes: torch.Tensor
    bits: int
    offset: int
    scales: torch.Tensor
    sub: torch.Tensor | None = None
    shifts: torch.Tensor | None = None
    mins: torch.Tensor | None = None
    span: int = 1
    group_size: int = GROUP_SIZE

    def dequantize(self) -> torch.Tensor:
        q = self.codes.to(torch.int32) - self.offset
        if self.sub is not None:
            q = q * self.sub.to(torch.int32).repeat_interleave(16, dim=1)
        per_scale = self.group_size * self.span
        w = self.scales.repeat_interleave(per_scale, dim=1) * q.float()
        if self.shifts is None:
            return w
        shift = self.shifts.repeat_interleave(self.span, dim=1)
        if self.mins is not None:
            shift = shift * self.mins.float()
        return w + shift.repeat_interleave(self.group_size, dim=1)


QuantizedWeight = Int8Weight | Int4Weight | BlockWeight


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = w.shape
    if k % group_size:
        raise InvalidArgumentError(
            f"quantization needs in_features divisible by {group_size}, got {k}",
            param="quantization",
        )
    return w.float().view(n, k // group_size, group_size)


def quantize_int8(w: torch.Tensor, group_size: int = GROUP_SIZE) -> Int8Weight:
    """Symmetric per group: ``scale = max|w| / 127`` in float16 (1 for an all-zero group)."""
    g = _groups(w, group_size)
    amax = g.abs().amax(dim=-1)
    scales = _f16(torch.where(amax > 0, amax / 127, torch.ones_like(amax)))
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # a subnormal underflow
    q = torch.round(g / scales[..., None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(q.view(w.shape), scales, group_size)


def quantize_int4(w: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Weight:
    """Asymmetric per group over min..max: ``shift = min``, ``scale = (max - min) / 15``, both in
    float16. A constant group gets scale 0 and every code stands for its value exactly."""
    g = _groups(w, group_size)
    lo, hi = g.amin(dim=-1), g.amax(dim=-1)
    shifts, scales = _f16(lo), _f16((hi - lo) / 15)
    step = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round((g - shifts[..., None]) / step[..., None]).clamp(0, 15).to(torch.uint8)
    return Int4Weight(q.view(w.shape), scales, shifts, group_size)


def quantize_int4_sym(w: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Weight:
    """Scale only per group, as llama.cpp's Q4_0: the value of largest magnitude ``v`` gets code 0
    (``scale = v / -8`` in float16), the others ``round(w / scale) + 8`` clamped to [0, 15] (one
    side reaches -8 steps, the other 7). An all-zero group gets scale 0 and code 8."""
    g = _groups(w, group_size)
    peak = g.gather(-1, g.abs().argmax(dim=-1, keepdim=True))[..., 0]
    scales = _f16(peak / -SYMMETRIC_INT4_ZERO)
    step = torch.where(scales != 0, scales, torch.ones_like(scales))
    q = torch.round(g / step[..., None]) + SYMMETRIC_INT4_ZERO
    return Int4Weight(q.clamp(0, 15).to(torch.uint8).view(w.shape), scales, None, group_size)


_QUANTIZERS = {"int8": quantize_int8, "int4": quantize_int4, "int4_sym": quantize_int4_sym}
QUANTIZATION_METHODS = tuple(_QUANTIZERS)


def quantize(w: torch.Tensor, method: str) -> QuantizedWeight:
    if method not in QUANTIZATION_METHODS:
        raise InvalidArgumentError(
            f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None, "
            f"got {method!r}",
            param="quantization",
        )
    return _QUANTIZERS[method](w)


def in_scheme(weight: QuantizedWeight, scheme: str) -> QuantizedWeight | None:
    """``weight`` in ``scheme`` with its values unchanged: itself where it is in ``scheme``; a
    scale-only int4 as ``int4`` with its shifts stored (``shift_values()``: exact); None where
    only re-quantizing would give ``scheme``."""
    if scheme_of(weight) == scheme:
        return weight
    if scheme == "int4" and scheme_of(weight) == "int4_sym":
        return replace(weight, shifts=weight.shift_values())
    return None


def scheme_of(weight: QuantizedWeight) -> str:
    """``int8``, ``int4``, ``int4_sym`` (an ``Int4Weight`` without shifts), or a
    ``BlockWeight``'s GGUF type in lower case (``q6_k``)."""
    if isinstance(weight, BlockWeight):
        return weight.kind.lower()
    if isinstance(weight, Int8Weight):
        return "int8"
    return "int4" if weight.shifts is not None else "int4_sym"


def concat_rows(parts: list[QuantizedWeight | None]) -> QuantizedWeight | None:
    """Stack weights along the output dim (a fused qkv or gate_up); None unless every part is
    given and all share one scheme and group size."""
    first = parts[0]
    if first is None or any(
        p is None or scheme_of(p) != scheme_of(first) or p.group_size != first.group_size
        for p in parts
    ):
        return None
    stacked = {k: None if t is None else torch.cat([p.tensors()[k] for p in parts])
               for k, t in first.tensors().items()}  # fmt: skip
    return replace(first, **stacked)
