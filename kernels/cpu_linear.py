"""Weights laid out for the CPU linear kernels of ``cpu_linear.cpp`` (built by ``cpu_ops``), and
the calls: blocks of 16 output rows, streamed once per call whatever the number of input rows
(see the C++ file for the layouts and the batch-invariance argument).

The ``pack_*`` functions lay weights out for the kernels (rows past ``N`` in the last block are
zero and never written out); ``block_rows`` reads rows back (an embedding lookup).
"""

from __future__ import annotations

import mmap

import torch

LANES = 16


def _blocks(t: torch.Tensor) -> torch.Tensor:
    """``[N, ...]`` -> ``[ceil(N / 16), ..., 16]``: rows padded with zeros to whole blocks, each
    block's rows moved to the last dim."""
    n = t.shape[0]
    pad = -n % LANES
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    t = t.view(-1, LANES, *t.shape[1:])
    return t.movedim(1, -1).contiguous()


HUGE_PAGE = 2 << 20


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in anonymous memory aligned to 2 MiB that the kernel is asked to back with
    transparent huge pages (``MADV_HUGEPAGE``; this machine's default is ``madvise``); ``t``
    itself where it is smaller than one such page or the platform has no ``madvise``."""
    if t.nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return t
    buf = mmap.mmap(-1, t.nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # shared: never huge
    buf.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(buf, dtype=torch.uint8)  # holds buf
    start = -raw.data_ptr() % HUGE_PAGE
    out = raw[start : start + t.nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def pack_f32(weight: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` float32 -> ``[NB, K, 16]``."""
    return on_huge_pages(_blocks(weight.float()))


def pack_int8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes ``[N, K]`` and group scales ``[N, K / group]`` -> codes ``[NB, K, 16]`` and
    float16 scales ``[NB, K / group, 16]``."""
    return _blocks(codes.to(torch.int8)), _blocks(scales.to(torch.float16))


def pack_int4(
    codes: torch.Tensor, scales: torch.Tensor, shifts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes ``[N, K]`` in [0, 15] with ``w = code * scale + shift`` per group (``scales``,
    ``shifts``: ``[N, K / group]``) -> bytes ``[NB, K / 2, 16]`` (k even low nibble, k odd high)
    and float16 ``[NB, K / group, 16]`` scales and shifts."""
    q = codes.to(torch.uint8)
    pairs = q[:, 0::2] | (q[:, 1::2] << 4)  # [N, K / 2]
    half = torch.float16
    return _blocks(pairs), _blocks(scales.to(half)), _blocks(shifts.to(half))


def block_rows(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of a ``[NB, ..., 16]`` packed tensor: ``[len(index), ...]``."""
    return packed[index // LANES, ..., index % LANES]


def linear_f32(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    return torch.ops.prefixserve_cpu.linear_f32(x, packed, bias, n)


def linear_int8(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    bias: torch.Tensor | None,
    n: int,
) -> torch.Tensor:
    return torch.ops.prefixserve_cpu.linear_int8(x, codes, scales, group, bias, n)


def linear_int4(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    shifts: torch.Tensor,
    group: int,
    bias: torch.Tensor | None,
    n: int,
) -> torch.Tensor:
    return torch.ops.prefixserve_cpu.linear_int4(x, codes, scales, shifts, group, bias, n)
