"""What every protocol front shares on the wire: ``APIError`` (a typed error the HTTP layer turns
into the protocol's error body), OpenAI's error shape, ids, the lenient request base (clients
send extra fields freely: unknown fields are accepted and ignored; a float field must be finite,
as JSON parsers here read ``1e400`` as infinity and accept ``NaN``), and ``ToolRequest``, the tool
fields of any protocol's request in one shape."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict


def random_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


class Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """A protocol's tool fields, normalized. ``tools``: the chat-template function definitions
    (None without tools); ``choice``: "none", "auto", "required" or "named" (``name``);
    ``parallel``: more than one call allowed; ``strict``: tools whose ``auto`` calls a grammar
    constrains (Responses' ``strict``); ``grammar_tools``: the tools a forced grammar uses instead
    of ``tools`` (Messages' testing aid)."""

    tools: list[dict[str, Any]] | None = None
    choice: str = "none"
    name: str | None = None
    parallel: bool = True
    strict: frozenset[str] = frozenset()
    grammar_tools: list[dict[str, Any]] | None = None


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "TimeoutError",
    413: "RequestTooLargeError",
    499: "ClientDisconnectedError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error the HTTP layer returns as an OpenAI-shaped body with ``status``.

    ``err_type`` overrides the type derived from the status; ``headers`` go on the response (e.g.
    ``Retry-After`` on a 503).
    """

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        err_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.err_type = err_type
        self.headers = headers or {}

    @property
    def type(self) -> str:
        if self.err_type is not None:
            return self.err_type
        return _ERROR_TYPES.get(self.status, "InternalServerError")

    def body(self) -> dict:
        return error_body(self.message, self.type, self.status, self.param)


def internal_error(exc: BaseException) -> APIError:
    """The 500 an unexpected exception is answered with (a bug, logged where it is caught): its
    kind only, never its text, which may hold internals."""
    return APIError(f"internal error ({type(exc).__name__}); the server logged it, retry or "
                    "report it", 500, err_type="internal_error")  # fmt: skip
