"""GGUF's block types (``quantization.BlockWeight``: Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) laid out for
the kernels of ``cpu_klinear.cpp``, and the calls: int8 activations (``linear_kq8``, integer
sums as ``cpu_qlinear``'s) or float32 activations (``linear_kf32``). The C++ file states the
arithmetic and the layouts; ``tests/qlinear_reference.py`` computes the int8 path's arithmetic
in torch, which the kernel equals bit for bit.

The layout keeps the file's numbers: code bits 0-3 in ``cpu_qlinear``'s int4 words, bits 4-5
beside them, and the float16 scales and shifts, int8 sub-block scales and uint8 mins as the file
has them (one per ``span`` groups, per 16 inputs, per group), each in blocks of 16 output rows.
"""

from __future__ import annotations

import torch

from prefixserve.kernels.cpu_linear import LANES, _blocks, block_rows
from prefixserve.kernels.cpu_qlinear import int4_words, w4a8_rows

Packed = dict[str, torch.Tensor | None]  # what pack_block returns: name -> tensor or None


def pack_high(codes: torch.Tensor, bits: int) -> torch.Tensor | None:
    """Code bits 4 .. ``bits`` - 1 of ``[N, K]`` codes -> ``[NB, K / 32, E, 16, 4]`` uint8
    (``E = bits - 4``; None for 4 bits): value k = 32g + 8j + 4h + i sits in slot s = 2j + h,
    bits ``(s E) % 8 ..`` of byte i of word ``(g, s E / 8, lane)``."""
    e = bits - 4
    if e == 0:
        return None
    high = _blocks((codes.to(torch.uint8) >> 4).to(torch.int32))  # [NB, K, 16]
    nb, k = high.shape[:2]
    slots = high.view(nb, k // 32, e, 8 // e, 4, LANES)  # [NB, G, word, slot in word, i, lane]
    place = (torch.arange(8 // e, dtype=torch.int32) * e).view(1, 1, 1, -1, 1, 1)
    words = (slots << place).sum(dim=3)  # disjoint bits: the sum is their OR
    return words.transpose(-1, -2).to(torch.uint8).contiguous()  # [NB, G, E, 16, 4]


def high_rows(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Bits 4.. of the codes ``[len(index), K]`` of rows ``index`` of a ``pack_high`` tensor."""
    e = packed.shape[2]
    words = packed[index // LANES, :, :, index % LANES].to(torch.int32)  # [T, G, E, 4]
    place = (torch.arange(8 // e, dtype=torch.int32) * e).view(1, 1, 1, -1, 1)
    slots = (words[:, :, :, None] >> place) & ((1 << e) - 1)  # [T, G, E, 8 / E, 4]
    return slots.flatten(1).to(torch.uint8)  # (g, s, i): k = 32g + 4s + i


def pack_block(
    codes: torch.Tensor,
    bits: int,
    scales: torch.Tensor,
    sub: torch.Tensor | None,
    shifts: torch.Tensor | None,
    mins: torch.Tensor | None,
) -> Packed:
    """A ``BlockWeight``'s tensors in the kernels' layout: ``low``, ``high`` (None for 4-bit
    codes), float16 ``scales`` / ``shifts``, int8 ``sub``, uint8 ``mins`` (None where absent)."""

    def lanes(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        return None if t is None else _blocks(t.to(dtype))

    return {
        "low": int4_words(codes & 15),
        "high": pack_high(codes, bits),
        "scales": lanes(scales, torch.float16),
        "sub": lanes(sub, torch.int8),
        "shifts": lanes(shifts, torch.float16),
        "mins": lanes(mins, torch.uint8),
    }


def block_codes(low: torch.Tensor, high: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor:
    """The codes ``[len(index), K]`` of rows ``index`` of a ``pack_block`` layout."""
    codes = w4a8_rows(low, index)
    return codes if high is None else codes | (high_rows(high, index) << 4)


def param_rows(t: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    """Rows ``index`` of a packed parameter tensor (None stays None)."""
    return None if t is None else block_rows(t, index)


def linear_kq8(
    x: torch.Tensor, packed: Packed, bits: int, offset: int, span: int,
    bias: torch.Tensor | None, n: int,
) -> torch.Tensor:  # fmt: skip
    """``x W^T + bias`` on int8 activations (``cpu_klinear.cpp``)."""
    return torch.ops.prefixserve_cpu.linear_kq8(x, *_args(packed, bits, offset, span), bias, n)


def linear_kf32(
    x: torch.Tensor, packed: Packed, bits: int, offset: int, span: int,
    bias: torch.Tensor | None, n: int,
) -> torch.Tensor:  # fmt: skip
    """``x W^T + bias`` on float32 activations (``cpu_klinear.cpp``)."""
    return torch.ops.prefixserve_cpu.linear_kf32(x, *_args(packed, bits, offset, span), bias, n)


def _args(packed: Packed, bits: int, offset: int, span: int) -> tuple:
    """The ops' weight arguments, in their order."""
    names = ("low", "high", "scales", "sub", "shifts", "mins")
    return (*(packed[k] for k in names), bits, offset, span)
