"""One reply parser for every protocol: a reply's text -> typed parts, streamed and whole alike.

A ``ReplyParser`` reads one reply (one choice). ``feed(delta)`` returns the parts the new text
completes, in order; the last feed passes ``finish`` and ends with a ``Finish`` part::

    ReasoningDelta(text)                     the reasoning block (``--reasoning-parser``), first
    TextDelta(text)                          content
    ToolCallDelta(index, arguments,          a call: its id and name first, argument deltas that
                  call_id, name, done)       concatenate to its arguments text, done at its end
    Finish(reason, stop_reason, called, reasoned)

Which text is what: the reasoning parser splits the reasoning off first; the rest is read by the
tool mode's reader (``tool_calls``): none (all content), ``auto`` (calls in the
``--tool-call-parser`` syntax, content kept), or forced (``required`` / named: calls in the
forced syntax, content dropped, since the grammar allows nothing but calls; a call cut off is
neither content nor a call). Without ``parallel`` only the first call is kept. In tool modes,
whitespace-only content is held until more content follows (sent with it) or a call starts
(dropped), and sent at the end of a reply without calls.

Invariant (``tests/test_reply_parser.py``, a property test over every syntax): for any split of a
reply's text into deltas, ``fold`` of the parts equals ``fold`` of one feed of the whole text.
A non-streamed reply is exactly that one feed, so each protocol's streamed and whole replies are
built from the same parts. Calls come whole once complete (one delta: id, name, all arguments,
done).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from prefixserve.api.parsing.reasoning import ThinkReasoningParser
from prefixserve.api.parsing.tool_calls import ParsedCall, ToolCallStream, tool_call_parser
from prefixserve.structured_outputs.tool_call_syntaxes import SYNTAXES


class ToolMode(enum.Enum):
    """How a request's tool calls come out: none; parsed from free text when the model chooses
    to call (``auto``); forced by a grammar, any listed function (``required``) or one named
    function."""

    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"

    @property
    def forced(self) -> bool:
        return self in (ToolMode.REQUIRED, ToolMode.NAMED)


def forced_syntax(tool_parser: str | None) -> str:
    """The syntax a grammar forces calls in: the parser's family where a grammar can generate
    it, else hermes (the built-in template's)."""
    return tool_parser if tool_parser in SYNTAXES else "hermes"


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """The next piece of call ``index``: its ``call_id`` and ``name`` on its first delta (None
    on later ones), more of its ``arguments`` text, and ``done`` on its last."""

    index: int
    arguments: str
    call_id: str | None = None
    name: str | None = None
    done: bool = False


@dataclass(frozen=True, slots=True)
class Finish:
    """The engine's ``reason`` ("stop", "length", "abort") and ``stop_reason`` (the matched stop
    string or token); ``called``: the reply kept a call; ``reasoned``: it has a reasoning block."""

    reason: str | None
    stop_reason: str | int | None = None
    called: bool = False
    reasoned: bool = False


Part = ReasoningDelta | TextDelta | ToolCallDelta | Finish


class ReplyParser:
    def __init__(self, mode: ToolMode, tool_parser: str | None = None,
                 tools: list[dict[str, Any]] | None = None,
                 reasoner: ThinkReasoningParser | None = None, parallel: bool = True) -> None:  # fmt: skip
        self.mode = mode
        self.reasoner = reasoner
        self.parallel = parallel
        syntax = forced_syntax(tool_parser) if mode.forced else tool_parser or "hermes"
        self._calls: ToolCallStream | None = (
            None if mode is ToolMode.NONE else tool_call_parser(syntax, tools).stream()
        )
        self._num_calls = 0  # calls read, kept or not
        self._kept = 0
        self._held = ""  # whitespace-only content that a call may still drop
        self._texting = False  # content was sent since the last call

    def feed(self, text: str, finish: Finish | None = None) -> list[Part]:
        """The parts ``text`` completes; ``finish`` (the engine's reasons, ``called`` and
        ``reasoned`` left to the parser) marks the reply's last feed."""
        final = finish is not None
        parts: list[Part] = []
        if self.reasoner is not None:
            reasoning, text = self.reasoner.feed(text, final=final)
            if reasoning:
                parts.append(ReasoningDelta(reasoning))
        if self._calls is None:
            parts += [TextDelta(text)] if text else []
        else:
            for piece in self._calls.feed(text, final=final):
                parts += self._call(piece) if isinstance(piece, ParsedCall) else self._text(piece)
            if final and self._held and not self._kept:
                parts.append(TextDelta(self._held))
            self._held = "" if final else self._held
        if finish is not None:
            reasoned = self.reasoner is not None and self.reasoner.has_reasoning
            parts.append(Finish(finish.reason, finish.stop_reason, self._kept > 0, reasoned))
        return parts

    def _text(self, text: str) -> list[Part]:
        if self.mode.forced:
            return []
        if not self._texting and not (self._held + text).strip():
            self._held += text
            return []
        text, self._held, self._texting = self._held + text, "", True
        return [TextDelta(text)]

    def _call(self, call: ParsedCall) -> list[Part]:
        self._num_calls += 1
        self._held, self._texting = "", False
        if not self.parallel and self._num_calls > 1:
            return []
        index, self._kept = self._kept, self._kept + 1
        return [ToolCallDelta(index, call.arguments, call.id, call.name, done=True)]


@dataclass
class Reply:
    """A whole reply folded from its parts: ``reasoning`` (None without a reasoning block), the
    content ``text``, the ``calls`` and the ``finish``."""

    reasoning: str | None = None
    text: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    finish: Finish | None = None

    def add(self, parts: list[Part]) -> Reply:
        for part in parts:
            if isinstance(part, ReasoningDelta):
                self.reasoning = (self.reasoning or "") + part.text
            elif isinstance(part, TextDelta):
                self.text += part.text
            elif isinstance(part, ToolCallDelta) and part.call_id is not None:
                self.calls.append(ParsedCall(part.name or "", part.arguments, part.call_id))
            elif isinstance(part, ToolCallDelta):
                call = self.calls[part.index]
                self.calls[part.index] = ParsedCall(call.name, call.arguments + part.arguments,
                                                    call.id)  # fmt: skip
            elif isinstance(part, Finish):
                self.finish = part
                if part.reasoned and self.reasoning is None:
                    self.reasoning = ""
        return self


def first_call(parts: list[Part]) -> str | None:
    """The id of the first call that starts in ``parts`` (None if none does)."""
    return next((p.call_id for p in parts if isinstance(p, ToolCallDelta) and p.call_id), None)


def fold(parts: list[Part]) -> Reply:
    return Reply().add(parts)
