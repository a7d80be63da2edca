"""The authentication middleware: the tenant of a request's key in ``request.state``, a 401 in
the path's error shape, public paths open, and a streamed reply's messages handed to the server
by the task that produced them (no task relaying them, as Starlette's ``@app.middleware`` would)."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from prefixserve.api.frontend.auth import install_authentication
from prefixserve.api.frontend.errors import ErrorShapes
from prefixserve.api.frontend.tenancy import Tenants, tenant_of
from tests.aio import run


def app_and_senders() -> tuple[FastAPI, list[tuple[asyncio.Task, bytes]]]:
    """An app behind the middleware whose /stream yields its producing task's id per chunk; the
    server side records which task sent each body message."""
    app = FastAPI()
    install_authentication(app, Tenants({"k1": "alice"}), {"/health"}, ErrorShapes())

    @app.get("/whoami")
    async def whoami(request: Request):
        return {"tenant": tenant_of(request).identity}

    @app.get("/health")
    async def health():
        return {"ok": True}

    producers: list[asyncio.Task] = []

    @app.get("/stream")
    async def stream():
        async def chunks():
            for piece in ("a", "b", "c"):
                producers.append(asyncio.current_task())
                yield piece

        return StreamingResponse(chunks())

    senders: list[tuple[asyncio.Task, bytes]] = []

    async def server_side(scope, receive, send):
        async def recording_send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                senders.append((asyncio.current_task(), message["body"]))
            await send(message)

        await app(scope, receive, recording_send)

    server_side.producers = producers  # type: ignore[attr-defined]
    return server_side, senders


async def get(server, path: str, **headers: str) -> httpx.Response:
    """``GET path`` from ``server`` in process (httpx's ASGI transport)."""
    transport = httpx.ASGITransport(app=server)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        return await client.get(path, headers=headers)


@run
async def test_keys_name_tenants_public_paths_are_open_and_a_bad_key_is_a_401():
    server, _ = app_and_senders()
    ok = await get(server, "/whoami", Authorization="Bearer k1")
    bad = await get(server, "/whoami", **{"x-api-key": "nope"})
    health = await get(server, "/health")
    assert ok.json() == {"tenant": "alice"}
    assert bad.status_code == 401 and "valid API key" in bad.json()["error"]["message"]
    assert health.json() == {"ok": True}


@run
async def test_a_streamed_replys_chunks_reach_the_server_from_the_task_that_made_them():
    server, senders = app_and_senders()
    reply = await get(server, "/stream", **{"x-api-key": "k1"})
    assert reply.text == "abc"
    assert [body for _, body in senders] == [b"a", b"b", b"c"]
    assert [task for task, _ in senders] == server.producers
