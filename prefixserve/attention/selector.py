"""Choose the attention backend: ``auto`` is Triton on CUDA and the torch reference elsewhere."""

from __future__ import annotations

import torch

from prefixserve.attention.backend import AttentionBackend
from prefixserve.core.errors import BackendUnavailableError, InvalidArgumentError


def get_attention_backend(
    name: str, device: torch.device, batch_invariant: bool = False
) -> AttentionBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_importable() else "torch"
    if batch_invariant and (name != "torch" or device.type != "cpu"):
        raise InvalidArgumentError(
            "batch_invariant runs on CPU with the torch attention backend only",
            param="batch_invariant",
        )
    if name == "triton":
        from prefixserve.attention.triton_backend import (
            TritonAttentionBackend,
            check_triton_available,
        )

        check_triton_available(device)
        return TritonAttentionBackend()
    if name == "torch":
        from prefixserve.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(batch_invariant)
    raise BackendUnavailableError(f"unknown attention backend {name!r}; use auto, torch or triton")


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
