"""How every error the app raises becomes a protocol-shaped response.

``ErrorShapes`` says which body a path's errors take: OpenAI's, or the shape a protocol front
registers for its routes when the app is built (``api.server``: Anthropic's on /v1/messages and
below), so this shared half never imports a protocol. ``install_error_handlers`` maps::

    APIError                     its status and body, OpenAI's shape (Anthropic's on /v1/messages)
    RequestValidationError       400 naming the first bad field (``param``)
    InvalidArgumentError,        400: the engine refused the request's values (context length,
    CacheCapacityError           vocabulary, a cache too small for it)
    EngineDeadError              500: the engine loop died (/health says 503 meanwhile)
    an HTTP error from Starlette 400 for a body that is not JSON (why, and what to send), the
                                 route's own status otherwise (404 for an unknown path)

Anything else a handler raises is the gate's (``frontend.gate``): a shaped 500 that keeps the
connection.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from prefixserve.api.engine_client import EngineDeadError
from prefixserve.api.frontend.protocol import APIError, error_body
from prefixserve.core.errors import CacheCapacityError, InvalidArgumentError

Shape = Callable[[APIError], tuple[int, dict]]


@dataclass(frozen=True)
class ErrorShapes:
    """``routes``: a path, and everything below it, with the shape its errors take."""

    routes: tuple[tuple[str, Shape], ...] = ()

    def shape_of(self, path: str) -> Shape | None:
        return next((s for p, s in self.routes if path == p or path.startswith(p + "/")), None)

    def body(self, exc: APIError, path: str) -> tuple[int, dict]:
        """``(status, body)`` of ``exc`` on ``path``."""
        shape = self.shape_of(path)
        return shape(exc) if shape is not None else (exc.status, exc.body())

    def response(self, exc: APIError, path: str = "") -> JSONResponse:
        status, body = self.body(exc, path)
        return JSONResponse(body, status_code=status, headers=exc.headers)


OPENAI_ONLY = ErrorShapes()


def install_error_handlers(app: FastAPI, shapes: ErrorShapes) -> None:
    """Register the handlers of the module doc on ``app``."""

    async def on_api_error(request: Request, exc: APIError):
        return shapes.response(exc, request.url.path)

    async def on_validation(request: Request, exc: RequestValidationError):
        error = APIError(validation_message(exc), 400, validation_param(exc))
        return shapes.response(error, request.url.path)

    async def on_engine_error(request: Request, exc: Exception):
        error = APIError(str(exc), 400, getattr(exc, "param", None))
        return shapes.response(error, request.url.path)

    async def on_engine_dead(request: Request, exc: Exception):
        return shapes.response(APIError(str(exc), 500), request.url.path)

    async def on_http(request: Request, exc: StarletteHTTPException):
        path = request.url.path
        if exc.status_code == 400 and exc.__cause__ is not None:
            return shapes.response(APIError(body_error_message(exc.__cause__), 400), path)
        if shapes.shape_of(path) is not None:
            return shapes.response(APIError(str(exc.detail), exc.status_code), path)
        kind = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
        return JSONResponse(error_body(str(exc.detail), kind, exc.status_code), exc.status_code)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(EngineDeadError, on_engine_dead)
    app.add_exception_handler(InvalidArgumentError, on_engine_error)
    app.add_exception_handler(CacheCapacityError, on_engine_error)
    app.add_exception_handler(StarletteHTTPException, on_http)


def body_error_message(exc: BaseException | None) -> str:
    """Why a request body could not be parsed, and what to change."""
    if isinstance(exc, RecursionError):
        return "request body: the JSON is nested too deeply to parse; flatten it"
    if isinstance(exc, UnicodeDecodeError):
        return "request body: not valid UTF-8; send UTF-8 encoded JSON"
    return f"request body: could not be parsed as JSON ({exc!r}); send a JSON object"


def validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request"


def validation_param(exc: RequestValidationError) -> str | None:
    """The top-level field of the first error, as OpenAI's ``param``."""
    for err in exc.errors():
        loc = [x for x in err.get("loc", ()) if x != "body"]
        if loc and isinstance(loc[0], str):
            return loc[0]
    return None
