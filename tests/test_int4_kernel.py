"""The Triton int4 matmul (``kernels/int4_matmul.py``, run through the interpreter on CPU) against
the dequantized weight, on the layout ``TritonInt4`` holds."""

from __future__ import annotations

import pytest
import torch

from prefixserve.kernels.int4_matmul import int4_matmul
from prefixserve.models.linear import TritonInt4
from prefixserve.models.quantization import quantize_int4


@pytest.mark.parametrize(("m", "n", "k", "group"), [(1, 64, 64, 32), (5, 48, 96, 32), (20, 80, 128, 64)])  # fmt: skip
def test_int4_matmul_matches_the_dequantized_weight(m, n, k, group):
    gen = torch.Generator().manual_seed(m + n + k)
    w = quantize_int4(torch.randn(n, k, generator=gen), group_size=group)
    lin = TritonInt4(w, torch.float32)
    x = torch.randn(m, k, generator=gen)
    y = int4_matmul(x, lin.codes, lin.scales, lin.shifts, group)
    assert y.shape == (m, n) and y.dtype == x.dtype
    torch.testing.assert_close(y, x @ w.dequantize().t(), atol=1e-4, rtol=1e-4)


def test_int4_matmul_refuses_a_ragged_k():
    w = quantize_int4(torch.randn(16, 64), group_size=16)
    lin = TritonInt4(w, torch.float32)
    with pytest.raises(AssertionError):
        int4_matmul(torch.randn(2, 48), lin.codes[:, :24], lin.scales[:, :3], lin.shifts[:, :3], 16)
