"""POST /v1/kv/release: drop what the caller retained."""

from __future__ import annotations

from fastapi import APIRouter, Request

from prefixserve.api.async_engine import AsyncEngine
from prefixserve.api.frontend.tenancy import tenant_of
from prefixserve.api.openai.prompt_cache import retention_session
from prefixserve.api.openai.protocol import ReleaseRequest


def kv_router(engine: AsyncEngine) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/kv/release")
    async def release_kv(body: ReleaseRequest, raw_request: Request):
        """With ``id``, what that response or completion retained (``prompt_cache_retention``);
        without, its ``cache_control`` prefixes. Scoped to the caller's tenant and
        ``cache_salt``; the blocks stay cached as ordinary blocks."""
        namespace = tenant_of(raw_request).namespace(body.cache_salt)
        session = namespace if body.id is None else retention_session(namespace, body.id)
        return {"object": "kv.release", "released_blocks": await engine.release_kv(session)}

    return router
