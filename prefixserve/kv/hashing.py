"""Chained block hashes: the identity of a full block of KV.

A block's KV depends on every token before it, so its hash chains the parent's::

    h_0 = H(None, tokens[0:bs],    extra_keys)
    h_i = H(h_{i-1}, tokens[i*bs:(i+1)*bs], extra_keys)

``extra_keys`` holds whatever changes the KV for the same tokens (the request's
``cache_salt``, an adapter id). It goes into every block's hash, not only the first, so
two requests with different keys never share any block. Only full blocks are hashed:
a partial last block has no identity yet.

Tokens are packed as signed 64-bit integers, the parent as 16 bytes and the extra keys
through ``repr`` with a length prefix, so distinct inputs never produce the same byte
string. Hashes are 128-bit ints (xxh3_128); a lookup still compares the stored token ids.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from xxhash import xxh3_128_intdigest

from prefixserve.core.errors import InvalidArgumentError

BlockHash = int
ExtraKeys = tuple[Hashable, ...]

_NO_PARENT = b"\x00"


@dataclass(frozen=True, slots=True)
class BlockKey:
    """What names a full block below the pool (``prefixserve.kv.tiers``): its chained hash
    (cache salt included) and its token ids. ``parent_hash`` is not part of the identity; it
    travels with the block (file headers, KV events)."""

    block_hash: BlockHash
    token_ids: tuple[int, ...]
    parent_hash: BlockHash | None = None

    @property
    def hex(self) -> str:
        return f"{self.block_hash:032x}"


def _parent_bytes(parent_hash: BlockHash | None) -> bytes:
    if parent_hash is None:
        return _NO_PARENT
    return b"\x01" + parent_hash.to_bytes(16, "little")


def _extra_bytes(extra_keys: ExtraKeys) -> bytes:
    encoded = repr(tuple(extra_keys)).encode()
    return len(encoded).to_bytes(4, "little") + encoded


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: ExtraKeys = (),
) -> BlockHash:
    """Hash of one block given its parent's hash (None for the first block)."""
    data = _parent_bytes(parent_hash) + _extra_bytes(extra_keys) + array("q", token_ids).tobytes()
    return xxh3_128_intdigest(data)


def extend_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: ExtraKeys,
    block_hashes: list[BlockHash],
) -> None:
    """Append to ``block_hashes`` the hashes of the full blocks it does not hold yet.

    A sequence owns ``block_hashes`` and calls this whenever tokens are appended; earlier
    blocks are never rehashed. With ``block_size`` 4 and 10 tokens, two hashes exist
    after the call; tokens 8..9 wait until the block fills::

        tokens  | 0 1 2 3 | 4 5 6 7 | 8 9 . . |
        hashes    h_0       h_1       (none)
    """
    if block_size <= 0:
        raise InvalidArgumentError(f"block_size must be positive, got {block_size}", "block_size")
    start_block = len(block_hashes)
    end_block = len(token_ids) // block_size
    if end_block <= start_block:
        return
    packed = array("q", token_ids[start_block * block_size : end_block * block_size]).tobytes()
    stride = 8 * block_size
    prefix = _extra_bytes(extra_keys)
    parent = block_hashes[-1] if block_hashes else None
    append = block_hashes.append
    for offset in range(0, len(packed), stride):
        parent = xxh3_128_intdigest(
            _parent_bytes(parent) + prefix + packed[offset : offset + stride]
        )
        append(parent)
