"""The reference a quantized linear is tested against: the same weight, the same rounding."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class KernelLinear(torch.nn.Module):
    """What a quantized linear computes: ``round(round(x) @ W^T) + b``, with ``round`` to
    bfloat16 on the packed kernels and the identity on the portable path."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: bool) -> None:
        super().__init__()
        self.weight, self.bias, self.packed = weight, bias, packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            x = x.to(torch.bfloat16).float()
        y = F.linear(x, self.weight)
        if self.packed:
            y = y.to(torch.bfloat16).float()
        return y if self.bias is None else y + self.bias
