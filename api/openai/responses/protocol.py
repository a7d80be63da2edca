"""The body of ``POST /v1/responses`` (OpenAI's Responses API) and the fields it refuses.

Every field OpenAI documents is honoured, accepted without effect and named in the
``x-prefixserve-ignored`` response header (``text.verbosity``; ``reasoning.effort`` where the
chat template has no thinking switch: ``frontend/reasoning_effort.py``), or refused with a 400
naming it (``check_supported``); fields nobody documents are accepted and ignored, as on the
other endpoints. ``cache_salt`` (vLLM's) names the tenant's prefix-cache and store namespace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, StrictBool

from prefixserve.api.frontend.protocol import APIError, Lenient
from prefixserve.api.frontend.reasoning_effort import EFFORTS
from prefixserve.api.openai.protocol import SEED_MAX, SEED_MIN
from prefixserve.core.sampling_params import MAX_LOGPROBS

INCLUDABLE = ("message.output_text.logprobs", "reasoning.encrypted_content")
"""``include`` values honoured: logprobs on output text; encrypted reasoning, of which this
server has none to send (it keeps reasoning in its store instead)."""


class ResponsesRequest(Lenient):
    model: str | None = None
    input: str | list[Any] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    metadata: dict[str, str] | None = None
    text: dict[str, Any] | None = None
    store: bool = True
    stream: bool = False
    previous_response_id: str | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None  # api.openai.prompt_cache
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    stream_options: dict[str, Any] | None = None  # include_obfuscation: no padding is sent
    cache_salt: str | None = None
    segment_reuse: StrictBool | None = None  # opt out of --segment-reuse (kv/segments.py)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    generate: bool = True  # Codex's WebSocket warm-up sends false: prefill, write nothing


def _unset(value: Any) -> bool:
    return value is None


# name -> (accepted value?, why it is refused)
_REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "background": (
        lambda v: v in (None, False),
        "background responses are not supported; send the request and wait, or stream it",
    ),
    "conversation": (_unset, "conversations are not supported; use previous_response_id"),
    "prompt": (_unset, "stored prompt templates are not supported"),
    "reasoning": (
        lambda v: v is None or (isinstance(v, dict) and v.get("effort") in (None, *EFFORTS)),
        f"reasoning.effort: one of {list(EFFORTS)}",
    ),
    "max_tool_calls": (_unset, "max_tool_calls is not supported"),
    "context_management": (_unset, "context management (compaction) is not supported"),
    "moderation": (_unset, "moderation is not supported"),
    "prompt_cache_options": (_unset, "the prefix cache is always implicit"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "there is one service tier"),
}


def check_supported(req: ResponsesRequest) -> None:
    """Raise a 400 for the first documented field set to a value this server cannot honour."""
    for name, (accepted, why) in _REFUSED.items():
        if not accepted(getattr(req, name, None)):
            raise APIError(f"{name}: {why}; leave it out", 400, name)
    for value in req.include or []:
        if value not in INCLUDABLE:
            raise APIError(
                f"include: {value!r} is not supported; the supported values are {list(INCLUDABLE)}",
                400,
                "include",
            )
    if req.metadata is not None and (
        len(req.metadata) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in req.metadata.items())
    ):
        raise APIError(
            "metadata: at most 16 pairs, keys up to 64 and values up to 512 characters",
            400,
            "metadata",
        )
    if (req.text or {}).get("verbosity") not in (None, "low", "medium", "high"):
        raise APIError("text.verbosity: 'low', 'medium' or 'high'", 400, "text")


def refused_fields() -> list[str]:
    """Every field refused (at some value), for docs/responses-api.md and tests."""
    return sorted({*_REFUSED, "include"})


def effort_of(req: ResponsesRequest) -> str | None:
    """``reasoning.effort`` (None when not given)."""
    return (req.reasoning or {}).get("effort")
