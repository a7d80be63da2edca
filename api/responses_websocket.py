"""Responses over WebSocket: ``GET /v1/responses`` upgraded (Codex's ``supports_websockets``).

The client sends ``{"type": "response.create", ...}`` text frames, each the body of a
``POST /v1/responses``; the server answers each with its stream's events, one JSON text frame
per event, in order, one request at a time. Codex's first frame is a warm-up (``generate:
false``, the system prompt only): it is prefilled, so its blocks are cached, and it writes no
output. Later frames name ``previous_response_id`` and carry only the new items, usually with
``store: false``: the connection keeps its own chain of responses for as long as it lives, so
each one continues token-exact from the last (``responses_continuation``). A frame that fails
(bad JSON, a 4xx) gets one ``{"type": "error", "status", "error": {...}}`` event and the
connection stays open. Closing the connection aborts the request in flight.
"""

from __future__ import annotations

import hmac
import json
from contextlib import aclosing

from fastapi import WebSocket, WebSocketDisconnect
from prefixserve.api.protocol import APIError
from prefixserve.api.protocol_responses import ResponsesRequest
from prefixserve.api.responses_store import Chain
from prefixserve.api.serving_responses import ResponsesServing
from pydantic import ValidationError


async def serve_websocket(
    ws: WebSocket, serving: ResponsesServing, api_key: str | None, max_frame_bytes: int
) -> None:
    """Serve one connection; a frame larger than ``max_frame_bytes`` (the server's request-body
    limit) is answered with a 413 error event."""
    authorization = ws.headers.get("authorization")
    if api_key and not hmac.compare_digest(
        (authorization or "").encode(), f"Bearer {api_key}".encode()
    ):
        await ws.close(code=1008, reason="Unauthorized: a valid API key is required")
        return
    await ws.accept()
    chain: Chain = {}
    try:
        while True:
            frame = await ws.receive_text()
            try:
                if len(frame.encode()) > max_frame_bytes:
                    raise APIError(
                        f"frame: larger than the server's limit of {max_frame_bytes} bytes; "
                        "send a smaller request",
                        413,
                    )
                await _respond(ws, serving, authorization, chain, frame)
            except APIError as exc:
                await ws.send_text(json.dumps({"type": "error", "status": exc.status, **exc.body()}))
    except WebSocketDisconnect:
        return


async def _respond(
    ws: WebSocket, serving: ResponsesServing, authorization: str | None, chain: Chain, frame: str
) -> None:
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
    turn, streams = await serving.start(req, authorization, chain)
    async with aclosing(turn.events(streams)) as events:
        async for event in events:
            await ws.send_text(json.dumps(event, ensure_ascii=False))
