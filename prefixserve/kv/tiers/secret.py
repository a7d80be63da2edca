"""Where the key that authenticates stored blocks comes from (``payload.BlobFormat``).

In order::

    EngineConfig.kv_tier_secret      --kv-tier-secret S | --kv-tier-secret-file PATH |
                                     $PREFIXSERVE_KV_TIER_SECRET (read by the CLI)
    <kv_cache_dir>/tier-secret       with a disk tier: read, or made once (32 random bytes, hex,
                                     mode 0600, linked into place so two starts agree) and kept,
                                     so a restart reads its own blocks back
    a random secret for this process with only a shared tier: its blocks are its own (a warning
                                     says to give every replica the same secret); ``prefixserve
                                     serve --replicas N`` gives its replicas one it made

Replicas that share a Valkey server, or a disk folder, must share the secret to read each
other's blocks; a blob written under another secret is a miss. The MAC key is BLAKE2b of the
secret, so any length of secret works.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
from pathlib import Path

from prefixserve.core.config import EngineConfig
from prefixserve.core.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

SECRET_FILE = "tier-secret"


def new_secret() -> str:
    return secrets.token_hex(32)


def mac_key(secret: str) -> bytes:
    return hashlib.blake2b(secret.encode(), digest_size=32, person=b"prefixserve-kv").digest()


def tier_secret(config: EngineConfig) -> str:
    """The secret for ``config``'s tiers, by the rule of the module doc."""
    if config.kv_tier_secret:
        return config.kv_tier_secret
    if config.kv_cache_dir:
        return folder_secret(Path(config.kv_cache_dir))
    logger.warning(
        "KV tiers: no --kv-tier-secret given; blocks this process writes to the shared tier are "
        "readable by it alone (give every replica the same secret to share them)"
    )
    return new_secret()


def folder_secret(root: Path) -> str:
    """The secret kept in ``root``, made there if it has none."""
    root.mkdir(parents=True, exist_ok=True)
    path = root / SECRET_FILE
    if not path.exists():
        tmp = root / f".{SECRET_FILE}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(new_secret())
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)  # atomic and exclusive: of two starts, one secret wins
        tmp.unlink()
    secret = path.read_text().strip()
    if not secret:
        raise InvalidArgumentError(
            f"kv_cache_dir: {path} is empty; delete it (a new secret is made) or write the "
            "replicas' shared secret into it",
            "kv_tier_secret",
        )
    return secret
