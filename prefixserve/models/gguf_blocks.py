"""GGUF's 8-bit and 4-bit block types read straight into prefixserve's schemes (``Int8Weight``,
``Int4Weight``): the file's codes, and its float16 scales as the groups' parameters.

Every type below stores 32-value groups whose values are ``a * q + b`` with a code ``q`` and
per-group ``a``, ``b``; the schemes write the same value as ``q * scale + shift`` (int8: no
shift), so ``scale = a``, ``shift = b``. Byte layouts (ggml, little-endian, one row =
consecutive blocks):

- Q8_0, 34 bytes / 32 values: f16 ``d``, 32 int8 codes; value ``d * q``.
- Q4_0, 18 bytes / 32 values: f16 ``d``, 16 bytes of codes; value ``d * q - 8 d``.
- Q4_1, 20 bytes / 32 values: f16 ``d``, f16 ``m``, 16 bytes of codes; value ``d * q + m``.
- Q4_K, 144 bytes / 256 values: f16 ``d``, f16 ``dmin``, 12 bytes packing eight 6-bit
  (scale, min) pairs, 128 bytes of codes; group ``s`` has value ``d*sc_s * q - dmin*m_s``.

Q8_0, Q4_0 and Q4_1 are kept exactly (their parameters are float16 numbers). Q4_K's ``d*sc_s``
and ``dmin*m_s`` are rounded to float16, as the scheme keeps them (relative error at most 2^-11
of a group's step). In Q4_0 / Q4_1 byte ``j`` of the codes holds value ``j`` (low nibble) and
``j + 16`` (high nibble). In Q4_K each 32 code bytes hold two groups: low nibbles the first, high
the second.
"""

from __future__ import annotations

import numpy as np
import torch

from prefixserve.models.quantization import Int4Weight, Int8Weight

INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
INT8_TYPES = ("Q8_0",)


def _f16(raw: np.ndarray) -> np.ndarray:
    """``[..., 2]`` uint8 -> ``[...]`` float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_32(codes: np.ndarray) -> np.ndarray:
    """``[..., 16]`` code bytes -> ``[..., 32]`` codes, low nibbles first."""
    return np.concatenate([codes & 0xF, codes >> 4], axis=-1)


def _params(a: np.ndarray) -> torch.Tensor:
    """Per-group parameters as the schemes keep them: float16 values in float32."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)).half().float()


def _int4(q: np.ndarray, a: np.ndarray, b: np.ndarray, rows: int) -> Int4Weight:
    """Codes ``[rows, groups, 32]``, per-group ``a``, ``b`` ``[rows, groups]`` -> Int4Weight."""
    qvalues = torch.from_numpy(np.ascontiguousarray(q.reshape(rows, -1), dtype=np.uint8))
    return Int4Weight(qvalues, _params(a), _params(b), 32)


def read_int8(kind: str, data: np.ndarray) -> Int8Weight:
    """``data``: uint8 ``[rows, bytes_per_row]`` of ``kind`` (one of ``INT8_TYPES``)."""
    assert kind == "Q8_0", kind
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 34)
    d = _f16(blocks[..., 0:2])
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(rows, -1)
    return Int8Weight(torch.from_numpy(q.copy()), _params(d), 32)


def read_int4(kind: str, data: np.ndarray) -> Int4Weight:
    """``data``: uint8 ``[rows, bytes_per_row]`` of ``kind`` (one of ``INT4_TYPES``)."""
    rows = data.shape[0]
    if kind == "Q4_0":
        blocks = data.reshape(rows, -1, 18)
        d = _f16(blocks[..., 0:2])
        return _int4(_nibbles_32(blocks[..., 2:]), d, -8 * d, rows)
    if kind == "Q4_1":
        blocks = data.reshape(rows, -1, 20)
        d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
        return _int4(_nibbles_32(blocks[..., 4:]), d, m, rows)
    assert kind == "Q4_K", kind
    blocks = data.reshape(rows, -1, 144)
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, mn = _q4_k_scales_mins(blocks[..., 4:16])  # [rows, superblocks, 8] each
    codes = blocks[..., 16:].reshape(rows, -1, 4, 32)  # 4 chunks, each two groups
    q = np.stack([codes & 0xF, codes >> 4], axis=3)  # [rows, sb, 4, 2, 32]
    a = d[..., None] * sc
    b = -dmin[..., None] * mn
    groups = q.shape[1] * 8
    return _int4(
        q.reshape(rows, groups, 32), a.reshape(rows, groups), b.reshape(rows, groups), rows
    )


def _q4_k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes -> eight 6-bit scales and mins: groups 0-3 in the low 6 bits of bytes 0-3 / 4-7;
    groups 4-7 take 4 low bits from bytes 8-11 (scale: low nibble, min: high nibble) and their
    top 2 bits from the top 2 bits of bytes 0-3 (scale) / 4-7 (min)."""
    p = packed.astype(np.uint8)
    lo_sc, lo_mn, hi = p[..., 0:4], p[..., 4:8], p[..., 8:12]
    sc = np.concatenate([lo_sc & 63, (hi & 0xF) | ((lo_sc >> 6) << 4)], axis=-1)
    mn = np.concatenate([lo_mn & 63, (hi >> 4) | ((lo_mn >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)
