"""The tiers' changes as KV events: vLLM's ``medium`` names the tier a block is stored in.

The block pool reports its own blocks as ``GPU`` (``kv_events.MEDIUM_GPU``, whatever the
device); the tier worker's changes (``KVTierManager.take_events``) are added to the same
recorder once per step, as ``BlockStored`` / ``BlockRemoved`` with ``CPU_TIER``, ``DISK`` or
``SHARED``. A block may be held in several media at once (a router keeps one set per medium);
a restart announces every block its disk tier found.
"""

from __future__ import annotations

from collections.abc import Iterable

from prefixserve.kv.kv_events import KVEventRecorder
from prefixserve.kv.tiers.manager import STORED
from prefixserve.kv.tiers.payload import BlockKey


def record_tier_events(
    recorder: KVEventRecorder, events: Iterable[tuple[str, str, BlockKey]]
) -> None:
    for kind, medium, key in events:
        if kind == STORED:
            recorder.on_block_stored(key.block_hash, key.parent_hash, key.token_ids, medium)
        else:
            recorder.on_block_removed(key.block_hash, medium)
