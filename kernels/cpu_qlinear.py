"""Weights laid out for the integer kernels of ``cpu_qlinear.cpp`` (W8A8, W4A8: int8 or int4
weights times activations quantized to int8 in blocks of 32), and the calls. The C++ file states
the arithmetic and the layouts; ``tests/qlinear_reference.py`` computes the same arithmetic in
torch, which the kernels equal bit for bit.

Both schemes keep what ``quantization.Int8Weight`` / ``Int4Weight`` hold (codes in groups of 32,
float16 scales, and shifts where an ``Int4Weight`` has them), reordered so that each 4-byte word holds one output row's codes of
consecutive inputs; ``*_rows`` read rows of codes back (an embedding lookup).
"""

from __future__ import annotations

import torch

from prefixserve.kernels.cpu_linear import LANES, _blocks

BLOCK = 32  # inputs per weight group and per activation block


def pack_w8a8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes ``[N, K]`` and group-32 scales ``[N, K / 32]`` -> ``[NB, K / 4, 16, 4]`` uint8
    (code + 128; word ``(j, lane)`` holds k = 4j .. 4j + 3) and float16 ``[NB, K / 32, 16]``."""
    biased = (codes.to(torch.int16) + 128).to(torch.uint8)
    blocks = _blocks(biased)  # [NB, K, 16]
    words = blocks.unflatten(1, (-1, 4)).transpose(-1, -2)  # [NB, K / 4, 16, 4]
    return words.contiguous(), _blocks(scales.to(torch.float16))


def pack_w4a8(
    codes: torch.Tensor, scales: torch.Tensor, shifts: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Codes ``[N, K]`` in [0, 15] and group-32 scales and shifts ``[N, K / 32]`` -> ``[NB, K / 8,
    16, 4]`` uint8 (byte i of word ``(j, lane)``: low nibble k = 8j + i, high 8j + 4 + i) and
    float16 ``[NB, K / 32, 16]`` scales and shifts; shifts None (the scale-only scheme, shift
    ``-8 * scale``) stays None."""
    half = torch.float16
    packed_shifts = None if shifts is None else _blocks(shifts.to(half))
    return int4_words(codes), _blocks(scales.to(half)), packed_shifts


def int4_words(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[N, K]`` in [0, 15] -> ``[NB, K / 8, 16, 4]`` uint8: byte i of word ``(j, lane)``
    holds k = 8j + i in its low nibble and 8j + 4 + i in its high."""
    blocks = _blocks(codes.to(torch.uint8)).unflatten(1, (-1, 2, 4))  # [NB, K / 8, 2, 4, 16]
    pairs = blocks[:, :, 0] | (blocks[:, :, 1] << 4)  # [NB, K / 8, 4, 16]
    return pairs.transpose(-1, -2).contiguous()


def w8a8_rows(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """int8 codes ``[len(index), K]`` of rows ``index`` of a ``pack_w8a8`` tensor."""
    words = packed[index // LANES, :, index % LANES]  # [T, K / 4, 4]
    return (words.flatten(-2).to(torch.int16) - 128).to(torch.int8)


def w4a8_rows(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Codes ``[len(index), K]`` in [0, 15] of rows ``index`` of a ``pack_w4a8`` tensor."""
    words = packed[index // LANES, :, index % LANES]  # [T, K / 8, 4]
    return torch.cat([words & 15, words >> 4], dim=-1).flatten(-2)


def linear_w8a8(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    return torch.ops.prefixserve_cpu.linear_w8a8(x, codes, scales, bias, n)


def linear_w4a8(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    shifts: torch.Tensor | None,
    bias: torch.Tensor | None,
    n: int,
) -> torch.Tensor:
    """Shifts None: the scale-only scheme (shift ``-8 * scale``, computed by the kernel)."""
    return torch.ops.prefixserve_cpu.linear_w4a8(x, codes, scales, shifts, bias, n)


def isa() -> str:
    """Which integer instructions the build uses: ``avx512_vnni``, ``avx2`` or ``portable``."""
    return torch.ops.prefixserve_cpu.qlinear_isa()
