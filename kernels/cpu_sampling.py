"""The sampling step's checks on CPU (``cpu_sampling.cpp``, built by ``cpu_ops``)."""

from __future__ import annotations

import torch

from prefixserve.kernels import cpu_ops


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """bool ``[N]``: whether every logit of each row of ``logits`` ``[N, V]`` is finite. The C++
    op on float32 CPU rows (one read per row, no thread team for a few rows); torch elsewhere."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and cpu_ops.available():
        return torch.ops.prefixserve_cpu.finite_rows(logits.contiguous())
    return torch.isfinite(logits).all(dim=-1)
