"""GGUF's block types read straight into prefixserve's schemes, keeping the file's codes and
parameters exactly: Q8_0 as ``Int8Weight``, Q4_0 and Q4_1 as ``Int4Weight`` (Q4_0 without
shifts), and Q5_0, Q5_1, Q4_K, Q5_K, Q6_K as ``BlockWeight`` (``quantization``'s formula;
group ``s`` of 32 values).

Byte layouts (ggml, little-endian, one row = consecutive blocks), and what each is kept as:

- Q8_0, 34 bytes / 32 values: f16 ``d``, 32 int8 codes; value ``d * q``. int8, scale ``d``.
- Q4_0, 18 bytes / 32 values: f16 ``d``, 16 bytes of codes; value ``d * (q - 8)``. int4 in
  the scale-only form (``int4_sym``): scale ``d``, no shifts.
- Q4_1, 20 bytes / 32 values: f16 ``d``, f16 ``m``, 16 bytes of codes; value ``d * q + m``.
  int4: scale ``d``, shift ``m``.
- Q5_0, 22 bytes / 32 values: f16 ``d``, 4 bytes of high bits (bit ``j`` of the little-endian
  word: value ``j``), 16 bytes of low nibbles; value ``d * (q - 16)``. Offset 16.
- Q5_1, 24 bytes / 32 values: f16 ``d``, f16 ``m``, high bits, low nibbles; ``d * q + m``.
- Q4_K, 144 bytes / 256 values: f16 ``d``, f16 ``dmin``, 12 bytes packing eight 6-bit
  (scale, min) pairs, 128 bytes of codes; group ``s`` has value ``d * sc_s * q - dmin * m_s``.
  Span 8: scale ``d``, sub ``sc_s`` (both halves of the group), shift ``-dmin``, mins ``m_s``.
- Q5_K, 176 bytes / 256 values: as Q4_K, then 32 bytes of high bits (bit ``s`` of byte ``l``:
  value ``l`` of group ``s``) before the 128 bytes of low nibbles.
- Q6_K, 210 bytes / 256 values: 128 bytes of low nibbles, 64 bytes of 2-bit high parts,
  16 int8 scales (one per 16 values), f16 ``d``; value ``d * sc * (q - 32)``. Span 8, offset 32.

In Q4_0 / Q4_1 / Q5_0 / Q5_1 byte ``j`` of the low nibbles holds value ``j`` (low nibble) and
``j + 16`` (high nibble). In Q4_K / Q5_K each 32 code bytes hold two groups: low nibbles the
first, high the second. In Q6_K each half of 128 values has 64 low-nibble bytes (byte ``l``:
value ``l`` low nibble, ``l + 64`` high) and 32 high-part bytes (byte ``l``, bits ``2t``,
``2t + 1``: value ``l + 32 t``).
"""

from __future__ import annotations

import numpy as np
import torch

from prefixserve.models.quantization import BlockWeight, Int4Weight, Int8Weight

