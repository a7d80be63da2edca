"""The Triton int4 matmul (``kernels/int4_matmul.py``, run through the interpreter on CPU) against
the portable path of ``Int4Linear``, on the layout it reads."""

from __future__ import annotations

import pytest
import torch
from prefixserve.kernels.int4_matmul import int4_matmul

from prefixserve.models.quantization import Int4Linear, quantize_int4


@pytest.mark.parametrize(("m", "n", "k", "group"), [(1, 64, 64, 32), (5, 48, 96, 32), (20, 80, 128, 64)])  # fmt: skip
def test_int4_matmul_matches_the_dequantized_weight(m, n, k, group):
    gen = torch.Generator().manual_seed(m + n + k)
    w = quantize_int4(torch.randn(n, k, generator=gen), group_size=group)
    lin = Int4Linear(w, None, torch.float32, portable=True)
    x = torch.randn(m, k, generator=gen)
    y = int4_matmul(x, lin.codes, lin.scales, lin.zeros, group)
    assert y.shape == (m, n) and y.dtype == x.dtype
    torch.testing.assert_close(y, x @ w.dequantize().t(), atol=1e-4, rtol=1e-4)


def test_int4_matmul_refuses_a_ragged_k():
    w = quantize_int4(torch.randn(16, 64), group_size=16)
    lin = Int4Linear(w, None, torch.float32, portable=True)
    with pytest.raises(AssertionError):
        int4_matmul(torch.randn(2, 48), lin.codes[:, :24], lin.scales[:, :3], lin.zeros[:, :3], 16)
