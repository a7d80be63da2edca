"""The Triton attention backend: paged KV store, split-K decode, cascade decode, prefix-extend.

One ``forward`` over the flattened batch launches a few kernels and never syncs the device::

    tokens:  | decode 0 | ... | decode D-1 | prefill chunk D ...... | prefill chunk S-1 ... |
    kernel:  store_kv_cache over all tokens (slots of -1 skipped), then
             decode_attention (split-K + merge)    extend_attention (cached prefix + causal)
             or, with cascade groups, cascade_decode_attention (shared + suffix + merge)

Cascade decode. ``AttentionMetadata.prefix_groups`` (planned by ``plan_prefix_groups``, the
planner the torch backend uses; nested sharing is already split there into disjoint groups, each
at the depth that reads the fewest blocks) names sequences whose block tables start with the same
blocks. The decode members of a group form a *cascade group* when ``cascade_pays``::

    decode b of group g:  | shared blocks of g (read ONCE for the group) | b's own suffix |
    kernels:                shared-prefix kernel, all of g's queries      decode kernel,
                            in one batched call                           context_starts
                            -> merged by log-sum-exp in one pass (cascade_decode_attention)

Decodes in no cascade group attend to their whole context in the same decode kernel launch
(``context_starts`` 0); prefill chunks, in a group or not, keep the extend kernel over their
whole context. ``cascade_pays`` (kernels/cascade_attention.py) weighs the K/V bytes a group saves
(``(members - 1) * shared_len`` tokens a layer) against one more launch and the float32 partials
the merge reads: on Qwen3-0.6B's shape (8 KV heads x 128, bf16) 8 decodes pay from a shared
prefix of ~440 tokens, 32 from ~110, 2 from ~2,960, and never when the saving is under 10% of the
group's traffic. ``TritonAttentionBackend(cascade=True)`` takes every group with a decode (tests,
benchmarks), ``cascade=False`` none.

The step's plan (which groups take cascade, their index tensors) is derived once by ``plan``,
before the model runs, kept in ``AttentionMetadata.backend_plan`` (the step context is the
metadata itself) and reused by every layer; its index
vectors reach the device in one pinned, non-blocking copy. Host-side sizes (grids, split counts)
come from the metadata's host fields (``max_seq_len``, ``max_query_len``, ``seq_lens_cpu``), never
from device tensors. On CPU the kernels run through Triton's interpreter (tests only).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib.util import find_spec

import torch

from prefixserve.attention.backend import AttentionBackend
from prefixserve.attention.metadata import AttentionMetadata
from prefixserve.core.errors import BackendUnavailableError

if find_spec("triton") is not None:
    from prefixserve.kernels.block_copy import copy_blocks
    from prefixserve.kernels.cascade_attention import (
        CascadeGroups,
        cascade_decode_attention,
        cascade_pays,
    )
    from prefixserve.kernels.decode_attention import decode_attention
    from prefixserve.kernels.extend_attention import extend_attention
    from prefixserve.kernels.interpreter import interpreter_enabled
    from prefixserve.kernels.kv_store import store_kv_cache


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


def cascade_decode_groups(
    prefix_groups: Sequence[tuple[Sequence[int], int]],
    num_decodes: int,
    seq_lens: Sequence[int],
    block_size: int,
    kv_bytes_per_token: int,
    cascade: bool | None = None,
) -> list[tuple[list[int], int]]:
    """The prefix groups whose decodes take the cascade path: ``(decode members, shared blocks)``.

    A group keeps its decode members (sequences ``< num_decodes``); it is taken when ``cascade``
    is True and it has any, or when ``cascade`` is None and ``cascade_pays`` for them
    (``kv_bytes_per_token``: K and V of one token in one layer). Pure Python, per step.
    """
    if cascade is False:
        return []
    taken = []
    for members, num_blocks in prefix_groups:
        decodes = [i for i in members if i < num_decodes]
        if not decodes:
            continue
        shared_len = num_blocks * block_size
        suffixes = [seq_lens[i] - shared_len for i in decodes]
        if cascade or cascade_pays(len(decodes), shared_len, suffixes, kv_bytes_per_token):
            taken.append((decodes, num_blocks))
    return taken


@dataclass(frozen=True, slots=True)
class TritonStepPlan:
    """How one step's decodes read the cache: ``cascade`` lays out the cascade groups (None: every
    decode takes the plain decode kernel). Built once per step by ``TritonAttentionBackend.plan``."""

    cascade: CascadeGroups | None


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton kernels; decodes (first ``num_decodes`` sequences) take the
    split-K decode kernel, or the cascade kernels for prefix groups (``cascade``: None decides
    per group with ``cascade_pays``, True takes every group with a decode, False none); prefill
    chunks take the prefix-extend kernel. ``device``, when given, is checked with
    ``check_triton_available`` at construction."""

    name = "triton"

    def __init__(
        self, device: torch.device | str | None = None, cascade: bool | None = None
    ) -> None:
        if device is not None:
            check_triton_available(device)
        self.cascade = cascade

    def plan(self, attn_metadata: AttentionMetadata, kv_cache: torch.Tensor) -> AttentionMetadata:
        """The metadata, its ``backend_plan`` filled (``TritonStepPlan``; ``kv_cache``: one
        layer's, for its shape)."""
        md = attn_metadata
        if 0 in md.query_lens_cpu:
            raise ValueError("every sequence of a batch needs at least one query token")
        md.backend_plan = TritonStepPlan(self._cascade_groups(md, kv_cache))
        return md

    def _cascade_groups(
        self, md: AttentionMetadata, kv_cache: torch.Tensor
    ) -> CascadeGroups | None:
        nd = md.num_decodes
        if nd == 0 or not md.prefix_groups:
            return None
        _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        kv_bytes = 2 * num_kv_heads * head_dim * kv_cache.element_size()
        groups = cascade_decode_groups(
            md.prefix_groups, nd, md.seq_lens_cpu, block_size, kv_bytes, self.cascade
        )
        if not groups:
            return None
        return CascadeGroups.build(
            groups, md.block_tables[:nd], range(nd + 1), md.seq_lens_cpu[:nd], block_size
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        step: AttentionMetadata,  # planned
        scale: float,
    ) -> torch.Tensor:
        md = step
        if not isinstance(md.backend_plan, TritonStepPlan):
            raise RuntimeError("the triton backend runs a step its plan() planned")
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        query = _last_dim_contiguous(query)
        self.store_kv(key, value, kv_cache, md.slot_mapping)
        groups = md.backend_plan.cascade
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        nd = md.num_decodes
        if nd > 0:
            decodes = (query[:nd], k_cache, v_cache, md.block_tables[:nd], md.seq_lens[:nd])
            if groups is None:
                decode_attention(*decodes, scale, out[:nd], max_seq_len=md.max_seq_len)
            else:
                cascade_decode_attention(*decodes, groups, scale, out[:nd])
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
