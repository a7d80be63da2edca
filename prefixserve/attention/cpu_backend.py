"""``CpuAttentionBackend``: the C++ paged attention kernel on CPU, the torch reference elsewhere.

A step whose sequences each run at most ``TOKEN_BY_TOKEN_MAX_QUERY`` tokens (decodes,
speculative verify steps, short chunks) runs the C++ kernel (``prefixserve.kernels
.cpu_attention``): it writes the K/V and reads each sequence's blocks in place, one query token
at a time, so a token's result does not depend on the rest of the batch; prefix groups are not
used there. With ``batch_invariant`` every step runs it (prefill chunks too: each token over its
whole context, so neither the batch nor the chunking of a prompt changes a bit). Other steps
(long prefill chunks), and caches that are not float32, take the torch reference
(``TorchAttentionBackend``), which this backend extends.

The plan of a kernel step is four tensors (``PagedStep``), nothing else: a compiled decode step
(``prefixserve.runner.compiled_step``) takes them as graph inputs, and attention inside the graph
is a direct call of the C++ op, the very call an eager step makes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from prefixserve.attention.metadata import AttentionMetadata, token_contexts
from prefixserve.attention.torch_backend import TorchAttentionBackend
from prefixserve.core.errors import InvalidArgumentError
from prefixserve.kernels import cpu_ops
from prefixserve.kernels.cpu_attention import paged_attention

# steps whose sequences run at most this many tokens each go token by token through the C++ kernel
TOKEN_BY_TOKEN_MAX_QUERY = 8


class PagedStep(NamedTuple):
    """The C++ kernel's step context: where each token's K/V goes, the sequences' block tables,
    and each query token's sequence (a row of ``block_tables``) and context length."""

    slot_mapping: torch.Tensor  # [T] int64, -1: write nothing
    block_tables: torch.Tensor  # [S, W] int32
    token_seq: torch.Tensor  # [T] int32
    token_len: torch.Tensor  # [T] int32


class CpuAttentionBackend(TorchAttentionBackend):
    """The torch reference with the C++ paged kernel for token-by-token steps (module
    docstring); ``batch_invariant`` runs every step through the kernel."""

    name = "cpu"

    def __init__(self, batch_invariant: bool = False) -> None:
        if not cpu_ops.available():
            raise InvalidArgumentError(
                "the cpu attention backend needs the CPU kernels, which could not be built here "
                "(a C++ compiler and ninja); see the log",
                param="batch_invariant" if batch_invariant else "attention_backend",
            )
        self.batch_invariant = batch_invariant

    def plan(
        self, attn_metadata: AttentionMetadata, kv_cache: torch.Tensor
    ) -> PagedStep | AttentionMetadata:
        md = attn_metadata
        token_by_token = self.batch_invariant or md.max_query_len <= TOKEN_BY_TOKEN_MAX_QUERY
        if not (token_by_token and kv_cache.dtype == torch.float32 and kv_cache.is_cpu):
            return super().plan(md, kv_cache)
        if 0 in md.query_lens_cpu:
            raise ValueError("every sequence of a batch needs at least one query token")
        return PagedStep(md.slot_mapping, md.block_tables, *token_contexts(md))

    def forward(
        self,
        query: torch.Tensor,  # [T, nh, hd]
        key: torch.Tensor,  # [T, nkv, hd]
        value: torch.Tensor,  # [T, nkv, hd]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, nkv, hd]
        step: PagedStep | AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, nh, hd]
        if isinstance(step, PagedStep):
            return paged_attention(
                query.contiguous(), key.contiguous(), value.contiguous(), kv_cache, *step, scale
            )
        return super().forward(query, key, value, kv_cache, step, scale)
