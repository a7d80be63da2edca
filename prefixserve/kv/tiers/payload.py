"""One block's K/V as bytes, for the disk and shared tiers: safetensors, authenticated and checked.

A stored block is a safetensors blob holding the block's K/V for all layers (one tensor,
``[layers, 2, block_size, kv_heads, head_dim]``; a compressed block ``q`` and ``scale``, see
``codec.py``) and string metadata::

    format        FORMAT_VERSION
    fingerprint   the engine's KV fingerprint (model weights, dtype, block size, KV layout)
    block_hash    32 hex digits: the chained hash, cache salt included (``kv/hashing.py``)
    parent_hash   32 hex digits, or "" for the first block of a chain
    token_ids     the block's token ids, comma-separated
    mac           keyed BLAKE2b (32 bytes, hex) over the fields above and every tensor's name,
                  dtype, shape and bytes, under the tier secret (``secret.py``)

A disk folder or a Valkey server can be written by something other than this process, so a blob
is untrusted input. ``BlobFormat.decode`` accepts one only if every field matches what the caller
looks up (format, fingerprint, hash, tokens), the MAC verifies under this engine's key, and the
tensors are exactly what the pool takes (``codec.check``: names, dtypes, shapes); anything else
(a flipped byte, a truncated blob, another model's block, an older format, a blob written under
another secret, a forged block with a recomputed checksum, a tensor cut in half) raises
``CorruptBlockError``, which the tiers turn into a miss after deleting the blob. Without the
secret nobody can write a blob this engine accepts, so a blob can never put wrong K/V in the pool.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from prefixserve.kv.hashing import BlockKey
from prefixserve.kv.tiers import codec

__all__ = ["BlobFormat", "BlockKey", "CorruptBlockError", "read_header"]

FORMAT_VERSION = "2"
_SIGNED_FIELDS = ("format", "fingerprint", "block_hash", "parent_hash", "token_ids")
MAC_BYTES = 32


class CorruptBlockError(Exception):
    """A stored block failed a check: it must be deleted and counted as a miss."""


def _tokens(token_ids: Sequence[int]) -> str:
    return ",".join(map(str, token_ids))


def read_header(data: bytes) -> dict[str, str]:
    """The metadata of a blob from its first bytes (no payload needed: the index rebuild reads
    only the header of each file). Raises ``CorruptBlockError`` if it cannot be parsed or any
    value is not a string."""
    try:
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        metadata = header["__metadata__"]
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise CorruptBlockError(f"unreadable header: {exc}") from exc
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptBlockError("header without string metadata")
    return metadata


@dataclass(frozen=True)
class BlobFormat:
    """How this engine writes and checks blobs: its KV ``fingerprint``, the tier secret's
    ``mac_key`` (never printed), and the shape and dtype of one pool block."""

    fingerprint: str
    mac_key: bytes = field(repr=False)
    block_shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def key_id(self) -> str:
        """16 hex digits naming the secret (not revealing it): tiers keep the blobs of each
        secret apart, so replicas under other secrets neither read nor delete each other's."""
        return hashlib.blake2b(b"key id", key=self.mac_key, digest_size=8).hexdigest()

    def encode(self, key: BlockKey, tensors: dict[str, torch.Tensor]) -> bytes:
        """The blob of one block (``tensors``: its payload)."""
        cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
        metadata = {
            "format": FORMAT_VERSION,
            "fingerprint": self.fingerprint,
            "block_hash": key.hex,
            "parent_hash": "" if key.parent_hash is None else f"{key.parent_hash:032x}",
            "token_ids": _tokens(key.token_ids),
        }
        metadata["mac"] = self._mac(metadata, cpu)
        return st_save(cpu, metadata=metadata)

    def header_key(self, metadata: dict[str, str]) -> BlockKey:
        """The key a header names, once its format and fingerprint are checked (not the MAC,
        which needs the payload: ``decode`` checks it)."""
        if metadata.get("format") != FORMAT_VERSION:
            raise CorruptBlockError(f"format {metadata.get('format')!r}, expected {FORMAT_VERSION}")
        if metadata.get("fingerprint") != self.fingerprint:
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

    def decode(self, data: bytes, key: BlockKey) -> dict[str, torch.Tensor]:
        """The tensors of a blob stored under ``key``; ``CorruptBlockError`` on any mismatch."""
        metadata = read_header(data)
        found = self.header_key(metadata)
        if found.block_hash != key.block_hash or found.token_ids != tuple(key.token_ids):
            raise CorruptBlockError("the blob holds another block")
        try:
            tensors = st_load(data)
        except Exception as exc:  # safetensors raises its own error types for a damaged blob
            raise CorruptBlockError(f"unreadable payload: {exc}") from exc
        if not hmac.compare_digest(self._mac(metadata, tensors), metadata.get("mac", "")):
            raise CorruptBlockError(
                "MAC mismatch: damaged, forged, or written under another secret"
            )
        try:
            codec.check(tensors, self.block_shape, self.dtype)
        except ValueError as exc:
            raise CorruptBlockError(str(exc)) from exc
        return tensors

    def _mac(self, metadata: dict[str, str], tensors: dict[str, torch.Tensor]) -> str:
        h = hashlib.blake2b(key=self.mac_key, digest_size=MAC_BYTES)
        h.update(json.dumps([metadata.get(f) for f in _SIGNED_FIELDS]).encode())
        for name, t in sorted(tensors.items()):
            h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
            h.update(t.contiguous().view(torch.uint8).reshape(-1).numpy())
        return h.hexdigest()
