"""The door of the HTTP server: protocol-shaped error bodies, the body-size limit, the last
resort for unexpected errors, and graceful drain, which counts HTTP requests and WebSocket turns
alike (``Activity``).

An exception no handler turned into a response (a bug: a field of an unexpected type that slipped
past validation) is answered here as a 500 ``internal_error`` in the route's shape (Anthropic's on
/v1/messages), logged with its traceback, and not raised further: uvicorn closes a connection
whose application raised, so the client's keep-alive connection survives only this way. An error
after the response started (a stream) cannot be answered; the stream drivers end those.

On SIGTERM (``drain``) every new request gets a 503, a new WebSocket upgrade is refused (an HTTP
503 with ``Retry-After`` in answer to the handshake), a connected WebSocket's next frame gets a
503 error event, and what is in flight gets ``grace_seconds`` before its engine requests are
aborted with a 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from fastapi import FastAPI

from prefixserve.api.engine_client import RETRY_AFTER_SECONDS
from prefixserve.api.frontend.errors import OPENAI_ONLY, ErrorShapes
from prefixserve.api.frontend.protocol import APIError, internal_error

logger = logging.getLogger(__name__)


async def _send_error(
    send, exc: APIError, path: str, prefix: str = "http", shapes: ErrorShapes = OPENAI_ONLY
) -> None:
    """Answer a raw ASGI request with ``exc`` as a JSON error body in ``path``'s shape
    (``prefix`` "websocket.http": as the answer to a WebSocket handshake, ASGI's denial
    response)."""
    status, content = shapes.body(exc, path)
    body = json.dumps(content).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in exc.headers.items()]
    await send({"type": f"{prefix}.response.start", "status": status, "headers": headers})
    await send({"type": f"{prefix}.response.body", "body": body})


async def deny_websocket(ws, exc: APIError) -> None:
    """Refuse a WebSocket handshake with ``exc`` as an HTTP response (its status and JSON body),
    as OpenAI's Responses WebSocket does: clients (Codex) read the status (401, 503) the way they
    read it over HTTP. Servers without ASGI's denial-response extension close instead (1008)."""
    if "websocket.http.response" in ws.scope.get("extensions", {}):
        await _send_error(ws.send, exc, ws.url.path, "websocket.http")
    else:
        await ws.close(code=1008, reason=exc.message[:120])


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

    def __init__(self, app, max_body_bytes: int, activity: Activity, shapes: ErrorShapes) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.activity = activity
        self.shapes = shapes

    async def _refuse(self, send, exc: APIError, path: str, prefix: str = "http") -> None:
        await _send_error(send, exc, path, prefix, self.shapes)

    def _too_large(self) -> APIError:
        return APIError(
            f"request body: larger than the server's limit of {self.max_body_bytes} bytes; "
            "send a smaller request",
            413,
        )

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "websocket" and self.activity.draining:
            await receive()  # the connect message
            if "websocket.http.response" in scope.get("extensions", {}):
                await self._refuse(send, self.activity.refusal(), scope["path"], "websocket.http")
            else:
                await send({"type": "websocket.close", "code": 1013, "reason": "shutting down"})
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.activity.draining and scope["path"] != "/metrics":
            await self._refuse(send, self.activity.refusal(), scope["path"])
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._refuse(send, self._too_large(), scope["path"])
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                await self._refuse(send, self._too_large(), scope["path"])
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

        started = False

        async def tracked_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        self.activity.in_flight += 1
        try:
            await self.app(scope, replay, tracked_send)
        except Exception as exc:
            if started:
                raise  # the response is under way: nothing can be answered any more
            logger.exception("unexpected error on %s", scope["path"], exc_info=exc)
            await self._refuse(send, internal_error(exc), scope["path"])
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
