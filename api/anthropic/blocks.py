"""A reply's parts -> Anthropic's content-block events, and the content they add up to.

``BlockEvents.feed`` takes the reply's new text (and, on the last feed, its ``Finish``), reads it
with the request's ``ReplyParser`` and returns ``(event type, body)`` pairs:
``content_block_start``, ``content_block_delta`` (``thinking_delta``, ``text_delta`` or
``input_json_delta``) and ``content_block_stop``, with block indexes counting from 0 in order. At
most one block is open; a block is closed before the next one starts and at the end.

The reasoning (``--reasoning-parser``) comes first as a ``thinking`` block; each call, once
complete, as a ``tool_use`` block (its id and name, then its arguments in one
``input_json_delta``, as generated, never re-serialized); a call whose arguments are not a JSON
object is shown as text. A non-streamed reply is ``content_of`` the events of one feed of its
whole text, so streamed and non-streamed content are the same blocks.
"""

from __future__ import annotations

import json

from prefixserve.api.parsing import reply

Event = tuple[str, dict]


def tool_input(arguments: str) -> dict | None:
    """A call's arguments text as Anthropic's ``input`` object; None if it is not one."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def unparsed_call_text(name: str, arguments: str) -> str:
    """How a call whose arguments are not a JSON object is shown: as text."""
    return json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)


class BlockEvents:
    def __init__(self, parser: reply.ReplyParser) -> None:
        self.parser = parser
        self.first_call: str | None = None  # the id of the first tool_use block
        self._count = 0  # blocks started
        self._open: str | None = None  # type of the open block
        self._call: list[str] = []  # the call being read: id, name, arguments

    @property
    def has_calls(self) -> bool:
        return self.first_call is not None

    def feed(self, text: str, finish: reply.Finish | None = None) -> list[Event]:
        events: list[Event] = []
        for part in self.parser.feed(text, finish):
            if isinstance(part, reply.ReasoningDelta):
                self._delta("thinking", {"type": "thinking_delta", "thinking": part.text}, events)
            elif isinstance(part, reply.TextDelta):
                self._text(part.text, events)
            elif isinstance(part, reply.ToolCallDelta):
                self._call = self._call if part.call_id is None else [part.call_id,
                                                                     part.name or "", ""]  # fmt: skip
                self._call[2] += part.arguments
                if part.done:
                    self._tool_use(*self._call, events)
            elif isinstance(part, reply.Finish):
                self._close(events)
        return events

    def _tool_use(self, call_id: str, name: str, arguments: str, events: list[Event]) -> None:
        if tool_input(arguments) is None:
            self._text(unparsed_call_text(name, arguments), events)
            return
        self.first_call = self.first_call or call_id
        self._open_block({"type": "tool_use", "id": call_id, "name": name, "input": {}}, events)
        self._delta("tool_use", {"type": "input_json_delta", "partial_json": arguments}, events)

    def _text(self, text: str, events: list[Event]) -> None:
        self._delta("text", {"type": "text_delta", "text": text}, events)

    def _delta(self, kind: str, delta: dict, events: list[Event]) -> None:
        if self._open != kind:
            empty = {"thinking": {"thinking": "", "signature": ""}, "text": {"text": ""}}
            self._open_block({"type": kind, **empty[kind]}, events)
        events.append(("content_block_delta", {"index": self._count - 1, "delta": delta}))

    def _open_block(self, block: dict, events: list[Event]) -> None:
        self._close(events)
        events.append(("content_block_start", {"index": self._count, "content_block": block}))
        self._open = block["type"]
        self._count += 1

    def _close(self, events: list[Event]) -> None:
        if self._open is not None:
            events.append(("content_block_stop", {"index": self._count - 1}))
            self._open = None


def content_of(events: list[Event]) -> list[dict]:
    """The content blocks that ``events`` stream (a ``tool_use``'s ``input`` parsed)."""
    blocks: list[dict] = []
    for kind, body in events:
        if kind == "content_block_start":
            blocks.append(dict(body["content_block"]))
        elif kind == "content_block_delta":
            block, delta = blocks[body["index"]], body["delta"]
            key = {"thinking_delta": "thinking", "text_delta": "text"}.get(delta["type"])
            if key is not None:
                block[key] += delta[key]
            else:
                block["input"] = tool_input(delta["partial_json"])
    return blocks
