"""The CPU kernels for GGUF's block types (``kernels/cpu_klinear.cpp``): on int8 activations bit
for bit the torch reference of their arithmetic (``qlinear_reference.linear_kq8``), on float
activations the product with exactly the file's values; a row's result the same alone or in any
batch, in any thread split and on every instruction set. Weights are random blocks of every type
read by ``gguf_blocks`` (every code, sub-block scale and min byte drawn at random)."""

from __future__ import annotations

import isa_builds
import pytest
import torch
import torch.nn.functional as F
from gguf_files import random_blocks
from qlinear_reference import linear_kq8

from prefixserve.kernels import cpu_klinear, cpu_ops
from prefixserve.models.gguf_blocks import BLOCK_TYPES, read_block

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ toolchain")
isa_ops = isa_builds.isa_ops  # the fixture: the kernels built for other instruction sets

# (M, N, K): one row, tiles of 1..8 rows and past them, N not a multiple of 16; K of one
# super-block and of several
SHAPES = [(1, 16, 256), (1, 17, 512), (3, 33, 256), (8, 48, 256), (9, 5, 768), (13, 40, 512)]


def _weight(kind: str, n: int, k: int, seed: int):
    per_block = 256 if kind.endswith("_K") else 32
    return read_block(kind, random_blocks(kind, n, k // per_block, seed))


def _packed(w):
    return cpu_klinear.pack_block(w.codes, w.bits, w.scales, w.sub, w.shifts, w.mins)


def _run(ops, activations: str, x, w, bias):
    fn = ops.linear_kq8 if activations == "int8" else ops.linear_kf32
    args = cpu_klinear._args(_packed(w), w.bits, w.offset, w.span)
    return fn(x, *args, bias, w.shape[0])


def _case(kind: str, m: int, n: int, k: int, bias: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.rand(m, 1, generator=gen) * 4
    x[:, :32] = 0  # an all-zero activation block: scale 0, codes 0
    b = torch.randn(n, generator=gen) if bias else None
    return x, _weight(kind, n, k, seed), b


NATIVE = torch.ops.prefixserve_cpu


@pytest.mark.parametrize("kind", BLOCK_TYPES)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_int8_activations_equal_the_torch_reference_bit_for_bit(kind, m, n, k, bias):
    x, w, b = _case(kind, m, n, k, bias, seed=m * n + k)
    y = _run(NATIVE, "int8", x, w, b)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert torch.equal(y, linear_kq8(x, w, b))


@pytest.mark.parametrize("kind", BLOCK_TYPES)
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_float_activations_multiply_by_the_files_values(kind, m, n, k):
    x, w, b = _case(kind, m, n, k, True, seed=m + n + k)
    y = _run(NATIVE, "none", x, w, b)
    exact = F.linear(x.double(), w.dequantize().double(), b.double())
    scale = float(exact.abs().max()) + float(x.abs().sum(dim=1).max() * w.dequantize().abs().max())
    torch.testing.assert_close(y.double(), exact, atol=1e-6 * scale, rtol=0)


@pytest.mark.parametrize("kind", BLOCK_TYPES)
@pytest.mark.parametrize("activations", ["int8", "none"])
@pytest.mark.parametrize("m", [2, 8, 9, 17])
def test_a_row_is_bit_identical_alone_and_in_any_batch(kind, activations, m):
    x, w, b = _case(kind, m, 37, 256, True, seed=m)
    batch = _run(NATIVE, activations, x, w, b)
    alone = torch.cat([_run(NATIVE, activations, x[i : i + 1], w, b) for i in range(m)])
    assert torch.equal(batch, alone)
    shuffled = torch.randperm(m, generator=torch.Generator().manual_seed(m))
    assert torch.equal(_run(NATIVE, activations, x[shuffled], w, b), batch[shuffled])


@pytest.mark.parametrize("activations", ["int8", "none"])
def test_the_thread_split_does_not_change_a_bit(activations):
    x, w, b = _case("Q6_K", 11, 700, 512, True, seed=5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(NATIVE, activations, x, w, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, _run(NATIVE, activations, x, w, b))


@pytest.mark.parametrize("activations", ["int8", "none"])
def test_no_rows_give_an_empty_result(activations):
    _, w, b = _case("Q5_K", 1, 40, 256, True, seed=3)
    assert _run(NATIVE, activations, torch.empty(0, 256), w, b).shape == (0, 40)


@pytest.mark.parametrize("kind", BLOCK_TYPES)
def test_packed_rows_read_back_the_codes(kind):
    w = _weight(kind, 37, 512, 7)
    packed = _packed(w)
    index = torch.tensor([0, 15, 16, 36, 3, 3])
    assert torch.equal(
        cpu_klinear.block_codes(packed["low"], packed["high"], index), w.codes[index]
    )
    for name in ("scales", "sub", "shifts", "mins"):
        expected = getattr(w, name)
        rows = cpu_klinear.param_rows(packed[name], index)
        assert (rows is None) == (expected is None)
        if expected is not None:
            assert torch.equal(rows.to(expected.dtype), expected[index])


def test_bad_inputs_raise():
    w = _weight("Q6_K", 16, 256, 1)
    args = list(cpu_klinear._args(_packed(w), w.bits, w.offset, w.span))
    with pytest.raises(RuntimeError, match="contiguous float32"):
        NATIVE.linear_kq8(torch.randn(2, 256).double(), *args, None, 16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        NATIVE.linear_kq8(torch.randn(2, 96), *args, None, 16)
    with pytest.raises(RuntimeError, match="packed uint8"):
        NATIVE.linear_kq8(torch.randn(2, 256), *args, None, 40)
    with pytest.raises(RuntimeError, match="bits must be"):
        NATIVE.linear_kf32(torch.randn(2, 256), *args[:6], 7, 32, 8, None, 16)
    with pytest.raises(RuntimeError, match="high bits"):
        NATIVE.linear_kf32(torch.randn(2, 256), *args[:6], 4, 32, 8, None, 16)


def test_the_ops_trace_in_torch_compile():
    w = _weight("Q5_1", 32, 64, 2)
    packed = _packed(w)

    def f(x):
        return cpu_klinear.linear_kq8(x, packed, w.bits, w.offset, w.span, None, 32) * 2

    x = torch.randn(3, 64)
    assert torch.equal(torch.compile(f, fullgraph=True)(x), f(x))


@pytest.mark.parametrize("kind", BLOCK_TYPES)
@pytest.mark.parametrize("activations", ["int8", "none"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 17, 256), (9, 41, 512)])
def test_every_instruction_set_gives_the_native_bits(isa_ops, kind, activations, m, n, k):
    """AVX2 and the portable loop compute what the native build (VNNI here) does, on both
    activation paths."""
    x, w, b = _case(kind, m, n, k, True, seed=m + n + len(kind))
    assert torch.equal(_run(isa_ops, activations, x, w, b), _run(NATIVE, activations, x, w, b))
