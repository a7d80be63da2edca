"""Tiers under the block pool, one key: host memory, a disk folder, a shared Valkey/Redis server.

Every tier keys a block by its chained hash (cache salt included) plus its token ids and stores
its K/V for all layers as one payload. ``manager.KVTierManager`` runs them off the step path;
``KVCacheManager`` asks it for loads and hands it evictions and new blocks. What the disk and
shared tiers return is untrusted (authenticated and checked: ``payload.py``, ``secret.py``).
docs/kv-tiers.md describes the flags, the formats and the guarantees.
"""

from __future__ import annotations

import torch

from prefixserve.core.config import EngineConfig
from prefixserve.kv.retention import RetentionTable
from prefixserve.kv.tiers.base import KVTier
from prefixserve.kv.tiers.block_io import kv_fingerprint
from prefixserve.kv.tiers.disk import DiskTier
from prefixserve.kv.tiers.host import HostTier
from prefixserve.kv.tiers.manager import KVTierManager
from prefixserve.kv.tiers.payload import BlobFormat
from prefixserve.kv.tiers.secret import mac_key, tier_secret
from prefixserve.kv.tiers.shared import SharedTier

__all__ = ["DiskTier", "HostTier", "KVTier", "KVTierManager", "SharedTier", "build_kv_tiers"]

GIB = 1 << 30


def build_kv_tiers(
    config: EngineConfig,
    model: torch.nn.Module,
    kv_caches: torch.Tensor,
    retention: RetentionTable | None,
) -> KVTierManager | None:
    """The tiers ``config`` asks for, top first, attached to ``kv_caches``; None without any."""
    if not config.has_kv_tiers or not config.enable_prefix_caching:
        return None
    retained_by = retention.tenant_of if retention is not None else None
    share = config.kv_tier_tenant_share
    tiers: list[KVTier] = []
    if config.kv_offloading_size:
        tiers.append(HostTier(int(config.kv_offloading_size * GIB), retained_by, share))
    if config.kv_cache_dir or config.kv_shared_url:
        blob_format = BlobFormat(
            kv_fingerprint(model, kv_caches, config.block_size),
            mac_key(tier_secret(config)),
            tuple(kv_caches[:, :, 0].shape),
            kv_caches.dtype,
        )
        if config.kv_cache_dir:
            size = int(config.kv_cache_dir_size * GIB)
            tiers.append(DiskTier(config.kv_cache_dir, size, blob_format, retained_by, share))
        if config.kv_shared_url:
            tiers.append(SharedTier(config.kv_shared_url, blob_format))
    manager = KVTierManager(
        tiers, config.block_size, kv_caches.dtype, offloading_dtype=config.kv_offloading_dtype
    )
    manager.attach(kv_caches)
    return manager
