"""The CPU linear kernels (``kernels/cpu_linear.cpp``) against ``F.linear`` on the weights they
hold, and the property they are built for: a row's result is bit-identical alone or in any batch,
in any position, whatever the other rows hold."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixserve.kernels import cpu_linear, cpu_ops
from prefixserve.models.quantization import quantize_int4, quantize_int8

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ toolchain")

SHAPES = [(1, 16, 32), (5, 48, 64), (7, 40, 96), (13, 1000, 64), (3, 17, 32), (64, 96, 128)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _run(scheme: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None):
    """(kernel output, the weight it multiplies by) for one scheme."""
    n = w.shape[0]
    if scheme == "f32":
        return cpu_linear.linear_f32(x, cpu_linear.pack_f32(w), bias, n), w
    if scheme == "int8":
        q = quantize_int8(w)
        codes, scales = cpu_linear.pack_int8(q.qweight, q.scales)
        return cpu_linear.linear_int8(x, codes, scales, q.group_size, bias, n), q.dequantize()
    q = quantize_int4(w)
    packed = cpu_linear.pack_int4(q.qvalues, q.scales, q.shifts)
    return cpu_linear.linear_int4(x, *packed, q.group_size, bias, n), q.dequantize()


@pytest.mark.parametrize("scheme", ["f32", "int8", "int4"])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_kernels_equal_f_linear_on_their_weights(scheme, m, n, k, bias):
    gen = _gen(m * n + k)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    y, weight = _run(scheme, x, w, b)
    ref = F.linear(x.double(), weight.double(), None if b is None else b.double()).float()
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y, ref, atol=2e-5 * k**0.5 * float(ref.abs().max()), rtol=1e-5)


@pytest.mark.parametrize("scheme", ["f32", "int8", "int4"])
@pytest.mark.parametrize("m", [2, 6, 7, 13, 40])
def test_a_row_is_bit_identical_alone_and_in_any_batch(scheme, m):
    """Tiles of six rows, the unpacked path past six rows, the row's position: none of them
    changes a row's bits."""
    gen = _gen(m)
    w, b = torch.randn(48, 96, generator=gen), torch.randn(48, generator=gen)
    x = torch.randn(m, 96, generator=gen)
    batch, _ = _run(scheme, x, w, b)
    alone = torch.cat([_run(scheme, x[i : i + 1], w, b)[0] for i in range(m)])
    assert torch.equal(batch, alone)
    shuffled = torch.randperm(m, generator=gen)
    assert torch.equal(_run(scheme, x[shuffled], w, b)[0], batch[shuffled])


@pytest.mark.parametrize("scheme", ["f32", "int8", "int4"])
def test_no_rows_give_an_empty_result(scheme):
    """A step can ask for no rows (a prefill chunk none of whose logits are wanted)."""
    w = torch.randn(40, 64, generator=_gen(3))
    y, _ = _run(scheme, torch.empty(0, 64), w, None)
    assert y.shape == (0, 40)


def test_block_rows_reads_back_the_packed_rows():
    w = torch.randn(37, 64, generator=_gen(0))
    index = torch.tensor([0, 15, 16, 36, 3, 3])
    assert torch.equal(cpu_linear.block_rows(cpu_linear.pack_f32(w), index), w[index])


def test_bad_inputs_raise():
    w = cpu_linear.pack_f32(torch.randn(16, 32))
    with pytest.raises(RuntimeError, match="contiguous float32"):
        cpu_linear.linear_f32(torch.randn(2, 32).double(), w, None, 16)
    with pytest.raises(RuntimeError, match="packed float32"):
        cpu_linear.linear_f32(torch.randn(2, 48), w, None, 16)
    q = quantize_int4(torch.randn(16, 64))
    codes, scales, shifts = cpu_linear.pack_int4(q.qvalues, q.scales, q.shifts)
    with pytest.raises(RuntimeError, match="multiple of the group"):
        cpu_linear.linear_int4(torch.randn(2, 64), codes, scales, shifts, 48, None, 16)


def test_the_ops_trace_in_torch_compile():
    """The fake (meta) registrations let a compiled graph call the kernels without a break."""
    w = torch.randn(32, 64, generator=_gen(1))
    packed = cpu_linear.pack_f32(w)
    fn = torch.compile(lambda x: cpu_linear.linear_f32(x, packed, None, 32) * 2, fullgraph=True)
    x = torch.randn(3, 64, generator=_gen(2))
    torch.testing.assert_close(fn(x), 2 * cpu_linear.linear_f32(x, packed, None, 32))
