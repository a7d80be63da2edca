"""Tenants by API key: who a request is, for every piece of state the server keeps for it.

A tenant is an API key's identity plus the request's ``cache_salt``, everywhere::

    API keys (--api-key K, repeatable; --api-keys-file {"K": "team-a", ...})
        -> tenant name (a bare --api-key is its own tenant, named by the key's digest)
    request: Authorization: Bearer K | x-api-key: K   both verified when both are sent; an
             Authorization without the Bearer scheme is no credential (a 401 with keys)
        -> Tenant(identity, isolated)
             .cache_salt(salt)   the engine's cache salt: KV block hashes' extra keys, partial
                                 tails, the suffix index, KV events and the router all follow it
             .namespace(salt)    the Responses store's namespace (never shared)
             .owner              whose quota a stored response counts against

Rules: with two or more tenants, each tenant's KV blocks, tails and drafts are its own (the
salt is prefixed with the tenant's digest) unless ``share_prefix_cache`` (then only the request's
own ``cache_salt`` separates them, as with one key); stored responses are never shared. With one
key or none the cache salt is the request's own, as before tenants existed. Without keys nothing
is verified, and the credential a client sends (if any) still names its store namespace.
Keys are never kept in a ``Tenant``: identities are digests or the configured names.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefixserve.api.frontend.protocol import APIError
from prefixserve.core.errors import InvalidArgumentError


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Tenant:
    """``identity``: the tenant's name (or, without keys, a digest of the credential sent);
    ``isolated``: its KV cache is its own (several tenants, not shared)."""

    identity: str = ""
    isolated: bool = False

    @property
    def owner(self) -> str:
        return self.identity

    def cache_salt(self, salt: str | None) -> str | None:
        if not self.isolated:
            return salt
        return f"tenant:{_digest(self.identity)[:32]}/{salt or ''}"

    def namespace(self, salt: str | None) -> str:
        return _digest(f"{self.identity}\0{salt or ''}")


NO_TENANT = Tenant()


def tenant_of(request: Any) -> Tenant:
    """The tenant the authentication middleware found for an HTTP request (``NO_TENANT`` outside
    /v1)."""
    return getattr(request.state, "tenant", NO_TENANT)


class Tenants:
    """The server's API keys and their tenants (see the module doc)."""

    def __init__(self, keys: Mapping[str, str], share_prefix_cache: bool = False) -> None:
        self._keys = {_digest(key): (key, name) for key, name in keys.items()}
        self.isolated = len(set(keys.values())) > 1 and not share_prefix_cache

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def authenticate(self, authorization: str | None, x_api_key: str | None) -> Tenant:
        """The tenant of a request's credentials; a 401 when keys are configured and one is
        missing, unknown, not in the Bearer scheme, or two name different tenants."""
        bearer = _bearer(authorization)
        given = [k for k in (bearer, x_api_key) if k is not None]
        if not self.enabled:
            return Tenant(_digest(given[0]) if given else "")
        if authorization is not None and bearer is None:
            raise APIError("Unauthorized: send the key as 'Authorization: Bearer KEY' (or "
                           "'x-api-key: KEY')", 401)  # fmt: skip
        names = {self._tenant_of(key) for key in given}
        if not given or None in names or len(names) > 1:
            raise APIError("Unauthorized: a valid API key is required", 401)
        return Tenant(names.pop(), self.isolated)  # type: ignore[arg-type]

    def _tenant_of(self, key: str) -> str | None:
        known = self._keys.get(_digest(key))
        if known is None or not hmac.compare_digest(key.encode(), known[0].encode()):
            return None
        return known[1]


def key_tenants(api_keys: list[str]) -> dict[str, str]:
    """``--api-key`` values, each its own tenant (named by the key's digest)."""
    return {key: "key:" + _digest(key)[:16] for key in api_keys if key}


def _bearer(authorization: str | None) -> str | None:
    """The token of ``Authorization: Bearer TOKEN``; None for any other header (or none)."""
    if authorization is None:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def read_keys_file(path: str) -> dict[str, str]:
    """``--api-keys-file``: a JSON object ``{"KEY": "tenant name", ...}``."""
    try:
        keys = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"api_keys_file: cannot read {path}: {exc}",
                                   "api_keys_file") from exc  # fmt: skip
    if not isinstance(keys, dict) or not all(
        isinstance(k, str) and k and isinstance(v, str) and v for k, v in keys.items()
    ):
        raise InvalidArgumentError(
            'api_keys_file: give a JSON object {"KEY": "tenant name", ...} of non-empty strings',
            "api_keys_file",
        )
    return keys
