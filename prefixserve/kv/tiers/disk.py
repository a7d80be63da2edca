"""The disk tier (``--kv-cache-dir PATH``, ``--kv-cache-dir-size GiB``): one file per block.

Layout: ``PATH/<fingerprint>/<block hash, 32 hex digits>.kvb``, each file a ``payload.py`` blob
(safetensors with the format version, fingerprint, parent hash, token ids and a MAC under the
tier secret, which ``secret.py`` keeps in ``PATH/tier-secret`` unless one is given). The
fingerprint folder keeps models, dtypes and KV layouts apart; the header repeats it, so a file
copied into the wrong folder still fails its check.

Writes go to a ``.tmp`` file in the same folder and are renamed into place, so a reader (or a
restart) never sees half a file under a block's name. At start-up the index is rebuilt from the
folder: leftover ``.tmp`` files are removed, and every file whose header does not parse, names
another format or fingerprint, or does not match its own file name is deleted. A file is loaded
only after its key, MAC, dtypes and shapes are checked (``BlobFormat.decode``); one that fails
is deleted and is a miss. Least recently used files (by modification time, refreshed on every
hit) go first when the folder passes its size; retained blocks within their tenant's quota
last (``lru_index.py``). Evicted files are deleted, not demoted: the
shared tier below, if any, already holds every computed block (write-through).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path

from prefixserve.kv.tiers.base import MEDIUM_DISK, KVTier, Payload, RetainedBy, TierUnavailableError
from prefixserve.kv.tiers.lru_index import LRUIndex
from prefixserve.kv.tiers.payload import BlobFormat, BlockKey, CorruptBlockError, read_header

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
_HEADER_READ = 1 << 16  # bytes read to parse a header at start-up (token ids of a block fit)


class DiskTier(KVTier):
    medium = MEDIUM_DISK

    def __init__(
        self,
        root: str | Path,
        capacity_bytes: int,
        blob_format: BlobFormat,
        retained_by: RetainedBy | None = None,
        tenant_share: float = 1.0,
    ) -> None:
        super().__init__()
        self.format = blob_format
        self.dir = Path(root) / blob_format.fingerprint
        self.dir.mkdir(parents=True, exist_ok=True)
        self.counters.capacity_bytes = capacity_bytes
        self._index: LRUIndex[None] = LRUIndex(self.counters, retained_by, tenant_share)
        self.removed_at_start = 0  # temp files and files that failed a check
        self._rebuild_index()

    # ---- index ---------------------------------------------------------------------------------

    def _rebuild_index(self) -> None:
        found = []
        for path in self.dir.iterdir():
            if path.name.endswith(SUFFIX):
                key = self._check_header(path)
                if key is not None:
                    found.append((path.stat().st_mtime_ns, key, path.stat().st_size))
                    continue
            self._unlink(path)
            self.removed_at_start += 1
        for _, key, size in sorted(found, key=lambda f: f[0]):
            self._index.add(key, size, None)
        while self.counters.bytes > self.counters.capacity_bytes:
            self._evict_one()
        if self.counters.blocks or self.removed_at_start:
            logger.info(
                "KV disk tier %s: %d blocks (%.1f MiB) found, %d leftover or bad files removed",
                self.dir, self.counters.blocks, self.counters.bytes / 2**20, self.removed_at_start,
            )  # fmt: skip

    def _check_header(self, path: Path) -> BlockKey | None:
        try:
            with path.open("rb") as f:
                key = self.format.header_key(read_header(f.read(_HEADER_READ)))
        except (CorruptBlockError, OSError):
            return None
        return key if path.name == key.hex + SUFFIX else None

    def _path(self, key: BlockKey) -> Path:
        return self.dir / (key.hex + SUFFIX)

    def contains(self, key: BlockKey) -> bool:
        with self._lock:
            return self._index.get(key) is not None

    def stored_keys(self) -> list[BlockKey]:
        with self._lock:
            return self._index.keys()

    # ---- I/O -----------------------------------------------------------------------------------

    def get(self, key: BlockKey) -> Payload | None:
        if not self.contains(key):
            return None
        path = self._path(key)
        try:
            data = path.read_bytes()
            payload = self.format.decode(data, key)
        except (CorruptBlockError, OSError) as exc:
            logger.warning("KV disk tier: %s failed its check (%s); deleted", path.name, exc)
            self.counters.corrupt += 1
            self.discard(key)
            return None
        with self._lock:
            self._index.get(key, touch=True)
        with contextlib.suppress(OSError):
            os.utime(path)  # least recently used survives a restart
        return payload

    def put(self, key: BlockKey, payload: Payload) -> list[tuple[BlockKey, Payload | None]]:
        data = self.format.encode(key, payload)
        c = self.counters
        if len(data) > c.capacity_bytes:
            return []
        with self._lock:
            self._index.drop(key.block_hash)
            evicted: list[tuple[BlockKey, Payload | None]] = []
            while c.bytes + len(data) > c.capacity_bytes:
                evicted.append((self._evict_one(), None))
        path = self._path(key)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}")
        try:
            with tmp.open("wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as exc:
            self._unlink(tmp)
            raise TierUnavailableError(f"cannot write {path}: {exc}") from exc
        with self._lock:
            self._index.add(key, len(data), None)
            c.stores += 1
        return evicted

    def _evict_one(self) -> BlockKey:
        key, _, _ = self._index.evict()
        self._unlink(self._path(key))
        return key

    def discard(self, key: BlockKey) -> bool:
        with self._lock:
            dropped = self._index.drop(key.block_hash) is not None
        self._unlink(self._path(key))
        return dropped

    def clear(self) -> None:
        with self._lock:
            keys = self._index.keys()
            self._index.clear()
        for key in keys:
            self._unlink(self._path(key))

    @staticmethod
    def _unlink(path: Path) -> None:
        with contextlib.suppress(OSError):
            path.unlink()
