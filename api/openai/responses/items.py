"""Responses items <-> chat messages.

Input items (``message``, ``function_call``, ``function_call_output``, ``reasoning``) are checked
and given ids (``normalize_input``), then turned into the chat messages the template renders
(``to_messages``):

    message (user | assistant | system | developer)  -> {"role", "content": text}  developer->system
    function_call, custom_tool_call (after an assistant -> that assistant message's tool_calls
      message, or alone)
    function_call_output, custom_tool_call_output      -> {"role": "tool", "tool_call_id", "content"}
    reasoning (content or summary: a string or parts)  -> "reasoning_content" of the next assistant
                                                          message (templates that show it use it);
                                                          reasoning that no assistant content or
                                                          call follows (an output that only
                                                          reasoned) is an assistant message of its
                                                          own, with content ""; reasoning at the
                                                          very end is the reply's start
                                                          (``split_trailing_reasoning``)

Consecutive assistant content and function calls form one assistant message, as the model wrote
them in one turn; so a response's own output items render back into the text it generated, and a
continuation's splice check (``responses_continuation``) passes.

A ``custom_tool_call`` is the assistant's call of a ``custom`` tool (``tools``): its ``input``
goes to the template as the arguments ``{"input": ...}``; its ``custom_tool_call_output`` is a
tool message.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from prefixserve.api.frontend.protocol import APIError, random_id

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
_ID_PREFIX = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_",
              "custom_tool_call": "ctc_", "custom_tool_call_output": "ctco_",
              "reasoning": "rs_"}  # fmt: skip
_CALLS = ("function_call", "custom_tool_call")
_OUTPUTS = ("function_call_output", "custom_tool_call_output")


def normalize_input(value: str | list[Any]) -> list[dict[str, Any]]:
    """The request's ``input`` as a list of typed items, each with an ``id`` (a 400 names the
    first bad item)."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    items = []
    for i, raw in enumerate(value):
        if not isinstance(raw, dict):
            raise _bad(i, "every item must be an object")
        item = copy.deepcopy(raw)
        kind = item.setdefault("type", "message")
        if not isinstance(kind, str) or kind not in _ID_PREFIX:
            raise _bad(
                i,
                f"items of type {kind!r} are not supported; send message, function_call, "
                "function_call_output, custom_tool_call, custom_tool_call_output or reasoning "
                "items",
            )
        _check(i, item)
        item.setdefault("id", random_id(_ID_PREFIX[kind]))
        if kind == "message":
            item["content"] = _content_parts(i, item)
        items.append(item)
    return items


def _check(i: int, item: dict[str, Any]) -> None:
    kind = item["type"]
    if kind == "message" and not (isinstance(item.get("role"), str) and item["role"] in _ROLES):
        raise _bad(i, f"role must be one of {sorted(_ROLES)}, got {item.get('role')!r}")
    if kind in _CALLS:
        for key in ("call_id", "name", "arguments" if kind == "function_call" else "input"):
            if not isinstance(item.get(key), str):
                raise _bad(i, f"a {kind} needs a string {key!r}")
    if kind == "reasoning":
        reasoning_text(i, item)
    if kind in _OUTPUTS:
        if not isinstance(item.get("call_id"), str):
            raise _bad(i, f"a {kind} needs a string 'call_id'")
        _text_of(i, item.get("output"), "output")


def _content_parts(i: int, item: dict[str, Any]) -> list[dict[str, Any]]:
    """A message's content as typed text parts (``input_text`` for input roles, ``output_text``
    for the assistant's)."""
    content = item.get("content")
    kind = "output_text" if item["role"] == "assistant" else "input_text"
    if isinstance(content, str):
        part = {"type": kind, "text": content}
        return [part | {"annotations": []} if kind == "output_text" else part]
    _text_of(i, content, "content")
    return content


def _text_of(i: int, value: Any, name: str) -> str:
    """The text of a string or a list of text parts; a 400 for anything else (images, files)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _bad(i, f"{name} must be a string or a list of text parts")
    texts = []
    for part in value:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _bad(
                i, f"{name}: this model reads text only (got a {kind!r} part); send text parts"
            )
        texts.append(part["text"])
    return "\n".join(texts)


def reasoning_text(i: int, item: dict[str, Any]) -> str:
    """A reasoning item's text: its ``content`` then its ``summary``, each a string or a list of
    text parts."""
    texts = [_text_of(i, item[key], key) for key in ("content", "summary") if item.get(key)]
    return "\n".join(texts)


def split_trailing_reasoning(
    items: list[dict[str, Any]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(the items, the reasoning items at their very end): reasoning that nothing follows is the
    start of the reply being generated, not a turn of the conversation."""
    end = len(items)
    while end and items[end - 1]["type"] == "reasoning":
        end -= 1
    return items[:end], items[end:]


def to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages of normalized items (see the module docstring)."""
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for i, item in enumerate(items):
        kind = item["type"]
        if kind == "reasoning":
            reasoning.append(reasoning_text(i, item))
            continue
        role = "assistant" if kind in _CALLS else "tool" if kind in _OUTPUTS else None
        role = role or _ROLES[item["role"]]
        if reasoning and role != "assistant":  # the turn that reasoned wrote nothing more
            messages.append({"role": "assistant", "content": "",
                             "reasoning_content": "\n".join(reasoning)})  # fmt: skip
            reasoning = []
        if kind in _OUTPUTS:
            text = _text_of(i, item["output"], "output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
            continue
        last = messages[-1] if messages else None
        if role == "assistant" and not (last and last["role"] == "assistant" and
                                        kind in _CALLS):  # fmt: skip
            last = {"role": "assistant", "content": None}
            messages.append(last)
        if kind in _CALLS:
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": _arguments(item)}}  # fmt: skip
            last.setdefault("tool_calls", []).append(call)
        elif role == "assistant":
            last["content"] = _text_of(i, item["content"], "content")
        else:
            messages.append({"role": role, "content": _text_of(i, item["content"], "content")})
        if role == "assistant" and reasoning:
            last["reasoning_content"] = "\n".join(reasoning)
            reasoning = []
    return messages


def _arguments(item: dict[str, Any]) -> str:
    """A call's arguments as the template gets them (a custom call's input as ``{"input"}``)."""
    if item["type"] == "custom_tool_call":
        return json.dumps({"input": item["input"]}, ensure_ascii=False)
    return item["arguments"]


def _bad(i: int, why: str) -> APIError:
    return APIError(f"input[{i}]: {why}", 400, "input")
