"""Stored responses: GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items, and
the Responses WebSocket (GET /v1/responses upgraded), each scoped to the caller's tenant."""

from __future__ import annotations

from fastapi import APIRouter, Request, WebSocket

from prefixserve.api.frontend.gate import Activity
from prefixserve.api.frontend.tenancy import Tenants, tenant_of
from prefixserve.api.openai.responses.serving import ResponsesServing
from prefixserve.api.openai.responses.websocket import serve_websocket


def responses_router(
    responses: ResponsesServing, tenants: Tenants, activity: Activity, max_frame_bytes: int
) -> APIRouter:
    router = APIRouter()

    @router.websocket("/v1/responses")
    async def responses_websocket(ws: WebSocket):
        await serve_websocket(ws, responses, tenants, activity, max_frame_bytes)

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, raw_request: Request, cache_salt: str | None = None):
        return responses.lookup(tenant_of(raw_request), response_id, cache_salt).response

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(
        response_id: str, raw_request: Request, cache_salt: str | None = None
    ):
        return await responses.delete(tenant_of(raw_request), response_id, cache_salt)

    @router.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(
        response_id: str, raw_request: Request, cache_salt: str | None = None, limit: int = 20,
        order: str = "desc", after: str | None = None,
    ):  # fmt: skip
        entry = responses.lookup(tenant_of(raw_request), response_id, cache_salt)
        return responses.input_items(entry, limit, order, after)

    return router
