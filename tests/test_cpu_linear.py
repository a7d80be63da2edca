"""The CPU linear kernels (``kernels/cpu_linear.cpp``) against ``F.linear`` on the weights they
hold, and the property they are built for: a row's result is bit-identical alone or in any batch,
in any position, whatever the other rows hold."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import xxhash

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
    """The row tiles, the unpacked path past six rows (int8, int4), the row's position: none of
    them changes a row's bits."""
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


def _has_flag(flag: str) -> bool:
    return flag in next((x for x in open("/proc/cpuinfo") if x.startswith("flags")), "").split()


def _tile_rows() -> int:
    """The float32 tile's most rows in the native build: 12 on AVX-512 (32 vector registers), 6
    elsewhere (16)."""
    return 12 if _has_flag("avx512f") else 6


def test_float_row_tiles_are_as_few_as_the_registers_allow_and_even():
    """A call's rows split into ceil(M / most) tiles whose sizes differ by at most one (13 rows on
    AVX-512: 7 + 6, never 12 + 1)."""
    most, tiles = _tile_rows(), torch.ops.prefixserve_cpu.linear_f32_row_tiles
    assert tiles(0) == [] and tiles(1) == [1] and tiles(most) == [most]
    assert tiles(most + 1) == [most // 2 + 1, most // 2]
    for m in range(1, 5 * most):
        rows = tiles(m)
        assert sum(rows) == m and len(rows) == -(-m // most)
        assert max(rows) <= most and max(rows) - min(rows) <= 1


def test_every_float_tile_and_remainder_gives_a_row_the_same_bits():
    """Every row count up to three tiles, over 40 outputs (on AVX-512 a tile of two blocks, then
    one of a single, padded block): each row as it is alone."""
    gen = _gen(11)
    w, b = torch.randn(40, 64, generator=gen), torch.randn(40, generator=gen)
    packed = cpu_linear.pack_f32(w)
    x = torch.randn(3 * _tile_rows() + 1, 64, generator=gen)
    alone = torch.cat([cpu_linear.linear_f32(x[i : i + 1], packed, b, 40) for i in range(len(x))])
    for m in range(1, len(x) + 1):
        assert torch.equal(cpu_linear.linear_f32(x[:m], packed, b, 40), alone[:m])


def test_float_results_do_not_depend_on_the_thread_split():
    gen = _gen(12)
    w, x = torch.randn(1300, 64, generator=gen), torch.randn(13, 64, generator=gen)
    packed, before = cpu_linear.pack_f32(w), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_linear.linear_f32(x, packed, None, 1300)
        torch.set_num_threads(2)
        assert torch.equal(cpu_linear.linear_f32(x, packed, None, 1300), one)
    finally:
        torch.set_num_threads(before)


def test_one_row_gives_the_bits_it_has_in_a_batch_over_every_unit_width():
    """One row reads the weights in units of six vectors (no lines asked for ahead), a batch in
    tiles of two: output counts from one block to past two units, padded blocks among them."""
    gen = _gen(14)
    for n in [*range(16, 16 * 14, 16), 40, 1300]:
        w, b = torch.randn(n, 64, generator=gen), torch.randn(n, generator=gen)
        packed, x = cpu_linear.pack_f32(w), torch.randn(3, 64, generator=gen)
        batch = cpu_linear.linear_f32(x, packed, b, n)
        for i in range(3):
            assert torch.equal(cpu_linear.linear_f32(x[i : i + 1], packed, b, n), batch[i : i + 1])


def test_packed_float_weights_sit_on_huge_page_aligned_memory():
    gen = _gen(15)
    w = torch.randn(4096, 256, generator=gen)  # 4 MiB
    packed = cpu_linear.pack_f32(w)
    assert packed.data_ptr() % cpu_linear.HUGE_PAGE == 0
    assert torch.equal(packed, cpu_linear._blocks(w))
    small = torch.randn(16, 16, generator=gen)
    assert torch.equal(cpu_linear.pack_f32(small), cpu_linear._blocks(small))


@pytest.mark.parametrize(("march", "namespace"), [("x86-64-v3", "linear_avx2"),
                                                  ("x86-64", "linear_portable")])  # fmt: skip
def test_other_instruction_sets_give_the_same_bits(march, namespace):
    """The file built for AVX2 (a tile of 6 rows times one block in ymm registers) and for plain
    x86-64 (generic vectors) against the native build, which on AVX-512 tiles 12 rows times two
    blocks in zmm registers: the same bits, every row count to three tiles (and for int8 and int4,
    whose tiles are the same on every instruction set)."""
    if platform.machine() != "x86_64" or (march == "x86-64-v3" and not _has_flag("avx2")):
        pytest.skip(f"{march} does not run here")
    flags = ["-O2", f"-march={march}", "-ffp-contract=off", "-fopenmp",
             f"-DLINEAR_NAMESPACE={namespace}"]  # fmt: skip
    kernels = Path(cpu_ops.__file__).resolve().parent
    sources = [kernels / "cpu_linear.cpp"]
    digest = xxhash.xxh3_64(f"{torch.__version__}|{flags}".encode())
    for source in sources + cpu_ops.HEADERS:
        digest.update(source.read_bytes())
    cpu_ops.load_extension(f"{namespace}_{digest.hexdigest()}", sources, flags)
    ops = getattr(torch.ops, namespace)
    assert ops.linear_f32_row_tiles(13) == [5, 4, 4]  # at most 6 rows a tile
    gen = _gen(13)
    w, b = torch.randn(40, 96, generator=gen), torch.randn(40, generator=gen)
    f32 = cpu_linear.pack_f32(w)
    q8, q4 = quantize_int8(w), quantize_int4(w)
    int8 = (*cpu_linear.pack_int8(q8.qweight, q8.scales), q8.group_size)
    int4 = (*cpu_linear.pack_int4(q4.qvalues, q4.scales, q4.shifts), q4.group_size)
    for m in range(1, 3 * _tile_rows() + 2):
        x = torch.randn(m, 96, generator=gen)
        assert torch.equal(ops.linear_f32(x, f32, b, 40), cpu_linear.linear_f32(x, f32, b, 40))
        assert torch.equal(
            ops.linear_int8(x, *int8, b, 40), cpu_linear.linear_int8(x, *int8, b, 40)
        )
        assert torch.equal(
            ops.linear_int4(x, *int4, b, 40), cpu_linear.linear_int4(x, *int4, b, 40)
        )
