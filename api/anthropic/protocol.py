"""Request and response bodies of Anthropic's Messages API (``/v1/messages``), and its errors.

Requests accept unknown fields, as clients send extras (``cache_control`` on blocks,
``defer_loading`` on tools, ``service_tier``); ``messages_prompt`` decides, per documented field,
whether it is honoured, accepted without effect, or refused. Content blocks stay plain dicts here so
that an unsupported block (an image) is refused with a message naming it, not a schema error.

Errors are ``{"type": "error", "error": {"type", "message"}}`` with Anthropic's statuses: a full
queue or a draining server (503 elsewhere) is 529 ``overloaded_error``, which the Anthropic SDK
raises as ``OverloadedError`` and retries.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, StrictBool

from prefixserve.api.frontend.protocol import APIError, Lenient, random_id
from prefixserve.api.frontend.request import SamplingOptions


class AnthropicMessage(Lenient):
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(Lenient):
    """``POST /v1/messages/count_tokens``: what the prompt of a Messages request is made of."""

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    mcp_servers: list[dict[str, Any]] | None = None
    container: str | dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``. The fields after ``metadata`` are prefixserve's extensions, with
    their chat-completions meaning (the current Anthropic SDK sends even ``temperature`` through
    ``extra_body``)."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    metadata: dict[str, Any] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    min_p: float | None = None
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    cache_salt: str | None = None
    segment_reuse: StrictBool | None = None  # opt out of --segment-reuse (kv/segments.py)

    def sampling_options(self) -> SamplingOptions:
        """This request's sampling fields, as the shared front half takes them."""
        fields = self.model_dump(include={
            "temperature", "top_p", "top_k", "seed", "min_p", "repetition_penalty", "ignore_eos",
            "min_tokens", "cache_salt", "segment_reuse"}, exclude_unset=True)  # fmt: skip
        return SamplingOptions.of(**fields, stop=self.stop_sequences)


class CacheCreation(BaseModel):
    """The tokens written to the cache, by the TTL they were written for."""

    ephemeral_5m_input_tokens: int = 0
    ephemeral_1h_input_tokens: int = 0


class MessagesUsage(BaseModel):
    """The prompt split three ways (``cache_control.split_usage``): ``cache_read_input_tokens``
    came from the prefix cache, ``cache_creation_input_tokens`` were written to it (split by TTL
    in ``cache_creation``), ``input_tokens`` is the rest."""

    input_tokens: int = 0
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0
    cache_creation: CacheCreation = CacheCreation()


class MessagesResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("msg_"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: MessagesUsage


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def anthropic_error(exc: APIError) -> tuple[int, dict]:
    """``(status, body)`` of ``exc`` in Anthropic's shape; a 503 becomes 529 (overloaded)."""
    status = 529 if exc.status == 503 else exc.status
    err_type = _ERROR_TYPES.get(status, "api_error")
    return status, {"type": "error", "error": {"type": err_type, "message": exc.message}}


def is_messages_path(path: str) -> bool:
    """Whether errors on ``path`` take Anthropic's shape (``/v1/messages`` and below)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")
