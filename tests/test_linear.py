"""``prefixserve.models.linear``: which kernel each matrix gets, that every kernel multiplies and
reads rows as its weight says, that float weights are dropped once a kernel holds the matrix,
and which matrices ``finalize_linears`` quantizes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from prefixserve.core.errors import InvalidArgumentError
from prefixserve.kernels import cpu_ops
from prefixserve.models.linear import (
    Dense,
    Linear,
    PackedBlock,
    PackedFloat,
    PackedInt4,
    PackedInt8,
    PackedW4A8,
    PackedW8A8,
    Portable,
    Stacked,
    finalize_linears,
    make_kernel,
)
from prefixserve.models.quantization import concat_rows, quantize, quantize_int4

needs_kernels = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ toolchain")


def _w(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@needs_kernels
@pytest.mark.parametrize("scheme", [None, "int8", "int4", "int4_sym"])
def test_cpu_float32_weights_take_the_packed_kernels(scheme):
    w = _w(48, 64)
    kernel = make_kernel(w if scheme is None else quantize(w, scheme), torch.float32)
    kinds = {None: PackedFloat, "int8": PackedInt8, "int4": PackedInt4, "int4_sym": PackedInt4}
    assert type(kernel) is kinds[scheme]


@pytest.mark.parametrize("scheme", [None, "int8", "int4", "int4_sym"])
def test_other_dtypes_take_torch_kernels(scheme):
    w = _w(48, 64).bfloat16()
    held = w if scheme is None else quantize(w.float(), scheme)
    assert type(make_kernel(held, torch.bfloat16)) is (Dense if scheme is None else Portable)


def _kernels(w: torch.Tensor, scheme: str | None):
    held = w if scheme is None else quantize(w, scheme)
    reference = w if scheme is None else held.dequantize()
    kernels = [make_kernel(held, torch.float32)]
    kernels.append(Dense(w) if scheme is None else Portable(held, torch.float32))
    return kernels, reference


@pytest.mark.parametrize("scheme", [None, "int8", "int4", "int4_sym"])
def test_every_kernel_multiplies_and_reads_rows_as_its_weight(scheme):
    w, b = _w(40, 64, 1), torch.randn(40)
    kernels, reference = _kernels(w, scheme)
    x = torch.randn(2, 3, 64)  # leading dims are kept
    index = torch.tensor([[0, 39], [17, 17]])
    for kernel in kernels:
        torch.testing.assert_close(kernel(x, b), F.linear(x, reference, b), atol=1e-4, rtol=1e-4)
        assert torch.equal(kernel.rows(index), reference[index])


@needs_kernels
@pytest.mark.parametrize("scheme", ["int8", "int4", "int4_sym"])
def test_int8_activation_kernels_read_rows_as_their_weight(scheme):
    """``PackedW8A8`` / ``PackedW4A8`` (the vocabulary's embedding rows); ``int4_sym`` holds no
    shifts and reads its rows as ``(q - 8) * scale``."""
    held = quantize(_w(40, 64, 2), scheme)
    kernel = make_kernel(held, torch.float32, activations="int8")
    assert type(kernel) is (PackedW8A8 if scheme == "int8" else PackedW4A8)
    if scheme != "int8":
        assert (kernel.shifts is None) == (scheme == "int4_sym")
    index = torch.tensor([[0, 39], [17, 16]])
    assert torch.equal(kernel.rows(index), held.dequantize()[index])


def test_a_stacked_kernel_is_its_parts_side_by_side():
    parts = [quantize(_w(16, 64, 1), "int4"), quantize(_w(8, 64, 2), "int8"), _w(24, 64, 3)]
    reference = torch.cat([p if isinstance(p, torch.Tensor) else p.dequantize() for p in parts])
    kernel = Stacked([make_kernel(p, torch.float32) for p in parts])
    x, b = torch.randn(2, 3, 64), torch.randn(48)
    assert (kernel.out_features, kernel.in_features) == (48, 64)
    torch.testing.assert_close(kernel(x, b), F.linear(x, reference, b), atol=1e-4, rtol=1e-4)
    index = torch.tensor([[0, 47], [16, 23]])
    assert torch.equal(kernel.rows(index), reference[index])


def test_finalize_stacks_prequantized_parts_of_different_schemes():
    toy = _Toy()
    parts = [quantize(_w(16, 64, s), m) for s, m in ((0, "int4"), (1, "int4"), (2, "int8"))]
    pre = {f"layers.0.{p}.weight": q for p, q in zip(("q_proj", "k_proj", "v_proj"), parts)}
    assert finalize_linears(toy, None, pre, toy.source_names) == {
        "layers.0.qkv_proj": "int4+int4+int8"
    }
    assert isinstance(toy.layers[0]["qkv_proj"].kernel, Stacked)
    done = finalize_linears(_Toy(), "int8", pre, _Toy.source_names)  # one scheme asked: one kernel
    assert done["layers.0.qkv_proj"] == "int8"


def test_a_linear_drops_its_float_weight_for_a_kernel():
    lin = Linear(64, 48, bias=True)
    lin.weight.copy_(_w(48, 64))
    lin.bias.copy_(torch.randn(48))
    x = torch.randn(3, 64)
    before = lin(x)
    lin.set_kernel(make_kernel(lin.weight.detach().clone(), torch.float32))
    assert lin.weight is None and "weight" not in dict(lin.named_parameters())
    torch.testing.assert_close(lin(x), before, atol=1e-5, rtol=1e-5)


class _Toy(torch.nn.Module):
    """Two "layers" with a fused qkv-like linear and an odd-width one, and a vocabulary."""

    def __init__(self) -> None:
        super().__init__()

        def lin(k: int, n: int) -> Linear:
            m = Linear(k, n, bias=False)
            m.weight.data = _w(n, k, n + k)
            return m

        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict({"qkv_proj": lin(64, 48), "odd": lin(40, 16)}) for _ in range(2)
        )
        self.embed_tokens = lin(64, 100)

    @staticmethod
    def source_names(module: str) -> list[str]:
        if module.endswith("qkv_proj"):
            prefix = module.rsplit(".", 1)[0]
            return [f"{prefix}.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")]
        return [f"{module}.weight"]


def test_finalize_quantizes_layers_in_the_scheme_and_the_vocabulary_in_int8():
    toy = _Toy()
    done = finalize_linears(toy, "int4", None, toy.source_names)
    assert done == {"layers.0.qkv_proj": "int4", "layers.1.qkv_proj": "int4",
                    "embed_tokens": "int8"}  # fmt: skip
    assert toy.layers[0]["odd"].kernel is not None  # 40 inputs: not whole groups, still float
    assert not any(isinstance(m, Linear) and m.weight is not None for m in toy.modules())
    assert finalize_linears(_Toy(), None) == {}  # float: every matrix packed, none quantized


def test_finalize_keeps_prequantized_parts_unless_another_scheme_is_asked():
    toy = _Toy()
    parts = [quantize_int4(_w(16, 64, s)) for s in range(3)]
    pre = {f"layers.0.{p}.weight": q for p, q in zip(("q_proj", "k_proj", "v_proj"), parts)}
    pre["layers.1.q_proj.weight"] = parts[0]  # k, v missing: layer 1 is not prequantized
    done = finalize_linears(toy, None, pre, toy.source_names)
    assert done == {"layers.0.qkv_proj": "int4"}
    x = torch.randn(2, 64)
    ref = x @ concat_rows(parts).dequantize().t()
    torch.testing.assert_close(toy.layers[0]["qkv_proj"](x), ref, atol=1e-4, rtol=1e-4)
    assert finalize_linears(_Toy(), "int4", pre, _Toy.source_names)["layers.0.qkv_proj"] == "int4"
    done = finalize_linears(_Toy(), "int8", pre, _Toy.source_names)  # re-quantized from float
    assert done["layers.0.qkv_proj"] == "int8" and done["layers.1.qkv_proj"] == "int8"


def test_finalize_keeps_a_scale_only_file_for_int4_sym_and_stores_its_shifts_for_int4():
    parts = [quantize(_w(16, 64, s), "int4_sym") for s in range(3)]
    pre = {f"layers.0.{p}.weight": q for p, q in zip(("q_proj", "k_proj", "v_proj"), parts)}
    assert finalize_linears(_Toy(), None, pre, _Toy.source_names)["layers.0.qkv_proj"] == "int4_sym"
    toy = _Toy()
    assert finalize_linears(toy, "int4_sym", pre, toy.source_names) == {
        "layers.0.qkv_proj": "int4_sym", "layers.1.qkv_proj": "int4_sym", "embed_tokens": "int8"
    }  # fmt: skip
    x = torch.randn(2, 64)
    ref = x @ concat_rows(parts).dequantize().t()  # the file's parts, kept
    torch.testing.assert_close(toy.layers[0]["qkv_proj"](x), ref, atol=1e-4, rtol=1e-4)
    toy = _Toy()
    done = finalize_linears(toy, "int4", pre, toy.source_names)  # the same values, shifts stored
    assert done["layers.0.qkv_proj"] == "int4"
    torch.testing.assert_close(toy.layers[0]["qkv_proj"](x), ref, atol=1e-4, rtol=1e-4)
    assert finalize_linears(_Toy(), "int8", pre, _Toy.source_names)["layers.0.qkv_proj"] == "int8"


def test_finalize_refuses_an_unknown_method():
    with pytest.raises(InvalidArgumentError, match="quantization"):
        finalize_linears(_Toy(), "int3")


@needs_kernels
@pytest.mark.parametrize("activations", ["int8", None])
def test_block_weights_take_the_block_kernel_on_cpu_and_portable_elsewhere(activations):
    from gguf_files import random_blocks

    from prefixserve.models.gguf_blocks import read_block

    w = read_block("Q4_K", random_blocks("Q4_K", 40, 1, 0))
    kernel = make_kernel(w, torch.float32, activations)
    assert type(kernel) is PackedBlock and kernel.int8 == (activations == "int8")
    assert type(make_kernel(w, torch.bfloat16, activations)) is Portable
    index = torch.tensor([[0, 39], [17, 17]])
    assert torch.equal(kernel.rows(index), w.dequantize()[index])
    x = torch.randn(3, 256)
    reference = F.linear(x.double(), w.dequantize().double()).float()
    assert (kernel(x, None) - reference).abs().max() < 0.02 * reference.abs().max()
