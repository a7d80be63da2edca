"""The shared tier (``--kv-shared-url redis://HOST:PORT``): blocks in a Valkey or Redis server.

Every replica that points at the same server publishes the blocks it computed (write-through,
see ``manager.py``) and reads those any replica computed: one key per block,
``prefixserve:kv:<fingerprint>:<key id>:<block hash>`` (the key id names the tier secret, so
deployments under other secrets keep apart), holding a ``payload.py`` blob (so the key's
fingerprint and the blob's header, MAC, dtypes and shapes are checked on every load; a blob that
fails is deleted and is a miss: a server anyone else can write cannot change a token). The
server's own memory policy bounds the tier (run it with ``maxmemory`` and ``maxmemory-policy
allkeys-lru``); this process keeps no index of what the server holds, so a lookup is a
pipelined ``GET`` on the tier worker, never on the engine thread.

What this process wrote (or read) recently is remembered by hash (``WRITTEN_MEMORY`` entries,
16 bytes each): ``contains`` says so, and the manager does not write such a block again, so the
same prefix sent again costs no writes. A block the server dropped since is written again once
it leaves this memory.

A server that does not answer within ``timeout_s`` (gone, killed, partitioned) makes the tier
unavailable: the error is logged once, every call raises ``TierUnavailableError`` at once, and
the connection is tried again after ``retry_s``. The engine goes on without the tier.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from prefixserve.core.errors import InvalidArgumentError
from prefixserve.kv.tiers.base import MEDIUM_SHARED, KVTier, Payload, TierUnavailableError
from prefixserve.kv.tiers.payload import BlobFormat, BlockKey, CorruptBlockError

logger = logging.getLogger(__name__)

KEY_PREFIX = "prefixserve:kv:"
WRITTEN_MEMORY = 1 << 16


def _client_module():
    """The ``redis`` client, else ``valkey`` (the same API)."""
    try:
        import redis

        return redis
    except ImportError:
        pass
    try:
        import valkey

        return valkey
    except ImportError:
        raise InvalidArgumentError(
            "kv_shared_url needs a Valkey/Redis client: pip install redis", "kv_shared_url"
        ) from None


class SharedTier(KVTier):
    medium = MEDIUM_SHARED
    remote = True

    def __init__(
        self,
        url: str,
        blob_format: BlobFormat,
        timeout_s: float = 1.0,
        retry_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        module = _client_module()
        self.url = url
        self.format = blob_format
        self._written: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # hash -> token ids
        self.retry_s = retry_s
        self._clock = clock
        self._errors = (module.exceptions.ConnectionError, module.exceptions.TimeoutError, OSError)
        try:
            self._client = module.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
            )
        except ValueError as exc:
            raise InvalidArgumentError(f"kv_shared_url: {exc}", "kv_shared_url") from exc
        self._down_until = 0.0

    def _key(self, key: BlockKey) -> str:
        return f"{KEY_PREFIX}{self.format.fingerprint}:{self.format.key_id}:{key.hex}"

    def _call(self, fn):
        if self._clock() < self._down_until:
            raise TierUnavailableError(f"the shared KV tier at {self.url} is unavailable")
        try:
            result = fn()
        except self._errors as exc:
            if self.counters.available:
                logger.warning(
                    "shared KV tier at %s unreachable (%s): going on without it, retrying "
                    "every %.0f s", self.url, exc, self.retry_s,
                )  # fmt: skip
            self.counters.available = False
            self._down_until = self._clock() + self.retry_s
            raise TierUnavailableError(f"the shared KV tier at {self.url}: {exc}") from exc
        if not self.counters.available:
            logger.warning("shared KV tier at %s is back", self.url)
            self.counters.available = True
        return result

    def contains(self, key: BlockKey) -> bool:
        """Whether this process wrote or read ``key`` recently (no I/O; lookups go through
        ``get_many`` on the worker)."""
        with self._lock:
            return self._written.get(key.block_hash) == tuple(key.token_ids)

    def _remember(self, key: BlockKey) -> None:
        with self._lock:
            self._written[key.block_hash] = tuple(key.token_ids)
            self._written.move_to_end(key.block_hash)
            while len(self._written) > WRITTEN_MEMORY:
                self._written.popitem(last=False)

    def _forget(self, key: BlockKey) -> None:
        with self._lock:
            self._written.pop(key.block_hash, None)

    def stored_keys(self) -> list[BlockKey]:
        return []

    def get(self, key: BlockKey) -> Payload | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[BlockKey]) -> list[Payload | None]:
        """The payloads of ``keys`` in one round trip; None for each miss or failed check."""

        def fetch():
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.get(self._key(key))
            return pipe.execute()

        out: list[Payload | None] = []
        for key, data in zip(keys, self._call(fetch)):
            payload = None
            if data is not None:
                try:
                    payload = self.format.decode(data, key)
                    self._remember(key)
                except CorruptBlockError as exc:
                    logger.warning("shared KV tier: block %s failed its check (%s)", key.hex, exc)
                    self.counters.corrupt += 1
                    self.discard(key)
            out.append(payload)
        return out

    def put(self, key: BlockKey, payload: Payload) -> list[tuple[BlockKey, Payload | None]]:
        data = self.format.encode(key, payload)
        self._call(lambda: self._client.set(self._key(key), data))
        self._remember(key)
        self.counters.stores += 1
        self.counters.blocks += 1  # written by this engine (the server bounds what it keeps)
        self.counters.bytes += len(data)
        return []

    def discard(self, key: BlockKey) -> bool:
        self._forget(key)
        try:
            return bool(self._call(lambda: self._client.delete(self._key(key))))
        except TierUnavailableError:
            return False

    def clear(self) -> None:
        """Nothing: the server is shared with other replicas."""

    def close(self) -> None:
        self._client.close()
