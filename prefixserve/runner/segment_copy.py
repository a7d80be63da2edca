"""Moving a reused segment's K/V to its new positions in the paged cache (``SegmentCopy``).

Values move as they are. Keys were stored rotated by their old positions (rope); rotations
compose, so a key moves from position ``p`` to ``q`` by undoing the rotation at ``p`` and
applying the one at ``q``, both read from the model's own cos/sin tables (``RotaryEmbedding``).
With the tables in ``apply_rope``'s form the two make one rotation per token::

    cos_d = (cos_q * cos_p + sin_q * sin_p) / (cos_p^2 + sin_p^2)
    sin_d = (sin_q * cos_p - cos_q * sin_p) / (cos_p^2 + sin_p^2)
    k_q   = k_p * cos_d + roll(k_p) * sin_d            (apply_rope with (cos_d, sin_d))

``cos_d``/``sin_d`` are computed in float64 per token (small), the rotation itself in the
cache's dtype, so a moved key equals the key the model would have stored at ``q`` for the same
pre-rope key to within that dtype's rounding (the tables' own rounding cancels; YaRN's cos/sin
scale is divided out). This holds for every rope type the models have (default, linear,
llama3, yarn): each is a fixed rotation per position. One gather, one rotation and one scatter
over all layers; copies run before the forward, after the block copies, on whatever device the
cache lives.
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
    rows = kv_caches.view(layers * 2, num_blocks * block_size, heads * dim)  # K, V per layer
    device = kv_caches.device

    def cat(lists: list[list[int]]) -> torch.Tensor:
        return torch.tensor([x for xs in lists for x in xs], dtype=torch.int64, device=device)

    src = cat([c.src_slots for c in copies])
    dst = cat([c.dst_slots for c in copies])
    src_pos = cat([list(range(c.src_start, c.src_start + len(c.src_slots))) for c in copies])
    dst_pos = cat([list(range(c.dst_start, c.dst_start + len(c.dst_slots))) for c in copies])
    cos_p, sin_p = cos[src_pos].double(), sin[src_pos].double()  # (T, D)
    cos_q, sin_q = cos[dst_pos].double(), sin[dst_pos].double()
    norm = cos_p * cos_p + sin_p * sin_p
    cos_d = ((cos_q * cos_p + sin_q * sin_p) / norm).to(kv_caches.dtype)[:, None]  # (T, 1, D)
    sin_d = ((sin_q * cos_p - cos_q * sin_p) / norm).to(kv_caches.dtype)[:, None]
    moved = rows.index_select(1, src)  # (2L, T, H * D)
    keys = moved.view(layers, 2, len(src), heads, dim)[:, 0]
    keys.copy_(keys * cos_d + keys.roll(dim // 2, dims=-1) * sin_d)
    rows.index_copy_(1, dst, moved)
