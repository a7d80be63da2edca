"""A response's output items, built from the model's text as it grows, with the typed stream
events that announce them, in OpenAI's order::

    message:        output_item.added, content_part.added, output_text.delta*,
                    output_text.done, content_part.done, output_item.done
    function_call:  output_item.added, function_call_arguments.delta*,
                    function_call_arguments.done, output_item.done

``feed`` takes the next piece of visible text (and, for plain text, its tokens' logprobs);
``finish`` closes what is open with the response's status. A non-streamed response feeds its
whole text once and ignores the events, so both paths build the same items. Invariants: the
deltas of an item concatenate to its final text or ``arguments``; every item added is done
exactly once; events carry no ``sequence_number`` (the stream numbers them).

How text becomes items depends on the tool mode (``ToolMode`` of the chat endpoint): plain text
is one message (``namespaces``: the namespace a function's calls name); forced calls
(``required`` / a named function) are read with the grammar's own syntax and each emitted whole
once complete, so a call cut off by ``max_output_tokens`` is neither streamed nor returned (as
chat completions); ``auto`` calls are parsed from the text (hermes), each emitted whole once its
closing tag arrives, with the text around them as messages.
"""

from __future__ import annotations

from typing import Any

from prefixserve.api.protocol import random_id
from prefixserve.api.serving_chat import ToolMode
from prefixserve.api.tool_parsers import HermesStreamParser, parse_forced_tool_calls


class ResponseOutput:
    def __init__(
        self, mode: ToolMode, with_logprobs: bool = False, namespaces: dict[str, str] | None = None
    ) -> None:
        self.mode = mode
        self.namespaces = namespaces or {}
        self.items: list[dict[str, Any]] = []
        self.with_logprobs = with_logprobs
        self._message: dict[str, Any] | None = None  # the open message item
        self._call: dict[str, Any] | None = None  # the open function call
        forced = mode in (ToolMode.REQUIRED, ToolMode.NAMED)
        self._forced: list[str] | None = [] if forced else None  # forced text so far
        self._num_forced = 0  # forced calls emitted
        self._hermes = HermesStreamParser() if mode is ToolMode.AUTO else None

    @property
    def text(self) -> str:
        """All message text so far (``output_text``)."""
        return "".join(
            part["text"] for item in self.items if item["type"] == "message"
            for part in item["content"]
        )  # fmt: skip

    def feed(
        self, text: str, logprobs: list[dict] | None = None, final: bool = False
    ) -> list[dict]:
        """Events for the next ``text`` (``final``: no more text will come)."""
        if self._forced is not None:
            return self._feed_forced(text)
        if self._hermes is None:
            return self._text(text, logprobs) if text or logprobs else []
        content, calls = self._hermes.feed(text, final=final)
        events = self._text(content, None) if content else []
        for call in calls:
            events += self._close_message("completed")
            events += self._add_call(call.function.name)
            events += self._call_arguments(call.function.arguments)
            events += self._close_call("completed")
        return events

    def finish(self, status: str) -> list[dict]:
        """Close the open items with ``status`` ("completed" or "incomplete")."""
        return self._close_message(status) + self._close_call(status)

    def _feed_forced(self, text: str) -> list[dict]:
        self._forced.append(text)
        events: list[dict] = []
        for call in parse_forced_tool_calls("".join(self._forced))[self._num_forced :]:
            events += self._add_call(call.function.name)
            events += self._call_arguments(call.function.arguments)
            events += self._close_call("completed")
            self._num_forced += 1
        return events

    def _text(self, text: str, logprobs: list[dict] | None) -> list[dict]:
        events: list[dict] = []
        if self._message is None:
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": []}
            if self.with_logprobs:
                part["logprobs"] = []
            self._message = {"id": random_id("msg_"), "type": "message", "status": "in_progress",
                             "role": "assistant", "content": []}  # fmt: skip
            events.append(self._added(self._message))
            events.append({"type": "response.content_part.added", **self._at(self._message),
                           "content_index": 0, "part": dict(part)})  # fmt: skip
            self._message["content"].append(part)
        part = self._message["content"][0]
        part["text"] += text
        delta = {"type": "response.output_text.delta", **self._at(self._message),
                 "content_index": 0, "delta": text, "logprobs": logprobs or []}  # fmt: skip
        if self.with_logprobs:
            part["logprobs"] = part["logprobs"] + (logprobs or [])
        return [*events, delta]

    def _close_message(self, status: str) -> list[dict]:
        item, self._message = self._message, None
        if item is None:
            return []
        part, at = item["content"][0], self._at(item)
        item["status"] = status
        done = {"type": "response.output_text.done", **at, "content_index": 0, "text": part["text"],
                "logprobs": part.get("logprobs", [])}  # fmt: skip
        return [done, {"type": "response.content_part.done", **at, "content_index": 0,
                       "part": part}, self._done(item)]  # fmt: skip

    def _add_call(self, name: str) -> list[dict]:
        self._call = {"id": random_id("fc_"), "type": "function_call", "status": "in_progress",
                      "call_id": random_id("call_"), "name": name, "arguments": ""}  # fmt: skip
        if name in self.namespaces:
            self._call["namespace"] = self.namespaces[name]
        return [self._added(self._call)]

    def _call_arguments(self, text: str) -> list[dict]:
        self._call["arguments"] += text
        return [{"type": "response.function_call_arguments.delta", **self._at(self._call),
                 "delta": text}]  # fmt: skip

    def _close_call(self, status: str) -> list[dict]:
        item, self._call = self._call, None
        if item is None:
            return []
        item["status"] = status
        done = {"type": "response.function_call_arguments.done", **self._at(item),
                "name": item["name"], "arguments": item["arguments"]}  # fmt: skip
        return [done, self._done(item)]

    def _added(self, item: dict[str, Any]) -> dict:
        self.items.append(item)
        return {"type": "response.output_item.added", "output_index": len(self.items) - 1,
                "item": _snapshot(item)}  # fmt: skip

    def _done(self, item: dict[str, Any]) -> dict:
        return {"type": "response.output_item.done", "output_index": self.items.index(item),
                "item": _snapshot(item)}  # fmt: skip

    def _at(self, item: dict[str, Any]) -> dict:
        return {"item_id": item["id"], "output_index": self.items.index(item)}


def _snapshot(item: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``item`` as it is now (events must not change when the item grows later)."""
    return (
        {**item, "content": [dict(p) for p in item["content"]]} if "content" in item else dict(item)
    )