INT4_TYPES = ("Q4_0", "Q4_1")
INT8_TYPES = ("Q8_0",)
BLOCK_TYPES = ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def _f16(raw: np.ndarray) -> np.ndarray:
    """``[..., 2]`` uint8 -> ``[...]`` float32."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_32(codes: np.ndarray) -> np.ndarray:
    """``[..., 16]`` code bytes -> ``[..., 32]`` codes, low nibbles first."""
    return np.concatenate([codes & 0xF, codes >> 4], axis=-1)


def _bits(raw: np.ndarray) -> np.ndarray:
    """``[..., B]`` bytes -> ``[..., 8 B]`` bits, little-endian (bit ``i`` of byte ``j``: 8j + i)."""
    return np.unpackbits(np.ascontiguousarray(raw), axis=-1, bitorder="little")


def _t(a: np.ndarray, rows: int, dtype=None) -> torch.Tensor:
    """``a`` as a contiguous torch tensor of ``rows`` rows."""
    return torch.from_numpy(np.ascontiguousarray(a.reshape(rows, -1), dtype=dtype))


def _params(a: np.ndarray, rows: int) -> torch.Tensor:
    """Float16 parameters as the schemes keep them, float32 (exact: they are float16 values)."""
    return _t(a, rows, np.float32)


def read_int8(kind: str, data: np.ndarray) -> Int8Weight:
    """``data``: uint8 ``[rows, bytes_per_row]`` of ``kind`` (one of ``INT8_TYPES``)."""
    assert kind == "Q8_0", kind
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, 34)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
    return Int8Weight(_t(q, rows).clone(), _params(_f16(blocks[..., 0:2]), rows), 32)


def read_int4(kind: str, data: np.ndarray) -> Int4Weight:
    """``data``: uint8 ``[rows, bytes_per_row]`` of ``kind`` (one of ``INT4_TYPES``)."""
    rows = data.shape[0]
    if kind == "Q4_0":
        blocks = data.reshape(rows, -1, 18)
        d, codes = _f16(blocks[..., 0:2]), blocks[..., 2:]
        shifts = None
    else:
        assert kind == "Q4_1", kind
        blocks = data.reshape(rows, -1, 20)
        d, m, codes = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4]), blocks[..., 4:]
        shifts = _params(m, rows)
    q = _t(_nibbles_32(codes), rows, np.uint8)
    return Int4Weight(q, _params(d, rows), shifts, 32)


def read_block(kind: str, data: np.ndarray) -> BlockWeight:
    """``data``: uint8 ``[rows, bytes_per_row]`` of ``kind`` (one of ``BLOCK_TYPES``)."""
    rows = data.shape[0]
    if kind in ("Q5_0", "Q5_1"):
        shifted = kind == "Q5_1"
        blocks = data.reshape(rows, -1, 24 if shifted else 22)
        d = _f16(blocks[..., 0:2])
        rest = blocks[..., 4:] if shifted else blocks[..., 2:]
        q = _nibbles_32(rest[..., 4:]) | (_bits(rest[..., :4]) << 4)
        if shifted:
            m = _params(_f16(blocks[..., 2:4]), rows)
            return BlockWeight(kind, _t(q, rows), 5, 0, _params(d, rows), shifts=m)
        return BlockWeight(kind, _t(q, rows), 5, 16, _params(d, rows))
    if kind in ("Q4_K", "Q5_K"):
        return _read_k(kind, data, rows)
    assert kind == "Q6_K", kind
    blocks = data.reshape(rows, -1, 210)
    low = blocks[..., :128].reshape(rows, -1, 2, 64)  # [rows, sb, half, 64]
    high = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32)  # [rows, sb, half, 1, 32]
    low = np.concatenate([low & 0xF, low >> 4], axis=-1)  # [rows, sb, half, 128]
    high = (high >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [rows, sb, half, 4, 32]
    q = low | (high.reshape(low.shape) << 4)
    sub = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8)
    d = _params(_f16(blocks[..., 208:210]), rows)
    return BlockWeight(kind, _t(q, rows), 6, 32, d, sub=_t(sub, rows), span=8)


def _read_k(kind: str, data: np.ndarray, rows: int) -> BlockWeight:
    """Q4_K and Q5_K: scale ``d``, sub ``sc_s`` for both halves of group ``s``, shift
    ``-dmin``, mins ``m_s``."""
    five = kind == "Q5_K"
    blocks = data.reshape(rows, -1, 176 if five else 144)
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, mn = _q4_k_scales_mins(blocks[..., 4:16])  # [rows, superblocks, 8] each
    codes = blocks[..., 48:] if five else blocks[..., 16:]
    codes = codes.reshape(rows, -1, 4, 1, 32)  # 4 chunks, each two groups
    q = np.concatenate([codes & 0xF, codes >> 4], axis=3).reshape(rows, -1, 8, 32)
    if five:  # bit s of byte l: value l of group s
        q = q | (_bits(blocks[..., 16:48, None]).swapaxes(-1, -2) << 4)
    sub = np.repeat(sc, 2, axis=-1).astype(np.int8)  # [rows, sb, 16]
    return BlockWeight(kind, _t(q, rows), 5 if five else 4, 0, _params(d, rows),
                       sub=_t(sub, rows), shifts=_params(-dmin, rows), mins=_t(mn, rows),
                       span=8)  # fmt: skip


def _q4_k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes -> eight 6-bit scales and mins (uint8): groups 0-3 in the low 6 bits of bytes
    0-3 / 4-7; groups 4-7 take 4 low bits from bytes 8-11 (scale: low nibble, min: high
    nibble) and their top 2 bits from the top 2 bits of bytes 0-3 (scale) / 4-7 (min)."""
    p = packed.astype(np.uint8)
    lo_sc, lo_mn, hi = p[..., 0:4], p[..., 4:8], p[..., 8:12]
    sc = np.concatenate([lo_sc & 63, (hi & 0xF) | ((lo_sc >> 6) << 4)], axis=-1)
    mn = np.concatenate([lo_mn & 63, (hi >> 4) | ((lo_mn >> 6) << 4)], axis=-1)
    return sc, mn
