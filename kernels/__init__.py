"""Triton kernels over the paged KV cache, and the fused MoE (imported as ``prefixserve.kernels``).

On CUDA they compile for the GPU; on CPU they run through Triton's interpreter, which Triton
selects when a kernel is defined, so ``TRITON_INTERPRET=1`` must be in the environment before this
package is first imported. ``interpreter_enabled`` reports which of the two happened.
"""

from __future__ import annotations

from prefixserve.kernels.block_copy import copy_blocks
from prefixserve.kernels.cascade_attention import (
    CascadeGroups,
    cascade_decode_attention,
    cascade_pays,
    shared_prefix_attention,
)
from prefixserve.kernels.decode_attention import decode_attention, default_num_splits
from prefixserve.kernels.extend_attention import extend_attention
from prefixserve.kernels.fused_moe import fused_moe
from prefixserve.kernels.kv_store import store_kv_cache
from prefixserve.kernels.merge_attn_states import merge_attn_states


def interpreter_enabled() -> bool:
    """True when the kernels were defined under Triton's interpreter (runnable on CPU tensors)."""
    from prefixserve.kernels.kv_store import _store_kv_kernel
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_store_kv_kernel, InterpretedFunction)


__all__ = [
    "CascadeGroups",
    "cascade_decode_attention",
    "cascade_pays",
    "copy_blocks",
    "decode_attention",
    "default_num_splits",
    "extend_attention",
    "fused_moe",
    "interpreter_enabled",
    "merge_attn_states",
    "shared_prefix_attention",
    "store_kv_cache",
]
