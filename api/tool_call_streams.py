"""Which reader turns a reply's text into content and tool calls, for every endpoint.

Responses and Messages read calls this way (``call_stream``); chat completions picks the same
syntax (``forced_syntax``) but streams forced hermes calls argument by argument
(``tool_parsers.ForcedToolCallDeltas``) and reads a whole reply with the parser's ``parse``:

    mode NONE                 no reader: all text is content
    mode AUTO                 ``--tool-call-parser``'s syntax (``tool_call_parsers``), content kept
    forced (REQUIRED / NAMED) the forced syntax (``forced_syntax``): hermes through the grammar's
                              own reader (``parse_forced_tool_calls``), another family through its
                              parser; content dropped (the grammar allows nothing but calls)

Every reader has ``feed(delta, final) -> (content delta, new complete calls)`` and ``has_calls``.
A whole reply is read by feeding it once with ``final=True``, so streamed and non-streamed replies
are built by one reader and agree for any split of the text (the parsers' own invariant).
"""

from __future__ import annotations

import enum
from typing import Any

from prefixserve.api.protocol import ToolCall
from prefixserve.api.tool_call_parsers import tool_call_parser
from prefixserve.api.tool_parsers import parse_forced_tool_calls

from prefixserve.structured_outputs.tool_call_syntaxes import SYNTAXES


class ToolMode(enum.Enum):
    """How a chat request's tool calls come out: none; parsed from free text when the model
    chooses to call (``auto``); forced by a grammar, any listed function (``required``) or one
    named function."""

    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


def forced_syntax(tool_parser: str | None) -> str:
    """The syntax a grammar forces calls in: the parser's family where a grammar can generate
    it, else hermes (the built-in template's)."""
    return tool_parser if tool_parser in SYNTAXES else "hermes"


class ForcedHermesStream:
    """Forced hermes output: each call once complete (read as the grammar wrote it, arguments
    never re-serialized); a call cut off is never returned."""

    def __init__(self) -> None:
        self.text = ""
        self.calls: list[ToolCall] = []

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.text += delta
        new = parse_forced_tool_calls(self.text)[len(self.calls) :]
        self.calls.extend(new)
        return "", new


class ContentDropped:
    """A parser stream whose content is dropped: forced output in another family's syntax."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream

    @property
    def has_calls(self) -> bool:
        return self.stream.has_calls

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        return "", self.stream.feed(delta, final)[1]


def call_stream(mode: ToolMode, tool_parser: str | None, tools: list[dict] | None):
    """A fresh reader of one reply's calls in ``mode`` (None for ``ToolMode.NONE``)."""
    if mode is ToolMode.NONE:
        return None
    if mode is ToolMode.AUTO:
        return tool_call_parser(tool_parser or "hermes", tools).stream()
    syntax = forced_syntax(tool_parser)
    if syntax == "hermes":
        return ForcedHermesStream()
    return ContentDropped(tool_call_parser(syntax, tools).stream())
