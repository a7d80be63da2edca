"""The integer CPU kernels (``kernels/cpu_qlinear.cpp``: W8A8, W4A8) against their torch
reference (``qlinear_reference``), bit for bit: integer block sums are exact, so every row count,
tile and thread split gives the reference's bits, and a row's result is the same alone or in any
batch."""

from __future__ import annotations

import isa_builds
import pytest
import torch
from qlinear_reference import linear_w4a8, linear_w8a8, quantize_activations

from prefixserve.kernels import cpu_ops, cpu_qlinear
from prefixserve.models.quantization import quantize, quantize_int4, quantize_int8

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ toolchain")
isa_ops = isa_builds.isa_ops  # the fixture: the kernels built for other instruction sets

# (M, N, K): one row, tiles of 1..8 rows and past them, N not a multiple of 16 (odd), K of
# one group and of many (odd numbers of groups)
SHAPES = [(1, 16, 32), (1, 17, 96), (3, 33, 64), (7, 41, 160), (8, 48, 32), (9, 5, 96),
          (13, 101, 224), (37, 64, 288)]  # fmt: skip


SCHEMES = ["int8", "int4", "int4_sym"]  # int4_sym: the W4A8 kernel without shifts


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _kernel(scheme: str, x: torch.Tensor, q, bias: torch.Tensor | None) -> torch.Tensor:
    n = q.shape[0]
    if scheme == "int8":
        return cpu_qlinear.linear_w8a8(x, *cpu_qlinear.pack_w8a8(q.qweight, q.scales), bias, n)
    packed = cpu_qlinear.pack_w4a8(q.qvalues, q.scales, q.shifts)
    return cpu_qlinear.linear_w4a8(x, *packed, bias, n)


BLOCK_OF_ZEROS = 32


def _case(scheme: str, m: int, n: int, k: int, bias: bool, seed: int):
    gen = _gen(seed)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    x[:, :BLOCK_OF_ZEROS] = 0  # an all-zero block: scale 0, codes 0
    w = torch.randn(n, k, generator=gen)
    q = quantize(w, scheme)
    b = torch.randn(n, generator=gen) if bias else None
    return x, q, b


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_kernels_equal_their_torch_reference_bit_for_bit(scheme, m, n, k, bias):
    x, q, b = _case(scheme, m, n, k, bias, seed=m * n + k)
    reference = linear_w8a8 if scheme == "int8" else linear_w4a8
    y = _kernel(scheme, x, q, b)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert torch.equal(y, reference(x, q, b))


@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_without_shifts_the_kernel_equals_itself_given_shifts_of_minus_8_scales(m, n, k):
    """The scale-only form computes ``shift = -8 * scale`` in registers: exact, so the same bits
    as the stored shifts ``-8 * scales`` (float16, exact too) give."""
    x, q, b = _case("int4_sym", m, n, k, True, seed=m + n + k)
    assert q.shifts is None
    codes, scales, none = cpu_qlinear.pack_w4a8(q.qvalues, q.scales, None)
    _, _, shifts = cpu_qlinear.pack_w4a8(q.qvalues, q.scales, -8 * q.scales)
    assert none is None and torch.equal(shifts.float(), -8 * scales.float())
    y = cpu_qlinear.linear_w4a8(x, codes, scales, None, b, n)
    assert torch.equal(y, cpu_qlinear.linear_w4a8(x, codes, scales, shifts, b, n))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("m", [2, 8, 9, 17, 40])
