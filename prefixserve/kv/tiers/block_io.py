"""Copying whole blocks of K/V out of and into the paged cache, and the cache's fingerprint.

The cache is one tensor ``kv_caches[layers, 2, num_blocks, block_size, kv_heads, head_dim]``
(``ModelRunner.kv_caches``). A block's payload is its slice over every layer, K and V, made
contiguous: ``[layers, 2, block_size, kv_heads, head_dim]`` on the CPU. Copy-in moves many blocks in
one indexed copy. Only the engine thread calls them, between steps: a block is
copied out before anything can write it again, and copied in before it is registered.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from xxhash import xxh3_128

KV_LAYOUT = "layers,2,block_size,kv_heads,head_dim"
_WEIGHT_SAMPLE_BYTES = 1 << 16


def copy_out(kv_caches: torch.Tensor, block_ids: Sequence[int]) -> list[torch.Tensor]:
    """One CPU tensor per block, ``[layers, 2, block_size, kv_heads, head_dim]``, each its own
    storage (a tier may keep one block and drop the next)."""
    shape = kv_caches[:, :, 0].shape
    out = []
    for block_id in block_ids:  # one copy each, into its own storage (tiers keep them apart)
        block = torch.empty(shape, dtype=kv_caches.dtype, device="cpu")
        block.copy_(kv_caches[:, :, block_id])
        out.append(block)
    return out


def copy_in(
    kv_caches: torch.Tensor, block_ids: Sequence[int], blocks: Sequence[torch.Tensor]
) -> None:
    """Write each payload (``copy_out``'s shape, any device, the cache's dtype) into its block."""
    if not block_ids:
        return
    ids = torch.tensor(block_ids, dtype=torch.int64, device=kv_caches.device)
    stacked = torch.stack(list(blocks)).to(kv_caches.device, kv_caches.dtype)
    kv_caches.index_copy_(2, ids, stacked.movedim(0, 2))


def kv_fingerprint(model: torch.nn.Module, kv_caches: torch.Tensor, block_size: int) -> str:
    """32 hex digits naming what a stored block's K/V depends on besides its tokens: the model's
    weights (each parameter's name, shape, dtype and first 64 KiB), the cache's dtype, block size
    and layout. Blocks of another model, dtype or layout never load."""
    h = xxh3_128()
    for name, param in model.state_dict().items():
        h.update(f"{name}:{tuple(param.shape)}:{param.dtype};".encode())
        try:
            flat = param.detach().reshape(-1)
            sample = flat[: max(1, _WEIGHT_SAMPLE_BYTES // max(1, flat.element_size()))]
            h.update(sample.to("cpu").contiguous().view(torch.uint8).numpy())
        except (RuntimeError, TypeError):  # a packed tensor subclass: its name and shape only
            pass
    layers, _, _, _, heads, dim = kv_caches.shape
    h.update(f"{kv_caches.dtype}|{block_size}|{KV_LAYOUT}|{layers}|{heads}|{dim}".encode())
    return h.hexdigest()
