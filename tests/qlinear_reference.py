"""The arithmetic of ``kernels/cpu_qlinear.cpp`` (W8A8, W4A8) and of ``cpu_klinear.cpp`` on int8
activations (GGUF's block types) written in torch, operation for operation: activations quantized
per row in blocks of 32, exact integer block sums, then the float scaling with one rounding per
operation, groups ascending, then the bias. The kernels must equal it bit for bit."""

from __future__ import annotations

import torch

from prefixserve.models.quantization import BlockWeight, Int4Weight, Int8Weight

BLOCK = 32


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[M, K]`` float32 -> (codes ``[M, K / 32, 32]`` int64, scales ``d [M, K / 32]``, code sums
    ``[M, K / 32]`` int64): ``d = max|x| / 127``, codes ``round_half_even(x / d)`` in [-127, 127],
    0 where ``d`` is 0."""
    blocks = x.view(x.shape[0], -1, BLOCK)
    amax = blocks.abs().amax(dim=-1)
    d = amax / torch.full_like(amax, 127.0)  # a tensor divisor: a true division, as in C++
    ratio = blocks / torch.where(d > 0, d, torch.ones_like(d))[..., None]
    codes = torch.where(d[..., None] > 0, torch.round(ratio), torch.zeros_like(ratio))
    codes = codes.clamp(-127, 127).long()
    return codes, d, codes.sum(dim=-1)


def _block_sums(codes: torch.Tensor, weight_codes: torch.Tensor) -> torch.Tensor:
    """``[M, G, 32]`` x ``[N, G, 32]`` integer codes -> ``[M, N, G]`` exact int64 sums."""
    return (codes[:, None] * weight_codes[None]).sum(dim=-1)


def _finish(parts: list[torch.Tensor], bias: torch.Tensor | None, shape) -> torch.Tensor:
    """Sums ``parts`` (each ``[M, N]``) in order from 0, then adds the bias (0 when none)."""
    acc = torch.zeros(shape)
    for part in parts:
        acc = acc + part
    return acc + (bias if bias is not None else torch.zeros(shape[1]))


def linear_w8a8(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    codes, d, _ = quantize_activations(x)
    n = weight.shape[0]
    sums = _block_sums(codes, weight.qweight.long().view(n, -1, BLOCK)).float()
    parts = [sums[:, :, g] * (weight.scales[None, :, g] * d[:, g, None])
             for g in range(d.shape[1])]  # fmt: skip
    return _finish(parts, bias, (x.shape[0], n))


def linear_w4a8(x: torch.Tensor, weight: Int4Weight, bias: torch.Tensor | None) -> torch.Tensor:
    codes, d, qsum = quantize_activations(x)
    n = weight.shape[0]
    sums = _block_sums(codes, weight.qvalues.long().view(n, -1, BLOCK)).float()
    dsum = d * qsum.float()
    shifts = weight.shift_values()  # the scale-only form: -8 * scales, exact
    parts = []
    for g in range(d.shape[1]):
        parts.append(sums[:, :, g] * (weight.scales[None, :, g] * d[:, g, None]))
        parts.append(shifts[None, :, g] * dsum[:, g, None])
    return _finish(parts, bias, (x.shape[0], n))


def linear_kq8(x: torch.Tensor, weight: BlockWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``kernels/cpu_klinear.cpp`` on int8 activations: half-block integer sums, the offset
    times the half-block code sums, sub-block scales, all exact; then per group
    ``float(S) * (scale * d)`` and ``(shift * float(min)) * (d * float(Q))``."""
    codes, d, qsum = quantize_activations(x)
    m, n, groups = x.shape[0], weight.shape[0], d.shape[1]
    xc = codes.view(m, groups, 2, 16)
    t = (xc[:, None] * weight.codes.long().view(n, groups, 2, 16)[None]).sum(dim=-1)
    if weight.sub is not None:  # [M, N, G, 2] halves, each scaled
        q16 = xc.sum(dim=-1)[:, None]
        s = (weight.sub.long().view(n, groups, 2)[None] * (t - weight.offset * q16)).sum(dim=-1)
    else:
        s = t.sum(dim=-1) - weight.offset * qsum[:, None]
    scales = weight.scales.repeat_interleave(weight.span, dim=1)
    dsum = d * qsum.float()
    shifts = None
    if weight.shifts is not None:
        shifts = weight.shifts.repeat_interleave(weight.span, dim=1)
        if weight.mins is not None:
            shifts = shifts * weight.mins.float()
    parts = []
    for g in range(groups):
        parts.append(s[:, :, g].float() * (scales[None, :, g] * d[:, g, None]))
        if shifts is not None:
            parts.append(shifts[None, :, g] * dsum[:, g, None])
    return _finish(parts, bias, (m, n))
