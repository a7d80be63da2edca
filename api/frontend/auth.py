"""Authentication at the door: every route but the public ones knows its tenant, or is a 401.

``install_authentication(app, tenants, public)`` adds an HTTP middleware that reads the request's
credentials (``Authorization: Bearer KEY`` and ``x-api-key: KEY``), verifies them against the
server's keys (``frontend.tenancy.Tenants``) and leaves the tenant in ``request.state.tenant``
(``tenant_of``). ``public`` paths (/health and the operator's ``--public-route`` ones) skip it.
Without keys every credential is accepted and only names a store namespace. WebSocket upgrades
are authenticated by their handler (``responses.websocket``), not here.
"""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import FastAPI, Request

from prefixserve.api.frontend.errors import ErrorShapes
from prefixserve.api.frontend.protocol import APIError
from prefixserve.api.frontend.tenancy import Tenants


def install_authentication(
    app: FastAPI, tenants: Tenants, public: Iterable[str], shapes: ErrorShapes
) -> None:
    public = frozenset(public)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        if request.url.path not in public:
            headers = request.headers
            try:
                request.state.tenant = tenants.authenticate(headers.get("authorization"),
                                                            headers.get("x-api-key"))  # fmt: skip
            except APIError as exc:
                return shapes.response(exc, request.url.path)
        return await call_next(request)
