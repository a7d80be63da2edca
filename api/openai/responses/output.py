"""A response's output items, built from the model's text as it grows, with the typed stream
events that announce them, in OpenAI's order::

    reasoning:      output_item.added, content_part.added, reasoning_text.delta*,
                    reasoning_text.done, content_part.done, output_item.done
    message:        output_item.added, content_part.added, output_text.delta*,
                    output_text.done, content_part.done, output_item.done
    function_call:  output_item.added, function_call_arguments.delta*,
                    function_call_arguments.done, output_item.done
    custom_tool_call: output_item.added, custom_tool_call_input.delta,
                    custom_tool_call_input.done, output_item.done

``feed`` takes the next piece of visible text (and, for plain text, its tokens' logprobs);
``finish`` closes what is open with the response's status. A non-streamed response feeds its
whole text once and ignores the events, so both paths build the same items. Invariants: the
deltas of an item concatenate to its final text or ``arguments``; every item added is done
exactly once; events carry no ``sequence_number`` (the stream numbers them).

The parts come from the request's ``ReplyParser`` (``parsing/reply``): the reasoning block first,
as one ``reasoning`` item (``summary`` [], its text in one ``reasoning_text`` part), closed when
the answer starts; text as messages; each call as a ``function_call`` item, emitted whole once
complete (a call cut off by ``max_output_tokens`` is neither streamed nor returned in forced
modes, and stays text in ``auto``). Logprobs ride on plain text only (no tool mode), never on
reasoning. A call's ``call_id`` is the parser's id (Mistral templates need the 9-character one
the model wrote); ``namespaces``: the namespace a function's calls name; ``custom``: the custom
tools, whose calls (a function of ``input``, ``tools``) are ``custom_tool_call`` items.
"""

from __future__ import annotations

import json
from typing import Any

from prefixserve.api.frontend.protocol import random_id
from prefixserve.api.parsing import reply
from prefixserve.api.parsing.reply import ReplyParser


class ResponseOutput:
    def __init__(
        self,
        parser: ReplyParser,
        with_logprobs: bool = False,
        namespaces: dict[str, str] | None = None,
        custom: frozenset[str] = frozenset(),
    ) -> None:
        self.parser = parser
        self.namespaces = namespaces or {}
        self.custom = custom
        self._custom: list[str] = []  # a custom tool's call being read: call id, name, arguments
        self.items: list[dict[str, Any]] = []
        self.with_logprobs = with_logprobs
        self._reasoned = False
        self._thinking: dict[str, Any] | None = None  # the open reasoning item
        self._message: dict[str, Any] | None = None  # the open message item
        self._call: dict[str, Any] | None = None  # the open function call

    @property
    def text(self) -> str:
        """All message text so far (``output_text``)."""
        return "".join(
            part["text"] for item in self.items if item["type"] == "message"
            for part in item["content"]
        )  # fmt: skip

    @property
    def reasoning(self) -> str | None:
        """The reasoning text; None when the output has no reasoning block."""
        if not self._reasoned:
            return None
        items = [item for item in self.items if item["type"] == "reasoning"]
        return items[0]["content"][0]["text"] if items else ""

    def feed(
        self, text: str, logprobs: list[dict] | None = None, finish: reply.Finish | None = None
    ) -> list[dict]:
        """Events for the next ``text`` and its tokens' ``logprobs`` (``finish``: the last)."""
        parts = self.parser.feed(text, finish)
        plain = self.parser.mode is reply.ToolMode.NONE
        events: list[dict] = []
        for part in parts:
            if isinstance(part, reply.ReasoningDelta):
                events += self._reasoning_text(part.text)
            elif isinstance(part, reply.TextDelta):
                events += self._close_reasoning("completed")
                events += self._text(part.text, logprobs if plain else None)
                logprobs = None
            elif isinstance(part, reply.ToolCallDelta):
                events += self._call_delta(part)
            elif isinstance(part, reply.Finish):
                self._reasoned = part.reasoned
        if plain and logprobs and self.parser.reasoner is None:
            events += self._text("", logprobs)  # tokens whose text is still held back
        return events

    def finish(self, status: str) -> list[dict]:
        """Close the open items with ``status`` ("completed" or "incomplete")."""
        return (
            self._close_reasoning(status) + self._close_message(status) + self._close_call(status)
        )

    def _reasoning_text(self, text: str) -> list[dict]:
        events: list[dict] = []
        if self._thinking is None:
            self._thinking = {"id": random_id("rs_"), "type": "reasoning", "status": "in_progress",
                              "summary": [], "content": []}  # fmt: skip
            part = {"type": "reasoning_text", "text": ""}
            events.append(self._added(self._thinking))
            events.append({"type": "response.content_part.added", **self._at(self._thinking),
                           "content_index": 0, "part": dict(part)})  # fmt: skip
            self._thinking["content"].append(part)
        self._thinking["content"][0]["text"] += text
        delta = {"type": "response.reasoning_text.delta", **self._at(self._thinking),
                 "content_index": 0, "delta": text}  # fmt: skip
        return [*events, delta]

    def _close_reasoning(self, status: str) -> list[dict]:
        item, self._thinking = self._thinking, None
        return self._close_text_item(item, status)

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
        return self._close_text_item(item, status)

    def _close_text_item(self, item: dict[str, Any] | None, status: str) -> list[dict]:
        """A reasoning or message item's end: its text's done, its part's done, its own done."""
        if item is None:
            return []
        part, at = item["content"][0], self._at(item)
        item["status"] = status
        done = {"type": f"response.{part['type']}.done", **at, "content_index": 0,
                "text": part["text"]}  # fmt: skip
        if part["type"] == "output_text":
            done["logprobs"] = part.get("logprobs", [])
        return [done, {"type": "response.content_part.done", **at, "content_index": 0,
                       "part": dict(part)}, self._done(item)]  # fmt: skip

    def _add_call(self, name: str, call_id: str) -> list[dict]:
        self._call = {"id": random_id("fc_"), "type": "function_call", "status": "in_progress",
                      "call_id": call_id, "name": name, "arguments": ""}  # fmt: skip
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

    def _call_delta(self, part: reply.ToolCallDelta) -> list[dict]:
        """A function call's item and its arguments deltas; a custom tool's call whole at its
        end (its input is read from its arguments)."""
        events: list[dict] = []
        if part.call_id is not None:
            events += self._close_reasoning("completed") + self._close_message("completed")
            if part.name in self.custom:
                self._custom = [part.call_id, part.name or "", ""]
            else:
                events += self._add_call(part.name or "", part.call_id)
        if self._custom:
            self._custom[2] += part.arguments
        elif part.arguments:
            events += self._call_arguments(part.arguments)
        if part.done and self._custom:
            events += self._custom_call(*self._custom)
            self._custom = []
        elif part.done:
            events += self._close_call("completed")
        return events

    def _custom_call(self, call_id: str, name: str, arguments: str) -> list[dict]:
        """A custom tool's call, whole: its input is the ``input`` of the call's arguments."""
        try:
            value = json.loads(arguments)
        except ValueError:
            value = None
        text = value.get("input") if isinstance(value, dict) else None
        text = text if isinstance(text, str) else arguments
        item = {"id": random_id("ctc_"), "type": "custom_tool_call", "status": "completed",
                "call_id": call_id, "name": name, "input": ""}  # fmt: skip
        added = self._added(item)
        item["input"] = text
        at = self._at(item)
        return [added, {"type": "response.custom_tool_call_input.delta", **at, "delta": text},
                {"type": "response.custom_tool_call_input.done", **at, "input": text},
                self._done(item)]  # fmt: skip

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
