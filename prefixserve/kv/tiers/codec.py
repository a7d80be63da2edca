"""How a block's K/V is kept below the pool: as it is, or compressed (``kv_offloading_dtype``).

A payload is a dict of tensors. ``auto`` keeps ``{"kv": block}`` (the pool's dtype, exact);
``int8`` and ``fp8`` keep ``{"q": quantized, "scale": float32}`` with one absmax scale per
(layer, K or V, token, kv head) row of ``head_dim`` values: 4x smaller than float32 (2x than
bfloat16) plus 1/head_dim for the scales. ``decode`` reads any payload back to the pool's
dtype, so a compressed block demoted to disk or the shared tier stays compressed there.
``check`` says whether a payload read back from outside the process is one of these shapes.

Compression loses precision: a loaded block's K/V differs from the computed one by up to half a
quantization step per value (int8: absmax/254; fp8 e4m3: about 1/16 relative). Its effect on
tokens and logprobs is measured on SmolLM2 in tests/test_kv_tiers_compressed.py and
docs/kv-tiers.md; the uncompressed tiers are exact.
"""

from __future__ import annotations

import torch

CODECS = ("auto", "int8", "fp8")
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


def encode(block: torch.Tensor, codec: str) -> dict[str, torch.Tensor]:
    """``block``: one block's K/V (any float dtype), on the CPU."""
    if codec == "auto":
        return {"kv": block}
    x = block.float()
    amax = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
    if codec == "int8":
        scale = amax / 127.0
        return {"q": torch.round(x / scale).to(torch.int8), "scale": scale}
    if codec == "fp8":
        scale = amax / _FP8_MAX
        return {"q": (x / scale).to(torch.float8_e4m3fn), "scale": scale}
    raise ValueError(f"unknown KV codec {codec!r}")


def decode(payload: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The block's K/V in ``dtype``, whatever codec wrote ``payload``."""
    if "kv" in payload:
        return payload["kv"].to(dtype)
    return (payload["q"].float() * payload["scale"]).to(dtype)


def check(payload: dict[str, torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """``ValueError`` unless ``payload`` is what ``encode`` makes of one block of ``shape`` in
    ``dtype`` (the pool's): the same names, dtypes and shapes, so ``decode`` and the copy into
    the pool cannot fail on it."""
    scale_shape = (*shape[:-1], 1)
    if set(payload) == {"kv"}:
        expected = {"kv": ({dtype}, shape)}
    elif set(payload) == {"q", "scale"}:
        expected = {"q": ({torch.int8, torch.float8_e4m3fn}, shape),
                    "scale": ({torch.float32}, scale_shape)}  # fmt: skip
    else:
        raise ValueError(f"payload tensors {sorted(payload)}, expected ['kv'] or ['q', 'scale']")
    for name, (dtypes, want) in expected.items():
        t = payload[name]
        if t.dtype not in dtypes or tuple(t.shape) != tuple(want):
            raise ValueError(f"payload {name!r} is {t.dtype} {tuple(t.shape)}, expected "
                             f"{'/'.join(map(str, dtypes))} {tuple(want)}")  # fmt: skip


def nbytes(payload: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in payload.values())
