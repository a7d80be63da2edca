"""Text deltas of one reply -> Anthropic's content-block events.

``BlockEvents.feed`` takes the reply's new text and returns ``(event type, body)`` pairs:
``content_block_start``, ``content_block_delta`` (``text_delta`` or ``input_json_delta``) and
``content_block_stop``, with block indexes counting from 0 in order. With a reasoning parser
(``--reasoning-parser``), the reasoning comes first as a ``thinking`` block (``thinking_delta``). At most one block is open;
a block is closed before the next one starts and, on the final feed, before the message ends.

How calls are found depends on the chat ``ToolMode``, read by ``tool_call_streams.call_stream``
in ``tool_parser``'s syntax (hermes when None): none (all text); calls in free text (``auto``);
or forced calls (``required`` / named). Each call arrives whole once complete: a ``tool_use``
block start (its id and name), then its arguments in one ``input_json_delta``, as generated,
never re-serialized; a call whose arguments are not a JSON object is shown as text. Without
``parallel`` only the first call is kept (as the non-streamed reply). Whitespace-only text is held until non-whitespace text follows (then sent with
it) or a call starts (then dropped); on the final feed of a reply without calls it is sent.
"""

from __future__ import annotations

import json

from prefixserve.api.tool_call_streams import ToolMode, call_stream

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
    def __init__(
        self,
        mode: ToolMode,
        reasoner=None,
        tool_parser: str | None = None,
        tools: list[dict] | None = None,
        parallel: bool = True,
    ) -> None:
        self.mode = mode
        self.reasoner = reasoner  # a reasoning_parsers stream parser, or None
        self.calls = call_stream(mode, tool_parser, tools)
        self.parallel = parallel
        self.has_calls = False
        self._num_calls = 0  # calls read, kept or not
        self._count = 0  # blocks started
        self._open: str | None = None  # type of the open block
        self._held = ""

    def feed(self, text: str, final: bool = False) -> list[Event]:
        events: list[Event] = []
        if self.reasoner is not None:
            reasoning, text = self.reasoner.feed(text, final=final)
            if reasoning:
                if self._open != "thinking":
                    self._open_block({"type": "thinking", "thinking": "", "signature": ""}, events)
                self._delta({"type": "thinking_delta", "thinking": reasoning}, events)
        if self.calls is not None:
            content, calls = self.calls.feed(text, final=final)
            self._text(content, events)
            for call in calls:
                self._num_calls += 1
                if not self.parallel and self._num_calls > 1:
                    continue
                name, arguments = call.function.name, call.function.arguments
                if tool_input(arguments) is None:
                    self._text(unparsed_call_text(name, arguments), events)
                else:
                    self._start_tool(call.id, name, events)
                    self._json(arguments, events)
        else:
            self._text(text, events)
        if final:
            if self._held and not self.has_calls:
                self._open_block({"type": "text", "text": ""}, events)
                self._delta({"type": "text_delta", "text": self._held}, events)
            self._held = ""
            self._close(events)
        return events

    def _text(self, text: str, events: list[Event]) -> None:
        if not text:
            return
        if self._open != "text":
            if not (self._held + text).strip():
                self._held += text
                return
            text, self._held = self._held + text, ""
            self._open_block({"type": "text", "text": ""}, events)
        self._delta({"type": "text_delta", "text": text}, events)

    def _start_tool(self, call_id: str, name: str, events: list[Event]) -> None:
        self._held = ""
        self.has_calls = True
        self._open_block({"type": "tool_use", "id": call_id, "name": name, "input": {}}, events)

    def _json(self, fragment: str, events: list[Event]) -> None:
        if fragment:
            self._delta({"type": "input_json_delta", "partial_json": fragment}, events)

    def _open_block(self, block: dict, events: list[Event]) -> None:
        self._close(events)
        events.append(("content_block_start", {"index": self._count, "content_block": block}))
        self._open = block["type"]
        self._count += 1

    def _delta(self, delta: dict, events: list[Event]) -> None:
        events.append(("content_block_delta", {"index": self._count - 1, "delta": delta}))

    def _close(self, events: list[Event]) -> None:
        if self._open is not None:
            events.append(("content_block_stop", {"index": self._count - 1}))
            self._open = None
