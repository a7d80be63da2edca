"""RMSNorm on CPU (``cpu_norm.cpp``, built by ``cpu_ops``) for float32 rows, and the residual add
fused with it. A row's result depends on that row alone, through one fixed operation sequence;
eager and compiled steps call the same ops, so they give the same bits."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` over the last dim of ``x`` [..., D]."""
    return torch.ops.prefixserve_cpu.rms_norm(x.contiguous(), weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``."""
    return torch.ops.prefixserve_cpu.add_rms_norm(
        x.contiguous(), residual.contiguous(), weight, eps
    )