def test_a_row_is_bit_identical_alone_and_in_any_batch(scheme, m):
    x, q, b = _case(scheme, m, 37, 96, True, seed=m)
    batch = _kernel(scheme, x, q, b)
    alone = torch.cat([_kernel(scheme, x[i : i + 1], q, b) for i in range(m)])
    assert torch.equal(batch, alone)
    shuffled = torch.randperm(m, generator=_gen(m))
    assert torch.equal(_kernel(scheme, x[shuffled], q, b), batch[shuffled])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_thread_split_does_not_change_a_bit(scheme):
    x, q, b = _case(scheme, 11, 700, 128, True, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _kernel(scheme, x, q, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, _kernel(scheme, x, q, b))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_result_is_close_to_float_activations(scheme):
    """The integer path is the float product of the dequantized weights and the rounded
    activations: within a few activation steps of the exact product."""
    x, q, b = _case(scheme, 4, 64, 256, True, seed=9)
    exact = torch.nn.functional.linear(x.double(), q.dequantize().double(), b.double()).float()
    err = (_kernel(scheme, x, q, b) - exact).abs().max()
    assert 0 < err < 0.02 * exact.abs().max()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_no_rows_give_an_empty_result(scheme):
    _, q, b = _case(scheme, 1, 40, 64, True, seed=3)
    assert _kernel(scheme, torch.empty(0, 64), q, b).shape == (0, 40)


def test_activation_quantization_rounds_half_to_even_and_clamps():
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([127.0, 0.5, 1.5, -2.5])  # d = 1: ties go to even
    codes, d, sums = quantize_activations(x)
    assert d.tolist() == [[1.0]]
    assert codes[0, 0, :4].tolist() == [127, 0, 2, -2] and sums.tolist() == [[127]]


def test_packed_rows_read_back_the_codes():
    w = torch.randn(37, 64, generator=_gen(0))
    index = torch.tensor([0, 15, 16, 36, 3, 3])
    q8, q4 = quantize_int8(w), quantize_int4(w)
    packed8, _ = cpu_qlinear.pack_w8a8(q8.qweight, q8.scales)
    packed4, _, _ = cpu_qlinear.pack_w4a8(q4.qvalues, q4.scales, q4.shifts)
    assert torch.equal(cpu_qlinear.w8a8_rows(packed8, index), q8.qweight[index])
    assert torch.equal(cpu_qlinear.w4a8_rows(packed4, index), q4.qvalues[index])


def test_bad_inputs_raise():
    q = quantize_int8(torch.randn(16, 64))
    codes, scales = cpu_qlinear.pack_w8a8(q.qweight, q.scales)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        cpu_qlinear.linear_w8a8(torch.randn(2, 64).double(), codes, scales, None, 16)
    with pytest.raises(RuntimeError, match="packed uint8"):
        cpu_qlinear.linear_w8a8(torch.randn(2, 64), codes, scales, None, 40)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        cpu_qlinear.linear_w8a8(torch.randn(2, 48), codes, scales, None, 16)


@pytest.mark.parametrize("scheme", ["int4", "int4_sym"])  # with shifts and without
def test_the_ops_trace_in_torch_compile(scheme):
    q = quantize(torch.randn(32, 64, generator=_gen(1)), scheme)
    packed = cpu_qlinear.pack_w4a8(q.qvalues, q.scales, q.shifts)
    fn = torch.compile(lambda x: cpu_qlinear.linear_w4a8(x, *packed, None, 32) * 2, fullgraph=True)
    x = torch.randn(3, 64, generator=_gen(2))
    assert torch.equal(fn(x), 2 * cpu_qlinear.linear_w4a8(x, *packed, None, 32))


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 17, 96), (9, 41, 160), (13, 101, 224)])
def test_every_instruction_set_gives_the_reference_bits(isa_ops, scheme, m, n, k):
    """AVX2 (maddubs) and the portable loop compute what the native build (VNNI here) does."""
    x, q, b = _case(scheme, m, n, k, True, seed=m + n)
    if scheme == "int8":
        y = isa_ops.linear_w8a8(x, *cpu_qlinear.pack_w8a8(q.qweight, q.scales), b, n)
        assert torch.equal(y, linear_w8a8(x, q, b))
    else:
        y = isa_ops.linear_w4a8(x, *cpu_qlinear.pack_w4a8(q.qvalues, q.scales, q.shifts), b, n)
        assert torch.equal(y, linear_w4a8(x, q, b))
