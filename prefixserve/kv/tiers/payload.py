"""One block's K/V as bytes, for the disk and shared tiers: safetensors with a checked header.

A stored block is a safetensors blob holding the block's K/V for all layers (one tensor,
``[layers, 2, block_size, kv_heads, head_dim]``; a compressed block adds its scales) and
string metadata::

    format        FORMAT_VERSION
    fingerprint   the engine's KV fingerprint (model weights, dtype, block size, KV layout)
    block_hash    32 hex digits: the chained hash, cache salt included (``kv/hashing.py``)
    parent_hash   32 hex digits, or "" for the first block of a chain
    token_ids     the block's token ids, comma-separated
    checksum      xxh3_64 of the tensors' bytes, 16 hex digits

``decode_block`` accepts a blob only if every field matches what the caller looks up (format,
fingerprint, hash, tokens) and the checksum matches the bytes; anything else (a flipped byte, a
truncated blob, another model's block, an older format) raises ``CorruptBlockError``, which the
tiers turn into a miss after deleting the blob. So a blob can never put wrong K/V in the pool.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from xxhash import xxh3_64

from prefixserve.kv.hashing import BlockKey

__all__ = [
    "BlockKey",
    "CorruptBlockError",
    "decode_block",
    "encode_block",
    "header_key",
    "read_header",
]

FORMAT_VERSION = "1"


class CorruptBlockError(Exception):
    """A stored block failed a check: it must be deleted and counted as a miss."""


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = xxh3_64()
    for _, t in sorted(tensors.items()):
        h.update(t.contiguous().view(torch.uint8).reshape(-1).numpy())
    return h.hexdigest()


def _tokens(token_ids: Sequence[int]) -> str:
    return ",".join(map(str, token_ids))


def encode_block(key: BlockKey, tensors: dict[str, torch.Tensor], fingerprint: str) -> bytes:
    """The blob of one block (``tensors``: its payload, CPU tensors)."""
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    metadata = {
        "format": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "block_hash": key.hex,
        "parent_hash": "" if key.parent_hash is None else f"{key.parent_hash:032x}",
        "token_ids": _tokens(key.token_ids),
        "checksum": _checksum(cpu),
    }
    return st_save(cpu, metadata=metadata)


def read_header(data: bytes) -> dict[str, str]:
    """The metadata of a blob from its first bytes (no payload needed: the index rebuild reads
    only the header of each file). Raises ``CorruptBlockError`` if it cannot be parsed."""
    try:
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        metadata = header["__metadata__"]
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise CorruptBlockError(f"unreadable header: {exc}") from exc
    if not isinstance(metadata, dict):
        raise CorruptBlockError("header without metadata")
    return metadata


def header_key(metadata: dict[str, str], fingerprint: str) -> BlockKey:
    """The key a header names, once its format and fingerprint are checked."""
    if metadata.get("format") != FORMAT_VERSION:
        raise CorruptBlockError(f"format {metadata.get('format')!r}, expected {FORMAT_VERSION}")
    if metadata.get("fingerprint") != fingerprint:
        raise CorruptBlockError("fingerprint of another model, dtype, block size or KV layout")
    try:
        parent = metadata["parent_hash"]
        tokens = metadata["token_ids"]
        return BlockKey(
            int(metadata["block_hash"], 16),
            tuple(int(t) for t in tokens.split(",")) if tokens else (),
            int(parent, 16) if parent else None,
        )
    except (KeyError, ValueError) as exc:
        raise CorruptBlockError(f"bad header field: {exc}") from exc


def decode_block(data: bytes, key: BlockKey, fingerprint: str) -> dict[str, torch.Tensor]:
    """The tensors of a blob stored under ``key``; ``CorruptBlockError`` on any mismatch."""
    found = header_key(read_header(data), fingerprint)
    if found.block_hash != key.block_hash or found.token_ids != tuple(key.token_ids):
        raise CorruptBlockError("the blob holds another block")
    try:
        tensors = st_load(data)
    except Exception as exc:  # safetensors raises its own error types for a damaged blob
        raise CorruptBlockError(f"unreadable payload: {exc}") from exc
    if _checksum(tensors) != read_header(data).get("checksum"):
        raise CorruptBlockError("checksum mismatch")
    return tensors
