"""Authentication at the door: every route but the public ones knows its tenant, or is a 401.

``install_authentication(app, tenants, public)`` adds an ASGI middleware (``Authentication``)
that reads an HTTP request's credentials (``Authorization: Bearer KEY`` and ``x-api-key: KEY``),
verifies them against the server's keys (``frontend.tenancy.Tenants``) and leaves the tenant in
``request.state.tenant`` (``tenant_of``). ``public`` paths (/health and the operator's
``--public-route`` ones) skip it. Without keys every credential is accepted and only names a
store namespace. WebSocket upgrades are authenticated by their handler
(``responses.websocket``), not here.

It is a pure ASGI middleware, not Starlette's ``@app.middleware("http")``: that one hands every
message of a streamed reply from the app's task to the server's through a memory stream, two
task switches and anyio's checkpoints per server-sent event, about a third of the event loop's
CPU time per streamed token (py-spy, 8 streams). Here the app's ``send`` is the server's.
"""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import FastAPI, Request

from prefixserve.api.frontend.errors import ErrorShapes
from prefixserve.api.frontend.protocol import APIError
from prefixserve.api.frontend.tenancy import Tenants


class Authentication:
    """ASGI middleware: an HTTP request off the ``public`` paths gets its tenant in its scope's
    state (what ``request.state.tenant`` reads) or is answered with the 401 in its path's
    error shape; every other scope passes through untouched."""

    def __init__(self, app, tenants: Tenants, public: frozenset[str], shapes: ErrorShapes) -> None:
        self.app, self.tenants, self.public, self.shapes = app, tenants, public, shapes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            request = Request(scope)
            path = request.url.path
            if path not in self.public:
                headers = request.headers
                try:
                    request.state.tenant = self.tenants.authenticate(
                        headers.get("authorization"), headers.get("x-api-key")
                    )
                except APIError as exc:
                    await self.shapes.response(exc, path)(scope, receive, send)
                    return
        await self.app(scope, receive, send)


def install_authentication(
    app: FastAPI, tenants: Tenants, public: Iterable[str], shapes: ErrorShapes
) -> None:
    app.add_middleware(Authentication, tenants=tenants, public=frozenset(public), shapes=shapes)
