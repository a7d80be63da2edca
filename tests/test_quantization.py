"""Weight-only int8 / int4: the quantizers' round trips, both kernel paths of each linear against
its ``kernel_weight``, and which linears ``quantize_linears`` replaces with what."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixserve.errors import InvalidArgumentError
from prefixserve.models.quantization import (
    INT4_GROUP_SIZE,
    Int4Linear,
    Int4Weight,
    Int8Linear,
    Int8Weight,
    concat_rows,
    kernel_weight,
    quantize_int4,
    quantize_int8,
    quantize_linears,
    uses_packed_kernel,
)

CPU = torch.device("cpu")


def _w(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def test_int8_round_trip_is_within_half_a_step_per_channel():
    w = _w(48, 64)
    w[3] = 0  # an all-zero row
    q = quantize_int8(w)
    assert q.qweight.dtype == torch.int8 and q.qweight.abs().max() <= 127
    assert q.scales[3] == 1 and (q.qweight[3] == 0).all()
    torch.testing.assert_close(q.scales[5], w[5].abs().max() / 127)
    err = (q.dequantize() - w).abs()
    assert (err <= q.scales[:, None] / 2 + 1e-6).all()
    assert (q.qweight.abs().amax(1)[w.abs().amax(1) > 0] == 127).all()  # the range is used


def test_int4_round_trip_is_within_half_a_step_per_group_and_exact_on_constants():
    w = _w(16, 96)
    w[2, 32:64] = 0.25  # a constant group: scale 0, every code stands for 0.25
    q = quantize_int4(w)
    assert q.qvalues.dtype == torch.uint8 and int(q.qvalues.max()) <= 15
    assert q.scales.shape == (16, 96 // INT4_GROUP_SIZE)
    deq = q.dequantize()
    assert (deq[2, 32:64] == 0.25).all() and q.scales[2, 1] == 0
    steps = q.scales.repeat_interleave(INT4_GROUP_SIZE, dim=1)
    assert ((deq - w).abs() <= steps / 2 + 1e-6).all()
    groups = w.view(16, 3, INT4_GROUP_SIZE)  # each group's min and max are represented exactly
    torch.testing.assert_close(deq.view(16, 3, -1).amin(-1), groups.amin(-1))
    torch.testing.assert_close(deq.view(16, 3, -1).amax(-1), groups.amax(-1))


def test_int4_needs_whole_groups():
    with pytest.raises(InvalidArgumentError, match="divisible by 32"):
        quantize_int4(_w(16, 40))


def test_concat_rows_stacks_one_scheme_only():
    a, b = quantize_int4(_w(16, 64, 1)), quantize_int4(_w(32, 64, 2))
    both = concat_rows([a, b])
    torch.testing.assert_close(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    assert concat_rows([a, quantize_int8(_w(32, 64))]) is None
    assert concat_rows([a, None]) is None
    i8 = concat_rows([quantize_int8(_w(8, 64, 3)), quantize_int8(_w(8, 64, 4))])
    assert isinstance(i8, Int8Weight) and i8.qweight.shape == (16, 64)


def test_kernel_weight_rounds_scales_to_bfloat16_only_on_the_packed_path():
    w = quantize_int4(_w(32, 64))
    assert uses_packed_kernel(w, CPU)
    assert not uses_packed_kernel(quantize_int4(_w(24, 64)), CPU)  # 24 rows: not a multiple of 16
    packed, exact = kernel_weight(w, CPU), w.dequantize()
    assert not torch.equal(packed, exact)
    assert (packed - exact).abs().max() < 0.02 * exact.abs().max()
    torch.testing.assert_close(kernel_weight(w, torch.device("meta")), exact)


@pytest.mark.parametrize("rows", [32, 24])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_linear_matches_its_kernel_weight(rows, bias):
    w = quantize_int4(_w(rows, 128))
    b = torch.randn(rows) if bias else None
    x = torch.randn(5, 128)
    lin = Int4Linear(w, b, torch.float32)
    assert lin.packed == (rows % 16 == 0)
    ref = F.linear(x, kernel_weight(w, CPU), b)
    # packed: input and output rounded to bfloat16 (relative 2^-8 each), float32 accumulation
    tol = 2e-2 * ref.abs().max() if lin.packed else 1e-5
    torch.testing.assert_close(lin(x), ref, atol=float(tol), rtol=0)
    torch.testing.assert_close(lin(x[None])[0], lin(x))  # leading dims


def test_int4_portable_path_is_exact_to_the_dequantized_weight():
    w = quantize_int4(_w(32, 64))
    lin = Int4Linear(w, None, torch.float32, portable=True)
    assert not lin.packed and lin.codes.shape == (32, 32)  # two codes a byte
    x = torch.randn(3, 64)
    torch.testing.assert_close(lin(x), x @ w.dequantize().t(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("portable", [False, True])
def test_int8_linear_matches_its_kernel_weight(portable):
    w = quantize_int8(_w(40, 64))
    b = torch.randn(40)
    x = torch.randn(4, 64)
    lin = Int8Linear(w, b, torch.float32, portable=portable)
    ref_w = w.dequantize() if portable else kernel_weight(w, CPU)
    ref = F.linear(x, ref_w, b)
    tol = 1e-5 if portable else float(2e-2 * ref.abs().max())
    torch.testing.assert_close(lin(x), ref, atol=tol, rtol=0)


class _Toy(torch.nn.Module):
    """Two "layers" with a fused qkv-like linear, an odd-width one, and a linear outside."""

    def __init__(self) -> None:
        super().__init__()
        from prefixserve.models.llama import Linear

        def lin(k: int, n: int) -> Linear:
            m = Linear(k, n, bias=False)
            m.weight.data = _w(n, k, n + k)
            return m

        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict({"qkv_proj": lin(64, 48), "odd": lin(40, 16)}) for _ in range(2)
        )
        self.head = lin(64, 16)

    @staticmethod
    def source_weight_names(module: str) -> list[str]:
        if module.endswith("qkv_proj"):
            prefix = module.rsplit(".", 1)[0]
            return [f"{prefix}.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")]
        return [f"{module}.weight"]


def test_quantize_linears_replaces_layer_linears_and_skips_odd_widths():
    toy = _Toy()
    done = quantize_linears(toy, "int4")
    assert done == {"layers.0.qkv_proj": "int4", "layers.1.qkv_proj": "int4"}
    assert isinstance(toy.layers[0]["qkv_proj"], Int4Linear)
    assert type(toy.layers[0]["odd"]).__name__ == "Linear"  # 40 inputs: not whole groups
    assert type(toy.head).__name__ == "Linear"  # outside the decoder layers
    done = quantize_linears(_Toy(), "int8")
    assert set(done.values()) == {"int8"} and len(done) == 4


def test_quantize_linears_uses_prequantized_parts_in_their_scheme():
    toy = _Toy()
    parts = [quantize_int4(_w(16, 64, s)) for s in range(3)]
    pre = {f"layers.0.{p}.weight": q for p, q in zip(("q_proj", "k_proj", "v_proj"), parts)}
    pre["layers.1.q_proj.weight"] = parts[0]  # k, v missing: layer 1 is not prequantized
    done = quantize_linears(toy, None, pre)
    assert done == {"layers.0.qkv_proj": "int4"}
    lin = toy.layers[0]["qkv_proj"]
    x = torch.randn(2, 64)
    ref = x @ kernel_weight(concat_rows(parts), CPU).t()
    torch.testing.assert_close(lin(x), ref, atol=float(2e-2 * ref.abs().max()), rtol=0)
    # int8 asked: the int4 parts are not used; every layer is quantized from its float weight
    done = quantize_linears(_Toy(), "int8", pre)
    assert set(done.values()) == {"int8"}


def test_unknown_method_is_a_typed_error():
    with pytest.raises(InvalidArgumentError, match="quantization"):
        quantize_linears(_Toy(), "int3")


def test_int4_weight_index_rows_and_to_keep_values():
    w = quantize_int4(_w(16, 64))
    perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(w.index_rows(perm).dequantize(), w.dequantize()[perm])
    assert isinstance(w.to(CPU), Int4Weight)
