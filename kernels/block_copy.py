"""Block copy: every copy-on-write ``(src, dst)`` pair of a step, for all layers and both K and V,
in one launch over the whole cache ``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``.

Grid ``(num_pairs, num_layers * 2, cdiv(block_numel, BLOCK))``: program ``(i, lkv, c)`` copies
chunk ``c`` of block ``src[i]`` onto block ``dst[i]`` in layer ``lkv // 2``, K (0) or V (1)
``lkv % 2``. One block of one layer's K or V, ``[block_size, kv_heads, head_dim]``, must be
contiguous. Invariant kept by the KV cache manager: the ``dst`` blocks are distinct fresh blocks
and none of them is a ``src``, so the programs never race.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _copy_blocks_kernel(
    cache_ptr,
    src_ptr,
    dst_ptr,
    stride_layer,
    stride_kv,
    stride_block,
    block_numel,
    BLOCK: tl.constexpr,
):
    pair = tl.program_id(0)
    layer_kv = tl.program_id(1)
    chunk = tl.program_id(2)
    base = (layer_kv // 2).to(tl.int64) * stride_layer + (layer_kv % 2) * stride_kv
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = offs < block_numel
    data = tl.load(cache_ptr + base + src * stride_block + offs, mask=mask)
    tl.store(cache_ptr + base + dst * stride_block + offs, data, mask=mask)


def copy_blocks(kv_caches: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copy block ``src[i]`` onto ``dst[i]`` (``[num_pairs]`` int tensors on the cache's device) in
    every layer, K and V, of ``kv_caches``."""
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_caches.shape
    num_pairs = src.shape[0]
    if num_pairs == 0:
        return
    block_numel = block_size * num_kv_heads * head_dim
    assert kv_caches[0, 0, 0].is_contiguous(), "one cache block must be contiguous"
    chunk = min(triton.next_power_of_2(block_numel), 4096)
    grid = (num_pairs, num_layers * 2, triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        kv_caches,
        src,
        dst,
        kv_caches.stride(0),
        kv_caches.stride(1),
        kv_caches.stride(2),
        block_numel,
        BLOCK=chunk,
        num_warps=4,
    )
