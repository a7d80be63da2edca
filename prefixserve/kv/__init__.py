"""The KV cache core in plain Python: chained block hashes, the block pool, the manager."""

from __future__ import annotations

from prefixserve.kv.block_pool import BlockPool, KVBlock
from prefixserve.kv.hashing import BlockHash, extend_block_hashes, hash_block_tokens
from prefixserve.kv.kv_cache_manager import KVCacheManager, PrefixHit

__all__ = [
    "BlockHash",
    "BlockPool",
    "KVBlock",
    "KVCacheManager",
    "PrefixHit",
    "extend_block_hashes",
    "hash_block_tokens",
]
