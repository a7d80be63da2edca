"""Weight-only int8 / int4 / int4_sym schemes: the quantizers' round trips, their float16 parameters (so
``dequantize`` is what the kernels multiply by), stacking and row selection."""

from __future__ import annotations

import pytest
import torch

from prefixserve.core.errors import InvalidArgumentError
from prefixserve.models.quantization import (
    GROUP_SIZE,
    Int4Weight,
    Int8Weight,
    concat_rows,
    in_scheme,
    quantize,
    quantize_int4,
    quantize_int4_sym,
    quantize_int8,
    scheme_of,
)


def _w(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def _is_float16(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and torch.equal(t.half().float(), t)


def test_int8_round_trip_is_within_half_a_step_per_group():
    w = _w(48, 96)
    w[3, :32] = 0  # an all-zero group
    q = quantize_int8(w)
    assert q.qweight.dtype == torch.int8 and q.qweight.abs().max() <= 127
    assert q.scales.shape == (48, 96 // GROUP_SIZE) and _is_float16(q.scales)
    assert q.scales[3, 0] == 1 and (q.qweight[3, :32] == 0).all()
    steps = q.scales.repeat_interleave(GROUP_SIZE, dim=1)
    assert ((q.dequantize() - w).abs() <= steps / 2 + 1e-6).all()
    amax = q.qweight.view(48, 3, -1).abs().amax(-1)
    assert (amax[w.view(48, 3, -1).abs().amax(-1) > 0] >= 126).all()  # the range is used


def test_int4_round_trip_is_within_half_a_step_per_group_and_exact_on_constants():
    w = _w(16, 96)
    w[2, 32:64] = 0.25  # a constant group: scale 0, every code stands for 0.25
    q = quantize_int4(w)
    assert q.qvalues.dtype == torch.uint8 and int(q.qvalues.max()) <= 15
    assert q.scales.shape == q.shifts.shape == (16, 96 // GROUP_SIZE)
    assert _is_float16(q.scales) and _is_float16(q.shifts)
    deq = q.dequantize()
    assert (deq[2, 32:64] == 0.25).all() and q.scales[2, 1] == 0
    steps = q.scales.repeat_interleave(GROUP_SIZE, dim=1)
    # half a step, plus what rounding the group's minimum to float16 moved it
    slack = (q.shifts - w.view(16, 3, -1).amin(-1)).abs().repeat_interleave(GROUP_SIZE, dim=1)
    assert ((deq - w).abs() <= steps / 2 + slack + 1e-6).all()


def test_int4_sym_gives_the_largest_magnitude_code_0_and_keeps_no_shifts():
    w = _w(16, 96)
    w[1, :32] = 0  # an all-zero group: scale 0, code 8
    w[4, 32] = 9.0  # a positive peak: negative scale, code 0 still
    q = quantize_int4_sym(w)
    assert q.shifts is None and scheme_of(q) == "int4_sym"
    assert q.qvalues.dtype == torch.uint8 and int(q.qvalues.max()) <= 15
    assert q.scales.shape == (16, 96 // GROUP_SIZE) and _is_float16(q.scales)
    groups = w.view(16, 3, -1)
    peak = groups.gather(-1, groups.abs().argmax(-1, keepdim=True))[..., 0]
    assert torch.equal(q.scales, (peak / -8).half().float())
    assert q.scales[1, 0] == 0 and (q.qvalues[1, :32] == 8).all()
    assert q.scales[4, 1] < 0 and q.qvalues[4, 32] == 0
    codes_at_peak = q.qvalues.view(16, 3, -1).gather(-1, groups.abs().argmax(-1, keepdim=True))
    assert (codes_at_peak[peak != 0] == 0).all()
    steps = q.scales.abs().repeat_interleave(GROUP_SIZE, dim=1)
    # half a step, except at the far side of the peak (+8 steps clamped to +7: one step)
    assert ((q.dequantize() - w).abs() <= steps + 1e-6).all()
    inner = (q.qvalues > 0) & (q.qvalues < 15)
    assert ((q.dequantize() - w).abs()[inner] <= steps[inner] / 2 + 1e-6).all()


def test_the_scale_only_form_dequantizes_as_with_shifts_of_minus_8_scales():
    """``q * scale + (-8 * scale)`` is exact, so ``(q - 8) * scale`` and the shifted form agree
    bit for bit, and ``shift_values`` is ``-8 * scales``."""
    q = quantize_int4_sym(_w(16, 64, 5))
    shifted = Int4Weight(q.qvalues, q.scales, -8 * q.scales, q.group_size)
    assert torch.equal(q.shift_values(), -8 * q.scales)
    assert torch.equal(q.dequantize(), shifted.dequantize())
    exact = (q.qvalues.double() - 8).view(16, 2, -1) * q.scales.double()[..., None]
    assert torch.equal(q.dequantize().double(), exact.view(16, 64))
    assert scheme_of(shifted) == "int4"


def test_in_scheme_changes_no_value_and_says_when_only_requantizing_would_do():
    w = _w(16, 64, 6)
    sym, asym, int8 = quantize_int4_sym(w), quantize_int4(w), quantize_int8(w)
    assert in_scheme(sym, "int4_sym") is sym and in_scheme(int8, "int8") is int8
    stored = in_scheme(sym, "int4")  # the scale-only form with its shifts written out
    assert scheme_of(stored) == "int4" and torch.equal(stored.shifts, -8 * sym.scales)
    assert torch.equal(stored.dequantize(), sym.dequantize())
    assert in_scheme(asym, "int4_sym") is None and in_scheme(int8, "int4") is None
    assert in_scheme(sym, "int8") is None


@pytest.mark.parametrize("method", ["int8", "int4", "int4_sym"])
def test_quantizers_need_whole_groups(method):
    with pytest.raises(InvalidArgumentError, match="divisible by 32"):
        quantize(_w(16, 40), method)


def test_unknown_method_is_a_typed_error():
    with pytest.raises(InvalidArgumentError, match="quantization"):
        quantize(_w(16, 64), "int3")


def test_concat_rows_stacks_one_scheme_only():
    a, b = quantize_int4(_w(16, 64, 1)), quantize_int4(_w(32, 64, 2))
    both = concat_rows([a, b])
    torch.testing.assert_close(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    assert concat_rows([a, quantize_int8(_w(32, 64))]) is None
    assert concat_rows([a, None]) is None
    i8 = concat_rows([quantize_int8(_w(8, 64, 3)), quantize_int8(_w(8, 64, 4))])
    assert isinstance(i8, Int8Weight) and i8.qweight.shape == (16, 64)
    assert scheme_of(i8) == "int8" and scheme_of(both) == "int4"
    sym = concat_rows([quantize_int4_sym(_w(8, 64, 5)), quantize_int4_sym(_w(8, 64, 6))])
    assert sym.shifts is None and sym.qvalues.shape == (16, 64) and scheme_of(sym) == "int4_sym"
    assert concat_rows([a, quantize_int4_sym(_w(8, 64, 7))]) is None  # with and without shifts


@pytest.mark.parametrize("method", ["int8", "int4", "int4_sym"])
def test_index_rows_and_to_keep_values(method):
    w = quantize(_w(16, 64), method)
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(w.index_rows(perm).dequantize(), w.dequantize()[perm])
    assert isinstance(w.to("cpu"), Int8Weight if method == "int8" else Int4Weight)
    assert scheme_of(w.to("cpu")) == scheme_of(w.index_rows(perm)) == method
