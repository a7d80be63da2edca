"""Moving a reused segment's K/V to its new positions in the paged cache (``SegmentCopy``).

Values move as they are. Keys were stored rotated by their old positions (rope); rotations
compose, so a key moves from position ``p`` to ``q`` by undoing the rotation at ``p`` and
applying the one at ``q``, both read from the model's own cos/sin tables (``RotaryEmbedding``)::

    k_pre = (k * cos_p - roll(k) * sin_p) / (cos_p^2 + sin_p^2)     the key before rope
    k_q   = k_pre * cos_q + roll(k_pre) * sin_q                     as the model rotates at q

in float64, so a moved key equals the key the model would have stored at ``q`` for the same
pre-rope key to within rounding (the tables' own rounding cancels; YaRN's cos/sin scale is
divided out). This holds for every rope type the models have (default, linear, llama3, yarn):
each is a fixed rotation per position. Copies run before the forward, after the block copies,
on whatever device the cache lives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefixserve.kv.segments import SegmentCopy


def copy_segments(
    kv_caches: torch.Tensor,
    copies: Sequence[SegmentCopy],
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Perform ``copies`` in ``kv_caches`` ``[layers, 2, blocks, block_size, kv_heads, dim]``;
    ``cos``/``sin``: ``[max_pos, dim]`` in ``apply_rope``'s form (``[c, c]``, ``[-s, s]``)."""
    if not copies:
        return
    layers, _, num_blocks, block_size, heads, dim = kv_caches.shape
    flat = kv_caches.view(layers, 2, num_blocks * block_size, heads, dim)
    device = kv_caches.device

    def cat(lists: list[list[int]]) -> torch.Tensor:
        return torch.tensor([x for xs in lists for x in xs], dtype=torch.int64, device=device)

    src = cat([c.src_slots for c in copies])
    dst = cat([c.dst_slots for c in copies])
    src_pos = cat([list(range(c.src_start, c.src_start + len(c.src_slots))) for c in copies])
    dst_pos = cat([list(range(c.dst_start, c.dst_start + len(c.dst_slots))) for c in copies])
    keys = flat[:, 0, src].double()  # (L, T, H, D)
    cos_p, sin_p = cos[src_pos].double()[None, :, None], sin[src_pos].double()[None, :, None]
    cos_q, sin_q = cos[dst_pos].double()[None, :, None], sin[dst_pos].double()[None, :, None]
    half = dim // 2
    pre = (keys * cos_p - keys.roll(half, dims=-1) * sin_p) / (cos_p * cos_p + sin_p * sin_p)
    moved = pre * cos_q + pre.roll(half, dims=-1) * sin_q
    values = flat[:, 1, src]
    flat[:, 0, dst] = moved.to(kv_caches.dtype)
    flat[:, 1, dst] = values
