"""The memory roofline of a decode step: every weight byte is read once per step, so a step takes
at least ``weight bytes / memory bandwidth``.

Bandwidth is measured once with a torch copy of a tensor far larger than the caches
(``dst.copy_(src)``, best of ``repeats``), counting the bytes it reads plus the bytes it writes
(the STREAM "copy" convention). A decode step only reads weights, so this is the rate the memory
system sustains, not a bound above it.
"""

from __future__ import annotations

import time

import torch


def copy_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes per second moved by a ``mib`` MiB float32 copy (read + write), the best of
    ``repeats`` after one untimed warm-up copy."""
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def roofline_tokens_per_s(weight_bytes: int, bandwidth: float, streams: int = 1) -> float:
    """Tokens/s of ``streams`` streams if each step took only the time to read the weights once."""
    if weight_bytes <= 0 or bandwidth <= 0:
        raise ValueError("weight_bytes and bandwidth must be positive")
    return streams * bandwidth / weight_bytes
