"""Incremental detokenization with stop strings.

Two stages per update::

    token ids ─decode a small window─> new text ─stop search─> released | held back
               (prefix_offset, read_offset)    (held: at most max_stop_len - 1 chars)

Decoding: ``tokens[prefix_offset:read_offset]`` were decoded before as ``prefix_text``; decoding
``tokens[prefix_offset:]`` and dropping ``prefix_text`` gives the new text. The window restarts at
each release, so one token costs O(1) however long the output. Text that ends with U+FFFD (an
incomplete UTF-8 character, which later tokens may complete) is not released yet.

Stop strings: a stop string ending in the new text starts at most ``max_stop_len - 1`` characters
before it, and exactly those characters are held back, so the search looks at held + new text only.
The stop string that completes first in the text wins (ties: the longer one), the same answer as
feeding the text one character at a time.
"""

from __future__ import annotations

import copy
from typing import Any

# Prompt tokens decoded before the first generated token, so that its leading space (which
# SentencePiece-style decoders strip at the start of a text) is kept.
_PROMPT_CONTEXT = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text, releasing only final text.

    Invariants on ``output_text``: it never holds any part of a matched stop string (unless
    ``include_stop_str_in_output``, then the stop string and nothing after it), never a suffix that
    could still begin a stop string, and never ends with U+FFFD while more tokens could complete
    that character. After ``flush`` (or a stop), for ordinary text it equals
    ``tokenizer.decode(generated ids)`` cut at the stop string.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self.stop_reason: str | None = None
        self._hold_len = max((len(s) for s in self.stop), default=1) - 1
        self._token_ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self._token_ids)
        self._held = ""  # decoded, not released: a possible start of a stop string
        self._released: list[str] = []
        self._finished = False

    def fork(self) -> IncrementalDetokenizer:
        """An independent copy at the same state (a forked sequence continues from here)."""
        child = copy.copy(self)
        child._token_ids = list(self._token_ids)
        child._released = list(self._released)
        return child

    @property
    def output_text(self) -> str:
        """Text released so far. It only grows: streaming sends what it gained since last read."""
        if len(self._released) > 1:
            self._released = ["".join(self._released)]
        return self._released[0] if self._released else ""

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append generated tokens; return the stop string that now matched, else None.

        After a match the output is final: it ends before the stop string (or after it with
        ``include_stop_str_in_output``) and no more tokens may be added.
        """
        assert not self._finished, "update() after the detokenizer finished"
        self._token_ids.extend(new_token_ids)
        return self._add_text(self._decode_new_text(final=False))

    def flush(self) -> str | None:
        """The request finished for another reason: release all held text.

        Text the decoder still held (an unfinished UTF-8 character) is searched for stop strings
        too; the matched stop string is returned, else None.
        """
        if self._finished:
            return self.stop_reason
        stop = self._add_text(self._decode_new_text(final=True))
        if stop is None:
            self._release(self._held)
            self._held = ""
            self._finished = True
        return stop

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(
            self._token_ids[start:end],
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _decode_new_text(self, final: bool) -> str:
        """Text of the tokens past ``read_offset``; empty while it may change (unless final)."""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        if len(new_text) <= len(prefix_text):
            return ""
        if new_text.endswith(_REPLACEMENT_CHAR) and not final:
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self._token_ids)
        return new_text[len(prefix_text) :]

    def _add_text(self, text: str) -> str | None:
        """Search held + ``text`` for a stop string; release what can no longer be part of one."""
        if not text:
            return None
        buf = self._held + text
        match = self._find_stop(buf)
        if match is not None:
            start, stop = match
            self._release(
                buf[: start + len(stop)] if self.include_stop_str_in_output else buf[:start]
            )
            self._held = ""
            self.stop_reason = stop
            self._finished = True
            return stop
        cut = len(buf) - self._hold_len
        self._release(buf[:cut] if cut > 0 else "")
        self._held = buf[max(cut, 0) :]
        return None

    def _find_stop(self, buf: str) -> tuple[int, str] | None:
        return find_stop(buf, self.stop)

    def _release(self, text: str) -> None:
        if text:
            self._released.append(text)


def find_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The earliest-ending stop string in ``text`` (ties: the longest), as (start, stop string)."""
    best: tuple[int, int, str] | None = None
    for stop in stops:
        start = text.find(stop)
        if start < 0:
            continue
        key = (start + len(stop), -len(stop), stop)
        if best is None or key < best:
            best = key
    if best is None:
        return None
    end, neg_len, stop = best
    return end + neg_len, stop
