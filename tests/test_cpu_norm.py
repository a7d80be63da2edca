"""The C++ RMSNorm ops (``kernels/cpu_norm.cpp``): the bits of the order the kernel states, a
row's result the same alone and in any batch, the fused residual add, shapes for
``torch.compile`` and errors for inputs it does not take; and the model's norms on them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixserve.kernels import cpu_ops
from prefixserve.kernels.cpu_norm import add_rms_norm, rms_norm
from prefixserve.models.llama import RMSNorm

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ toolchain")


def _reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The kernel's operation sequence in float32 numpy, row by row: sixteen running sums of
    squares over d ascending (lane d % 16), a pairwise tree over the lanes, ``1 / sqrt(ss / D +
    eps)``, then ``w * (x * inv)``."""
    f32, dim = np.float32, x.shape[-1]
    wn, rows = w.numpy(), x.reshape(-1, dim).numpy()
    out = np.empty_like(rows)
    for r, row in enumerate(rows):
        acc = np.zeros(16, dtype=f32)
        for d0 in range(0, dim, 16):
            chunk = row[d0 : d0 + 16]
            acc[: len(chunk)] = acc[: len(chunk)] + chunk * chunk
        for width in (8, 4, 2, 1):
            acc[:width] = acc[:width] + acc[width : 2 * width]
        inv = f32(1) / np.sqrt(acc[0] / f32(dim) + f32(eps))
        out[r] = wn * (row * inv)
    return torch.from_numpy(out).view(x.shape)


@pytest.mark.parametrize("dim", [16, 40, 576, 1000])
def test_rms_norm_gives_the_bits_of_its_stated_order(dim):
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(3, dim, generator=gen) * torch.rand(3, 1, generator=gen) * 10
    w = torch.randn(dim, generator=gen)
    assert torch.equal(rms_norm(x, w, 1e-5), _reference(x, w, 1e-5))
    formula = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(rms_norm(x, w, 1e-5), formula, atol=1e-5, rtol=1e-5)


def test_a_row_gives_the_same_bits_alone_and_in_any_batch():
    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(300, 576, generator=gen), torch.randn(300, 576, generator=gen)
    w = torch.randn(576, generator=gen)
    whole, whole_sum = add_rms_norm(x, residual, w, 1e-6)
    for rows in (slice(7, 8), slice(0, 5), slice(40, 300)):  # 260 rows: split across threads
        alone, alone_sum = add_rms_norm(x[rows], residual[rows], w, 1e-6)
        assert torch.equal(alone, whole[rows]) and torch.equal(alone_sum, whole_sum[rows])
        assert torch.equal(rms_norm(x[rows], w, 1e-6), rms_norm(x, w, 1e-6)[rows])


def test_add_rms_norm_is_the_add_then_the_norm():
    gen = torch.Generator().manual_seed(1)
    x, residual = torch.randn(2, 5, 64, generator=gen), torch.randn(2, 5, 64, generator=gen)
    w = torch.randn(64, generator=gen)
    out, total = add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(total, x + residual)
    assert torch.equal(out, rms_norm(x + residual, w, 1e-6))
    strided = torch.randn(5, 128, generator=gen)[:, ::2]  # the wrappers make rows contiguous
    assert torch.equal(rms_norm(strided, w, 1e-6), rms_norm(strided.contiguous(), w, 1e-6))


def test_the_ops_have_shapes_for_torch_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w = torch.empty(7, 64), torch.empty(64)
        out, total = torch.ops.prefixserve_cpu.add_rms_norm(x, x, w, 1e-6)
        assert out.shape == total.shape == (7, 64)
        assert torch.ops.prefixserve_cpu.rms_norm(x, w, 1e-6).shape == (7, 64)


def test_inputs_the_kernel_does_not_take_are_errors():
    x, w = torch.randn(2, 8), torch.randn(8)
    with pytest.raises(RuntimeError, match="weight must be float32"):
        rms_norm(x, torch.randn(9), 1e-6)
    with pytest.raises(RuntimeError, match="x must be contiguous float32"):
        rms_norm(x.double(), w, 1e-6)
    with pytest.raises(RuntimeError, match="residual must be"):
        add_rms_norm(x, torch.randn(3, 8), w, 1e-6)


def test_the_model_norm_takes_the_kernel_where_it_is_chosen():
    """``RMSNorm.cpu_kernel`` (set at load for float32 CPU weights) runs the C++ op, with and
    without the residual; off, ``torch.rms_norm`` and a plain add."""
    norm = RMSNorm(64, 1e-6)
    norm.weight.copy_(torch.randn(64, generator=torch.Generator().manual_seed(2)))
    x, residual = torch.randn(3, 64), torch.randn(3, 64)
    plain, plain_sum = norm(x, residual)
    assert torch.equal(plain_sum, x + residual)
    assert torch.equal(plain, torch.rms_norm(x + residual, (64,), norm.weight, 1e-6))
    norm.cpu_kernel = True
    fused, fused_sum = norm(x, residual)
    assert torch.equal(fused_sum, x + residual)
    assert torch.equal(fused, rms_norm(x + residual, norm.weight, 1e-6))
    assert torch.equal(norm(x), rms_norm(x, norm.weight, 1e-6))
