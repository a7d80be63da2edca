"""The door of the HTTP server: protocol-shaped error bodies, the body-size limit, and graceful
drain, which counts HTTP requests and WebSocket turns alike (``Activity``).

On SIGTERM (``drain``) every new request gets a 503, a new WebSocket upgrade is refused (close
1013, before it is accepted), a connected WebSocket's next frame gets a 503 error event, and
what is in flight gets ``grace_seconds`` before its engine requests are aborted with a 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from prefixserve.api.anthropic.protocol import anthropic_error, is_messages_path
from prefixserve.api.async_engine import RETRY_AFTER_SECONDS
from prefixserve.api.frontend.protocol import APIError

logger = logging.getLogger(__name__)


def error_response_body(exc: APIError, path: str) -> tuple[int, dict]:
    """``(status, body)``: Anthropic's shape on the Messages routes, OpenAI's elsewhere."""
    if is_messages_path(path):
        return anthropic_error(exc)
    return exc.status, exc.body()


def error_response(exc: APIError, path: str = "") -> JSONResponse:
    status, body = error_response_body(exc, path)
    return JSONResponse(body, status_code=status, headers=exc.headers)


async def _send_error(send, exc: APIError, path: str) -> None:
    """Answer a raw ASGI request with ``exc`` as a JSON error body."""
    status, content = error_response_body(exc, path)
    body = json.dumps(content).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Activity:
    """What a drain waits for: ``in_flight`` HTTP requests and WebSocket turns; ``draining``
    once it started (new requests, upgrades and turns are refused)."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0

    def refusal(self) -> APIError:
        return APIError(
            "the server is shutting down and accepts no new requests; retry on another "
            "replica or later",
            503,
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )


class Gate:
    """Pure ASGI middleware at the door: body size limit, refusal while draining, requests in flight.

    The body is read here, up to ``max_body_bytes`` (a larger ``Content-Length`` is refused before
    reading; a body that grows past the limit while streaming in is refused as soon as it does),
    and replayed to the app; later ``receive`` calls go to the client, so disconnects still show.
    """

    def __init__(self, app, max_body_bytes: int, activity: Activity) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.activity = activity

    def _too_large(self) -> APIError:
        return APIError(
            f"request body: larger than the server's limit of {self.max_body_bytes} bytes; "
            "send a smaller request",
            413,
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket" and self.activity.draining:
            await receive()  # the connect message
            await send({"type": "websocket.close", "code": 1013, "reason": "shutting down"})
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.activity.draining and scope["path"] != "/metrics":
            await _send_error(send, self.activity.refusal(), scope["path"])
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await _send_error(send, self._too_large(), scope["path"])
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                await _send_error(send, self._too_large(), scope["path"])
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        self.activity.in_flight += 1
        try:
            await self.app(scope, replay, send)
        finally:
            self.activity.in_flight -= 1




async def drain(app: FastAPI, grace_seconds: float) -> None:
    """Refuse new requests, upgrades and WebSocket turns, give those in flight (WebSocket turns
    included) ``grace_seconds``, then abort the rest."""
    gate, engine = app.state.activity, app.state.engine
    gate.draining = True
    logger.info("draining: %d requests in flight, grace %.1f s", gate.in_flight, grace_seconds)
    deadline = time.monotonic() + grace_seconds
    while gate.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if gate.in_flight:
        logger.warning("grace period over: aborting %d requests in flight", gate.in_flight)
        engine.fail_all(
            APIError("the server shut down before this request finished; retry it", 503)
        )
        deadline = time.monotonic() + 5.0
        while gate.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
