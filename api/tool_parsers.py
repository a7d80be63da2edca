"""Tool calls in the output: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Free text (``tool_choice`` "auto", hermes): ``parse_tool_calls`` reads a finished text;
``HermesStreamParser`` reads it in pieces and emits content deltas and whole tool calls.
Invariant of the stream parser: the concatenation of emitted content equals the text outside the
tool-call tags, and every call is emitted once, in order, as soon as its closing tag arrives.
Text that could still begin ``<tool_call>`` is held back.

Forced calls (``tool_choice`` "required" or named; the grammar fixed their shape):
``parse_forced_tool_calls`` and ``ForcedToolCallDeltas``, which streams OpenAI's deltas: a call's
id and name first, then its raw ``arguments`` text (never re-serialized, so the client sends back
exactly what was generated and the next turn hits the prefix cache). Only complete calls are
returned or streamed, so a call cut off by ``max_tokens`` is in neither reply.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from prefixserve.api.protocol import FunctionCall, ToolCall

from prefixserve.structured_outputs import tool_calls as forced

START, END = "<tool_call>", "</tool_call>"
_CALL_RE = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", re.DOTALL)


def _to_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ToolCall(function=FunctionCall(name=obj["name"], arguments=arguments))


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Split a finished output into (content or None, tool calls). Unparseable calls stay content."""
    calls = [_to_call(m.group(1).strip()) for m in _CALL_RE.finditer(text)]
    if not calls or any(c is None for c in calls):
        return text, []
    content = text[: text.index(START)].strip()
    return content or None, calls  # type: ignore[return-value]


@dataclass
class HermesStreamParser:
    """Feed text deltas; get back (content delta, completed tool calls)."""

    buffer: str = ""
    in_call: bool = False
    calls: list[ToolCall] = field(default_factory=list)

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        content, new_calls = "", []
        while True:
            if self.in_call:
                end = self.buffer.find(END)
                if end < 0:
                    break
                body, self.buffer = self.buffer[:end], self.buffer[end + len(END) :]
                self.in_call = False
                call = _to_call(body.strip())
                if call is None:
                    content += START + body + END
                else:
                    new_calls.append(call)
                continue
            start = self.buffer.find(START)
            if start >= 0:
                content += self.buffer[:start]
                self.buffer, self.in_call = self.buffer[start + len(START) :], True
                continue
            cut = len(self.buffer) - (0 if final else _partial_tag_len(self.buffer))
            content, self.buffer = content + self.buffer[:cut], self.buffer[cut:]
            break
        if final and self.in_call:
            call = _to_call(self.buffer.strip())
            if call is None:
                content += START + self.buffer
            else:
                new_calls.append(call)
            self.buffer, self.in_call = "", False
        if (self.calls or new_calls or self.in_call) and not content.strip():
            content = ""  # whitespace between or after calls is not content
        self.calls.extend(new_calls)
        return content, new_calls


def _partial_tag_len(text: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0


def parse_forced_tool_calls(text: str) -> list[ToolCall]:
    """The complete calls of grammar-forced output. The grammar allows nothing but calls, so
    whatever follows them is a call cut off (``max_tokens``, a stop string): it is dropped, not
    returned as content or as a call, as OpenAI and vLLM do."""
    calls, _ = forced.parse_tool_calls(text)
    return [ToolCall(function=FunctionCall(name=n, arguments=a)) for n, a in calls]


class ForcedToolCallDeltas:
    """Feed text deltas of forced output; get OpenAI ``delta.tool_calls`` entries for each call
    once it is complete: its id and name (arguments ""), then its whole raw arguments, two
    entries for two chunks. The text is read with ``parse_forced_tool_calls``, so the stream
    carries exactly the calls of the non-streamed reply: a call cut off is never sent."""

    def __init__(self) -> None:
        self._text = ""
        self._num_calls = 0

    @property
    def has_calls(self) -> bool:
        return self._num_calls > 0

    def feed(self, text: str) -> list[dict]:
        self._text += text
        if END not in self._text[-(len(text) + len(END) - 1) :]:
            return []  # no call can have completed
        out: list[dict] = []
        for call in parse_forced_tool_calls(self._text)[self._num_calls :]:
            function = call.function
            out.append({"index": self._num_calls, "id": call.id, "type": "function",
                        "function": {"name": function.name, "arguments": ""}})  # fmt: skip
            out.append({"index": self._num_calls, "function": {"arguments": function.arguments}})
            self._num_calls += 1
        return out
