"""The Triton attention backend: paged KV store, split-K decode and prefix-extend kernels.

One ``forward`` over the flattened batch launches at most four kernels and never syncs::

    tokens:  | decode 0 | ... | decode D-1 | prefill chunk D ...... | prefill chunk S-1 ... |
    kernel:  store_kv_cache over all tokens (slots of -1 skipped), then
             decode_attention (split-K + merge)    extend_attention (cached prefix + causal)

Host-side sizes come from the metadata's host fields (``max_seq_len``, ``max_query_len``), never
from device tensors. On CPU the kernels run through Triton's interpreter (tests only).
"""

from __future__ import annotations

from importlib.util import find_spec

import torch

from prefixserve.attention.backend import AttentionBackend
from prefixserve.attention.metadata import AttentionMetadata
from prefixserve.errors import BackendUnavailableError

if find_spec("triton") is not None:
    from prefixserve.kernels import (
        copy_blocks,
        decode_attention,
        extend_attention,
        interpreter_enabled,
        store_kv_cache,
    )


def check_triton_available(device: torch.device | str) -> None:
    """Raise ``BackendUnavailableError`` unless the Triton kernels can run on ``device``.

    CUDA needs triton installed and a visible GPU; CPU needs ``TRITON_INTERPRET=1`` set before the
    kernels were first imported (Triton picks the interpreter when a kernel is defined).
    """
    device = torch.device(device)
    if find_spec("triton") is None:
        raise BackendUnavailableError(
            "attention_backend='triton' needs the triton package: pip install triton, "
            "or use attention_backend='torch'"
        )
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise BackendUnavailableError(
                "attention_backend='triton' was asked for on CUDA but no CUDA device is visible; "
                "use attention_backend='torch' or device='cpu'"
            )
        return
    if device.type != "cpu":
        raise BackendUnavailableError(
            f"attention_backend='triton' runs on CUDA (or on CPU through Triton's interpreter), "
            f"not on {device.type!r}; use attention_backend='torch'"
        )
    if not interpreter_enabled():
        raise BackendUnavailableError(
            "attention_backend='triton' on CPU runs through Triton's interpreter, which was not "
            "enabled: set TRITON_INTERPRET=1 in the environment before starting, or use "
            "attention_backend='torch'"
        )


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton kernels; decodes (first ``num_decodes`` sequences) take the
    split-K decode kernel, prefill chunks the prefix-extend kernel. ``device``, when given, is
    checked with ``check_triton_available`` at construction."""

    name = "triton"

    def __init__(self, device: torch.device | str | None = None) -> None:
        if device is not None:
            check_triton_available(device)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        md = attn_metadata
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        query = _last_dim_contiguous(query)
        self.store_kv(key, value, kv_cache, md.slot_mapping)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        nd = md.num_decodes
        if nd > 0:
            decode_attention(
                query[:nd],
                k_cache,
                v_cache,
                md.block_tables[:nd],
                md.seq_lens[:nd],
                scale,
                out[:nd],
                max_seq_len=md.max_seq_len,
            )
        if md.num_seqs > nd:
            extend_attention(
                query,
                k_cache,
                v_cache,
                md.query_start_loc[nd:],
                md.seq_lens[nd:],
                md.block_tables[nd:],
                md.max_query_len,
                scale,
                out,
            )
        return out

    def store_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        key, value = _last_dim_contiguous(key), _last_dim_contiguous(value)
        store_kv_cache(key, value, kv_cache[0], kv_cache[1], slots)

    def copy_blocks(self, kv_caches: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        copy_blocks(kv_caches, src, dst)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
