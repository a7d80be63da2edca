"""Choose the attention backend: ``auto`` is Triton on CUDA, the C++ CPU backend on CPU where its
kernels build, and the torch reference elsewhere."""

from __future__ import annotations

import torch

from prefixserve.attention.backend import AttentionBackend
from prefixserve.core.errors import BackendUnavailableError, InvalidArgumentError
from prefixserve.kernels import cpu_ops


def get_attention_backend(
    name: str, device: torch.device, batch_invariant: bool = False
) -> AttentionBackend:
    if batch_invariant and (name not in ("auto", "cpu") or device.type != "cpu"):
        raise InvalidArgumentError(
            "batch_invariant runs on CPU with the cpu attention backend only",
            param="batch_invariant",
        )
    if name == "auto":
        if device.type == "cuda":
            name = "triton" if _triton_importable() else "torch"
        elif device.type == "cpu" and (batch_invariant or cpu_ops.available()):
            name = "cpu"
        else:
            name = "torch"
    if name == "triton":
        from prefixserve.attention.triton_backend import (
            TritonAttentionBackend,
            check_triton_available,
        )

        check_triton_available(device)
        return TritonAttentionBackend()
    if name == "cpu":
        if device.type != "cpu":
            raise BackendUnavailableError("attention_backend='cpu' runs on CPU only")
        from prefixserve.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend(batch_invariant)
    if name == "torch":
        from prefixserve.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    raise BackendUnavailableError(
        f"unknown attention backend {name!r}; use auto, cpu, torch or triton"
    )


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
