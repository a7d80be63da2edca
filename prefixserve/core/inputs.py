"""The prompts the offline API accepts, as vLLM's ``TextPrompt`` and ``TokensPrompt``.

A prompt is a string, a list of token ids, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``;
``LLM.generate`` takes one prompt or a list of them, kinds mixed. A dict key prefixserve would not
honour (``multi_modal_data``, ``cache_salt``, ...) is an ``InvalidArgumentError`` naming it, never
dropped: set ``cache_salt`` on the sampling parameters instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypedDict

from prefixserve.core.errors import InvalidArgumentError


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt

_EXPECTED = (
    "prompts: expected a string, a list of token ids, {'prompt': str}, "
    "{'prompt_token_ids': [int, ...]}, or a list of those"
)


def parse_prompts(prompts: Any) -> list[str | list[int]]:
    """Every prompt of ``prompts`` (one prompt or a list) as a string or a list of token ids."""
    if isinstance(prompts, (str, dict)):
        return [_parse_one(prompts)]
    if isinstance(prompts, Sequence) and prompts and all(_is_token_id(t) for t in prompts):
        return [list(prompts)]
    if isinstance(prompts, Sequence):
        return [_parse_one(p) for p in prompts]
    raise InvalidArgumentError(_EXPECTED, "prompts")


def _parse_one(prompt: Any) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(_is_token_id(t) for t in prompt):
        return list(prompt)
    if not isinstance(prompt, dict):
        raise InvalidArgumentError(_EXPECTED, "prompts")
    extra = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
    if extra:
        raise InvalidArgumentError(
            f"prompts: {extra} not supported in a prompt dict; give 'prompt' or "
            "'prompt_token_ids' only (cache_salt goes on the sampling parameters)",
            "prompts",
        )
    if len(prompt) != 1:
        raise InvalidArgumentError(
            "prompts: a prompt dict has exactly one of 'prompt' and 'prompt_token_ids'", "prompts"
        )
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise InvalidArgumentError("prompts: 'prompt' must be a string", "prompts")
        return prompt["prompt"]
    ids = prompt["prompt_token_ids"]
    if not isinstance(ids, list) or not all(_is_token_id(t) for t in ids):
        raise InvalidArgumentError(
            "prompts: 'prompt_token_ids' must be a list of token ids", "prompts"
        )
    return list(ids)


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
