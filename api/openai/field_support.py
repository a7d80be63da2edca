"""Fields OpenAI or vLLM document for these endpoints that prefixserve does not implement.

An option is honoured or refused, never silently dropped: a request that sets one of these to a
value that would change its result gets a 400 naming the field. A value that changes nothing
(``null``, the default, ``modalities: ["text"]``, ``best_of`` equal to ``n``) is accepted. Fields
nobody documents are accepted and ignored, since clients send extras.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefixserve.api.frontend.protocol import APIError
from prefixserve.api.frontend.reasoning_effort import EFFORTS


def _unset(value: Any) -> bool:
    return value is None


def _false(value: Any) -> bool:
    return value is None or value is False


# name -> (accepted value?, why it is refused)
_COMMON: dict[str, tuple[Callable[[Any], bool], str]] = {
    "logits_processors": (_unset, "custom logits processors are not supported"),
    "guided_decoding_backend": (
        lambda v: v in (None, "auto", "xgrammar"),
        "the only structured-output backend is xgrammar",
    ),
    "guided_whitespace_pattern": (_unset, "JSON whitespace is fixed (see docs/tool-calling.md)"),
    "priority": (lambda v: v in (None, 0), "priority scheduling is not supported"),
    "kv_transfer_params": (_unset, "disaggregated prefill is not supported"),
    "vllm_xargs": (_unset, "vllm_xargs is not supported"),
    "spaces_between_special_tokens": (
        lambda v: v in (None, True),
        "spaces_between_special_tokens=false is not supported",
    ),
    "mm_processor_kwargs": (_unset, "this model accepts text only"),
    "prompt_embeds": (_unset, "prompt embeddings are not supported; send text or token ids"),
    "store": (_false, "completions are not stored"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "there is one service tier"),
}
_CHAT: dict[str, tuple[Callable[[Any], bool], str]] = {
    "audio": (_unset, "audio output is not supported"),
    "modalities": (lambda v: v in (None, ["text"]), "only text output is supported"),
    "prediction": (_unset, "predicted outputs are not supported"),
    "reasoning_effort": (lambda v: v is None or v in EFFORTS, f"must be one of {list(EFFORTS)}"),
    "verbosity": (_unset, "verbosity is not supported"),
    "web_search_options": (_unset, "web search is not supported"),
    "functions": (_unset, "the deprecated 'functions' is not supported; use 'tools'"),
    "function_call": (_unset, "the deprecated 'function_call' is not supported; use 'tool_choice'"),
}
_COMPLETIONS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "suffix": (_unset, "suffix (fill-in-the-middle) is not supported"),
}


def check_supported(req: Any, endpoint: str) -> None:
    """Raise a 400 for the first documented field set to a value prefixserve cannot honour."""
    refused = {**_COMMON, **(_CHAT if endpoint == "chat" else _COMPLETIONS)}
    for name, (accepted, why) in refused.items():
        value = getattr(req, name, None)
        if not accepted(value):
            raise APIError(f"{name}: {why}; leave it out", 400, name)
    best_of = getattr(req, "best_of", None)
    if best_of is not None and best_of != req.n:
        raise APIError(
            f"best_of: only best_of == n is supported (got {best_of} for n={req.n}); leave it "
            "out or use use_beam_search",
            400,
            "best_of",
        )


def refused_fields() -> list[str]:
    """Every field this module refuses, for docs/api-fields.md and tests."""
    return sorted({*_COMMON, *_CHAT, *_COMPLETIONS, "best_of"})
