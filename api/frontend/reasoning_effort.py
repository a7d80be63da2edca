"""A reasoning effort (chat completions' ``reasoning_effort``, Responses' ``reasoning.effort``) as
the chat template's thinking switch.

Where the template reads ``enable_thinking`` (Qwen3 and its kind), ``none`` and ``minimal`` render
with it false and the other efforts with it true; a request's own
``chat_template_kwargs.enable_thinking`` wins over its effort. Where the template has no such
switch the effort changes nothing, and the response names the field in its
``x-prefixserve-ignored`` header.
"""

from __future__ import annotations

from typing import Any

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def effort_kwargs(effort: str | None, chat_template: Any) -> dict[str, bool] | None:
    """The chat-template kwargs ``effort`` sets: ``{}`` without an effort, ``{"enable_thinking":
    ...}`` where ``chat_template`` has the switch, None where it has not (the effort is
    ignored)."""
    if effort is None:
        return {}
    if "enable_thinking" not in str(chat_template or ""):
        return None
    return {"enable_thinking": effort not in ("none", "minimal")}
