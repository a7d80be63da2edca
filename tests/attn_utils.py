"""Test helpers: build ``AttentionMetadata`` for a flattened batch, plan it and run paged model
steps (every forward takes the step context its backend's ``plan`` returns).

A batch is described per sequence as ``(num_cached, num_new)`` plus its block table; decodes
(``num_new == 1``) must come first, as the engine's model runner lays them out.
"""

from __future__ import annotations

import torch

from prefixserve.attention.metadata import AttentionMetadata, SeqSpan, build_attention_metadata


def build_attn_metadata(
    seqs: list[tuple[int, int]],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, AttentionMetadata]:
    """Return ``(positions [T], metadata)`` for sequences ``(num_cached, num_new)``, through the
    engine's own builder (prefix groups planned as the model runner plans them)."""
    spans = [SeqSpan(t, cached, new) for (cached, new), t in zip(seqs, block_tables)]
    return build_attention_metadata(spans, block_size, device)


def attend(backend, query, key, value, kv_cache, md, scale) -> torch.Tensor:
    """``backend.forward`` over the step ``backend.plan`` makes of ``md``."""
    return backend.forward(query, key, value, kv_cache, backend.plan(md, kv_cache), scale)


def forward(model, input_ids, positions, kv_caches, md, keep=None) -> torch.Tensor:
    """``model``'s forward over the step its attention backend plans of ``md``."""
    backend = model.model.layers[0].self_attn.backend
    return model(input_ids, positions, kv_caches, backend.plan(md, kv_caches[0]), keep)


class BlockAllocator:
    """Hands out block ids in a scrambled but fixed order, so tables are not contiguous."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.free = torch.randperm(num_blocks, generator=gen).tolist()

    def grow(self, table: list[int], num_tokens: int, block_size: int) -> list[int]:
        """Extend ``table`` in place until it covers ``num_tokens`` positions."""
        while len(table) * block_size < num_tokens:
            table.append(self.free.pop())
        return table


def run_step(
    model: torch.nn.Module,
    kv_caches: torch.Tensor,
    batch: list[tuple[list[int], int, int]],
    block_tables: list[list[int]],
    block_size: int,
) -> list[torch.Tensor]:
    """One forward; ``batch`` holds ``(token_ids, num_cached, num_new)`` per sequence.

    Returns each sequence's logits ``[num_new, vocab]`` for its new tokens.
    """
    seqs = [(cached, new) for _, cached, new in batch]
    positions, md = build_attn_metadata(seqs, block_tables, block_size, kv_caches.device)
    input_ids = torch.tensor(
        [t for ids, cached, new in batch for t in ids[cached : cached + new]],
        device=kv_caches.device,
    )
    logits = model.compute_logits(forward(model, input_ids, positions, kv_caches, md))
    return list(logits.split(md.query_lens_cpu))


def new_kv_caches(config, num_blocks: int, block_size: int, dtype=torch.float32) -> torch.Tensor:
    """``[num_layers, 2, num_blocks, block_size, nkv, hd]`` zeros."""
    return torch.zeros(
        config.num_hidden_layers,
        2,
        num_blocks,
        block_size,
        config.num_key_value_heads,
        config.head_dim,
        dtype=dtype,
    )
