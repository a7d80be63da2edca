"""KV events: the prefix cache's changes, in vLLM's wire format, for routers outside the engine.

The block pool reports every change to a ``KVEventRecorder``; once per engine step the engine
hands ``recorder.take()`` to a ``KVEventPublisher`` (``kv_event_publisher.py``), which sends it
as one ``KVEventBatch``::

    BlockPool.cache_block ─ on_block_stored ──┐
    BlockPool._evict ────── on_block_removed ─┼─▶ KVEventRecorder ─ take() ─▶ publish(events)
    BlockPool.reset_prefix_cache ─ on_all_cleared

On the wire (vLLM since vllm-project/vllm#42892, e.g. v0.26) a batch is a msgpack *array* and
each event a msgpack *map* tagged by its class name under ``"type"``::

    [ts, [event, ...], data_parallel_rank]
    {"type": "BlockStored", "block_hashes": [h, ...], "parent_block_hash": h | nil,
     "token_ids": [t, ...], "block_size": n, "lora_id": nil, "medium": "GPU", "lora_name": nil}
    {"type": "BlockRemoved", "block_hashes": [h, ...], "medium": "GPU"}
    {"type": "AllBlocksCleared"}

Block hashes are 128-bit (xxh3_128) but msgpack integers stop at 64 bits, so ``h`` is either the
low 64 bits as an unsigned int (``hash_format="int"``, the default, as vLLM sends by default) or
all 16 bytes big-endian (``"bytes"``, lossless). Consumers that reduce ``bytes`` hashes to 64 bits
(llm-d) take the last 8 bytes, which is the same number in both formats.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import msgspec

from prefixserve.core.errors import InvalidArgumentError
from prefixserve.kv.hashing import BlockHash

ExternalBlockHash = int | bytes
HashFormat = Literal["int", "bytes"]
MEDIUM_GPU = "GPU"
_LOW_64 = (1 << 64) - 1


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's events; positional on the wire: ``[ts, events, data_parallel_rank]``."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events: a msgpack map whose ``"type"`` key holds the class name."""


class BlockStored(KVCacheEvent):
    """Full blocks entered the prefix cache: a run of one chain, parent first.

    ``block_hashes[i]`` names ``token_ids[i * block_size : (i + 1) * block_size]``; the first
    block's parent is ``parent_block_hash`` (None for the first block of a prompt) and every
    later block's parent is the hash before it.
    """

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks left the prefix cache (evicted)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Every block left the prefix cache (``reset_prefix_cache``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVEvent]


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack payload of ``batch``, exactly as vLLM's publisher encodes it."""
    return msgspec.msgpack.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A payload back into typed events; map keys a newer vLLM adds are ignored."""
    return _decoder.decode(payload)


def external_block_hash(
    block_hash: BlockHash, hash_format: HashFormat = "int"
) -> ExternalBlockHash:
    """``block_hash`` as it goes on the wire; a router hashes request tokens and looks up this."""
    if hash_format == "bytes":
        return block_hash.to_bytes(16, "big")
    return block_hash & _LOW_64


class KVEventRecorder:
    """Collects the block pool's prefix-cache changes as events; ``take()`` drains one step's.

    Invariant a consumer relies on: applying every event taken so far, in order, to an empty
    set (BlockStored adds its hashes, BlockRemoved discards them, AllBlocksCleared empties it)
    yields exactly ``{external_block_hash(h) for h in the pool's hash map}`` after the last take.
    The block pool reports a store only for a hash it did not hold and a removal only for one it
    held, so the consumer never sees a hash twice without a removal in between. With the
    default ``"int"`` format two distinct hashes share their low 64 bits with probability about
    n**2 / 2**65 for n cached blocks; a consumer counting hashes instead of setting them stays
    exact even then.

    Events keep their order; the only rewrites are merges that cannot change that result: a
    store whose parent is the previous store's last block extends that event, consecutive
    removals share one event, and a clear discards the step's earlier events. Called from the
    engine thread only (the block pool's thread); not thread-safe.

    ``medium`` names the cache tier as vLLM does: "GPU" is the engine's own KV cache, whatever
    the device (llm-d scores tiers by it); the tiers under it report "CPU_TIER", "DISK" and
    "SHARED" per event (``prefixserve.kv.tiers.events``). Invariant per medium: the hashes
    stored minus those removed in that medium are what that medium holds (a block may be in
    several). ``hash_format`` is described in the module docstring.
    """

    def __init__(self, medium: str | None = MEDIUM_GPU, hash_format: HashFormat = "int") -> None:
        if hash_format not in ("int", "bytes"):
            raise InvalidArgumentError(
                f"hash_format must be 'int' or 'bytes', got {hash_format!r}", "hash_format"
            )
        self.medium = medium
        self.hash_format: HashFormat = hash_format
        self._events: list[KVEvent] = []
        self._chain_tail: BlockHash | None = None  # last block of _events[-1] if a BlockStored

    def on_block_stored(
        self,
        block_hash: BlockHash,
        parent_hash: BlockHash | None,
        token_ids: Sequence[int],
        medium: str | None = None,
    ) -> None:
        """A full block of ``len(token_ids)`` tokens was registered under ``block_hash`` (in the
        pool, or in the tier ``medium`` names)."""
        medium = medium or self.medium
        last = self._events[-1] if self._events else None
        external = external_block_hash(block_hash, self.hash_format)
        if (
            isinstance(last, BlockStored)
            and last.medium == medium
            and parent_hash is not None
            and parent_hash == self._chain_tail
            and len(token_ids) == last.block_size
        ):
            last.block_hashes.append(external)
            last.token_ids.extend(token_ids)
        else:
            parent = (
                None if parent_hash is None else external_block_hash(parent_hash, self.hash_format)
            )
            self._events.append(
                BlockStored(
                    block_hashes=[external],
                    parent_block_hash=parent,
                    token_ids=list(token_ids),
                    block_size=len(token_ids),
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                )
            )
        self._chain_tail = block_hash

    def on_block_removed(self, block_hash: BlockHash, medium: str | None = None) -> None:
        """The block registered under ``block_hash`` was evicted (from the pool, or from the
        tier ``medium`` names)."""
        medium = medium or self.medium
        last = self._events[-1] if self._events else None
        external = external_block_hash(block_hash, self.hash_format)
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(external)
        else:
            self._events.append(BlockRemoved(block_hashes=[external], medium=medium))
        self._chain_tail = None

    def on_all_cleared(self) -> None:
        """Every hash was dropped; what happened earlier in the step no longer matters."""
        self._events = [AllBlocksCleared()]
        self._chain_tail = None

    def take(self) -> list[KVEvent]:
        """The events since the last call, oldest first; the recorder starts empty again."""
        events, self._events = self._events, []
        self._chain_tail = None
        return events
