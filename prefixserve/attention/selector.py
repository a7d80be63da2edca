"""Choose the attention backend: ``auto`` is Triton on CUDA and the torch reference elsewhere."""

from __future__ import annotations

import torch

from prefixserve.attention.backend import AttentionBackend
from prefixserve.errors import BackendUnavailableError


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_importable() else "torch"
    if name == "triton":
        from prefixserve.attention.triton_backend import (
            TritonAttentionBackend,
            check_triton_available,
        )

        check_triton_available(device)
        return TritonAttentionBackend()
    if name == "torch":
        from prefixserve.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    raise BackendUnavailableError(f"unknown attention backend {name!r}; use auto, torch or triton")


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
