"""Responses over WebSocket: ``GET /v1/responses`` upgraded (Codex's ``supports_websockets``).

The client sends ``{"type": "response.create", ...}`` text frames, each the body of a
``POST /v1/responses``; the server answers each with its stream's events, one JSON text frame
per event, in order, one request at a time. Codex's first frame is a warm-up (``generate:
false``, the system prompt only): it is prefilled, so its blocks are cached, and it writes no
output. Later frames name ``previous_response_id`` and carry only the new items, usually with
``store: false``: the connection keeps those responses in the store under its own namespace
(counted against the tenant's and the store's bounds) for as long as it lives, so each one
continues token-exact from the last (``continuation``).

Robustness: every frame that fails (a binary frame, bad JSON, a 4xx, an unexpected error) gets
one ``{"type": "error", "status", "error": {...}}`` event and the connection stays open. The
upgrade is authenticated like any /v1 request (``Authorization`` and ``x-api-key``): a bad key is
refused before the upgrade, with the HTTP 401 and error body a POST would get (``deny_websocket``;
Codex reads a handshake's status as it reads an HTTP one, where a close after accepting would
look like a dropped stream to retry). Each turn counts as a request in flight for a
graceful drain; while draining a new frame gets a 503 event. Closing the connection aborts the
request in flight and releases its responses.
"""

from __future__ import annotations

import json
from contextlib import aclosing

from fastapi import WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from prefixserve.api.frontend.gate import Activity, deny_websocket
from prefixserve.api.frontend.protocol import APIError, random_id
from prefixserve.api.frontend.stream import as_api_error
from prefixserve.api.frontend.tenancy import Tenant, Tenants
from prefixserve.api.openai.responses.protocol import ResponsesRequest
from prefixserve.api.openai.responses.serving import ResponsesServing


async def serve_websocket(ws: WebSocket, serving: ResponsesServing, tenants: Tenants,
                          activity: Activity, max_frame_bytes: int) -> None:  # fmt: skip
    """Serve one connection; a frame larger than ``max_frame_bytes`` (the server's request-body
    limit) is answered with a 413 error event."""
    try:
        tenant = tenants.authenticate(ws.headers.get("authorization"), ws.headers.get("x-api-key"))
    except APIError as exc:
        await deny_websocket(ws, exc)
        return
    await ws.accept()
    connection = random_id("ws:")
    try:
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            activity.in_flight += 1
            try:
                if activity.draining:
                    raise activity.refusal()
                await _respond(ws, serving, tenant, connection, message, max_frame_bytes)
            except WebSocketDisconnect:
                return
            except Exception as exc:
                error = as_api_error(exc)
                await ws.send_text(json.dumps({"type": "error", "status": error.status,
                                               **error.body()}))  # fmt: skip
            finally:
                activity.in_flight -= 1
    except WebSocketDisconnect:
        return
    finally:
        serving.store.release(connection)


async def _respond(ws: WebSocket, serving: ResponsesServing, tenant: Tenant, connection: str,
                   message: dict, max_frame_bytes: int) -> None:  # fmt: skip
    frame = message.get("text")
    if frame is None:
        raise APIError("frame: binary frames are not read here; send the JSON as a text frame", 400)
    if len(frame.encode()) > max_frame_bytes:
        raise APIError(
            f"frame: larger than the server's limit of {max_frame_bytes} bytes; "
            "send a smaller request",
            413,
        )
    try:
        body = json.loads(frame)
    except ValueError as exc:
        raise APIError(f"frame: not JSON ({exc}); send a JSON object", 400) from exc
    if not isinstance(body, dict) or body.get("type") != "response.create":
        raise APIError('frame: send {"type": "response.create", ...}', 400, "type")
    body.pop("type")
    try:
        req = ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = str(first["loc"][0]) if first.get("loc") else None
        raise APIError(f"{param}: {first['msg']}", 400, param) from exc
    turn, generation = await serving.start(req, tenant, connection)
    async with generation, aclosing(turn.events(generation)) as events:
        async for event in events:
            await ws.send_text(json.dumps(event, ensure_ascii=False))
