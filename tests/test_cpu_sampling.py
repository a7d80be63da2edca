"""kernels/cpu_sampling: ``finite_rows`` says which rows of a step's logits are all finite, the
same as torch's element-wise check, for NaN and either infinity anywhere in a row (in the
sixteen-lane body or in the tail), whatever the row count; off the C++ path torch answers."""

from __future__ import annotations

import pytest
import torch

from prefixserve.kernels import cpu_ops
from prefixserve.kernels.cpu_sampling import finite_rows

needs_kernels = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ toolchain")


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 30
    for r in range(0, rows, 2):  # every other row gets one bad value at a seeded place
        bad = (float("nan"), float("inf"), -float("inf"))[r // 2 % 3]
        x[r, int(torch.randint(vocab, (1,), generator=g))] = bad
    return x


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 7, 33])
@pytest.mark.parametrize("vocab", [49152, 1000, 17, 5])  # 1000, 17, 5: a tail past the lanes
def test_finite_rows_equals_the_element_wise_check(rows, vocab):
    x = _logits(rows, vocab, rows * vocab)
    got = torch.ops.prefixserve_cpu.finite_rows(x)
    assert got.dtype == torch.bool and torch.equal(got, torch.isfinite(x).all(dim=-1))


@needs_kernels
def test_a_bad_value_in_the_last_lane_or_the_tail_is_found():
    for at in (0, 15, 16, 31, 47, 48):  # 49 columns: three lanes' worth and one in the tail
        x = torch.zeros(1, 49)
        x[0, at] = float("inf")
        assert not bool(finite_rows(x)[0]), at
    huge = torch.full((1, 64), 3e38)  # finite, though its sum is not: the row passes
    assert bool(finite_rows(huge)[0])


def test_other_dtypes_and_views_take_torch_or_a_copy():
    x = _logits(4, 100, 3)
    expected = torch.isfinite(x).all(dim=-1)
    assert torch.equal(finite_rows(x.to(torch.bfloat16)), expected)
    assert torch.equal(finite_rows(x.t().contiguous().t()), expected)  # a non-contiguous view
