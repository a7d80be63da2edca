"""GGUF block types read into prefixserve's schemes (``gguf_blocks``): every kept type's values
equal ``gguf.quants.dequantize`` of the same bytes bit for bit, on random blocks (every code and
scale byte drawn at random) and on blocks of all-zero and all-one bytes (the extreme codes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from gguf_files import BLOCK_LAYOUTS, random_blocks

from prefixserve.models.gguf_blocks import (
    BLOCK_TYPES,
    INT4_TYPES,
    INT8_TYPES,
    read_block,
    read_int4,
    read_int8,
)
from prefixserve.models.quantization import BlockWeight, Int4Weight, Int8Weight, concat_rows

EXPECTED = {  # (bits, offset, span, sub, shifts, mins)
    "Q5_0": (5, 16, 1, False, False, False),
    "Q5_1": (5, 0, 1, False, True, False),
    "Q4_K": (4, 0, 8, True, True, True),
    "Q5_K": (5, 0, 8, True, True, True),
    "Q6_K": (6, 32, 8, True, False, False),
}


def _read(kind: str, data: np.ndarray):
    if kind in INT8_TYPES:
        return read_int8(kind, data)
    return read_int4(kind, data) if kind in INT4_TYPES else read_block(kind, data)


@pytest.mark.parametrize("kind", list(BLOCK_LAYOUTS))
@pytest.mark.parametrize("fill", [None, 0x00, 0xFF])
def test_every_type_decodes_as_gguf_dequantizes_bit_for_bit(kind, fill):
    blocks = 3 if kind.endswith("_K") else 9
    data = random_blocks(kind, 5, blocks, seed=len(kind) + (fill or 1), fill=fill)
    w = _read(kind, data)
    expected = dequantize(data, Q[kind])
    assert w.shape == expected.shape
    np.testing.assert_array_equal(w.dequantize().numpy(), expected)


def test_each_type_maps_to_its_scheme_with_the_files_parameters():
    assert {k: type(_read(k, random_blocks(k, 2, 1, 0))) for k in BLOCK_LAYOUTS} == {
        "Q8_0": Int8Weight, "Q4_0": Int4Weight, "Q4_1": Int4Weight, **dict.fromkeys(BLOCK_TYPES, BlockWeight),
    }  # fmt: skip
    for kind, (bits, offset, span, sub, shifts, mins) in EXPECTED.items():
        w = read_block(kind, random_blocks(kind, 2, 1 if span == 8 else 8, 1))
        given = (w.sub, w.shifts, w.mins)
        got = (w.bits, w.offset, w.span, *(t is not None for t in given))
        assert got == (bits, offset, span, sub, shifts, mins), kind
        assert w.codes.dtype == torch.uint8 and int(w.codes.max()) < 2**bits
        assert w.scales.shape == (2, 256 // 32 // span) and w.group_size == 32
        assert torch.equal(w.scales.half().float(), w.scales)  # the file's float16 values


def test_k_types_keep_the_files_sub_block_scales_and_mins():
    """A Q4_K block with known 6-bit (scale, min) pairs, groups 4-7 past 15 (their top two
    bits live in bytes 0-7): the sub-block scales and mins are the file's numbers."""
    sc = np.array([1, 2, 3, 4, 37, 38, 39, 40], dtype=np.uint8)
    mn = np.array([63, 62, 61, 60, 59, 58, 57, 56], dtype=np.uint8)
    packed = np.zeros(12, dtype=np.uint8)
    packed[0:4] = sc[:4] | ((sc[4:] >> 4) << 6)
    packed[4:8] = mn[:4] | ((mn[4:] >> 4) << 6)
    packed[8:12] = (sc[4:] & 0xF) | ((mn[4:] & 0xF) << 4)
    data = random_blocks("Q4_K", 1, 1, 3)
    data[0, 4:16] = packed
    w = read_block("Q4_K", data)
    assert w.sub[0].tolist() == np.repeat(sc, 2).tolist() and w.mins[0].tolist() == mn.tolist()
    np.testing.assert_array_equal(w.dequantize().numpy(), dequantize(data, Q.Q4_K))


def test_block_weights_stack_and_select_rows_by_type():
    a, b = (read_block("Q6_K", random_blocks("Q6_K", 3, 2, s)) for s in (4, 5))
    both = concat_rows([a, b])
    assert isinstance(both, BlockWeight) and both.shape == (6, 512)
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    rows = torch.tensor([4, 0])
    assert torch.equal(both.index_rows(rows).dequantize(), both.dequantize()[rows])
    other = read_block("Q5_K", random_blocks("Q5_K", 3, 2, 6))
    assert concat_rows([a, other]) is None  # two types: not one scheme
